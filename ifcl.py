"""IFCL: Identical and Fraternal Twins: Fine-Grained Semantic Contrastive Learning of Sentence
Representations.

Qingfa Xiao, Shuangyin Li, Lei Chen. ECAI 2023. arXiv:2307.10932. BibTeX key: xiao2023identical.

What it adds to SimCSE:
  - a third view, the fraternal twin h^-: the sentence's embedding-layer output fused with that of
    its German translation (Eq. 2, 3), with its own InfoNCE (Eq. 7);
  - the Twins loss (Eq. 8): e^{sim(h,h+)} - e^{sim(h,h-)} kept at the embedding layer's margin;
  - a hippocampus queue of earlier anchors as extra negatives, older ones down-weighted (Eq. 4, 6).

Run:
  python ifcl.py                           # bert-base + mBERT embeddings on wiki1m, Tab. 6's settings
  python ifcl.py --model sentence-transformers/all-MiniLM-L6-v2 --fraternal_model \\
      sentence-transformers/all-MiniLM-L6-v2 --data data/multi30k/train.en --fraternal_data \\
      data/multi30k/train.de --max_steps 40 --eval_every 10   # a CPU run on English-German pairs
  python ifcl.py --no_queue                # an ablation: Tab. 2 "w/o HQ"
The default needs three models from the hub (t5-base, mBERT, bert-base), and its first run translates
the 1M sentences into German with t5-base (not timed on a CPU: a GPU is the place for it) into
data/wiki1m_for_simcse.de.t5-base.txt, then trains; later runs reuse that file
(`python tools/translate.py` makes it alone; --fraternal_data takes one made elsewhere).

docs/ifcl.md: the paper's rows, each with its command; the German file; where the code departs
from the paper; what metrics.jsonl shows; DDP; the measured numbers (a MiniLM testbed).
"""

from __future__ import annotations

import plumbing.interrupts  # first: Ctrl-C in the imports: one line. Not found? Run it inside its clone

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import UserError, arg
from plumbing import translation

# =====================================================================================
# Hyperparameters (English setting, BERT-base)
# =====================================================================================

@dataclass
class Args(common.TrainArgs):
    """The shared flags are common.TrainArgs (SimCSE's defaults); IFCL changes and adds:"""
    SOURCES = {"epochs": "paper Sec. 4.1", "seed": "ours"}
    # the German side's file, its MT model and its embedding layer: a run with others still
    # shows the paper's rows (a reference)
    OWN_ROW_FREE = ("fraternal_data", "mt_model", "fraternal_model")
    INPUTS = ("fraternal_data",)        # x^-: an edit of the file between a stop and --resume is refused
    data: str = arg(common.in_data("wiki1m_for_simcse.txt"), "English sentences, one a line",
                    "paper Sec. 4.1")
    fraternal_data: str = arg("", "German translations of --data, one a line, parallel to it; "
                              "left out: made from --data with --mt_model on the first run and "
                              "kept beside --data (or in --cache_dir) for the next ones", "paper Sec. 4.1")
    mt_model: str = arg("t5-base", "any Hugging Face seq2seq model that translates --data when "
                        "--fraternal_data is left out (T5: the paper; the size is ours)", "paper Sec. 4.1")
    model: str = arg("bert-base-uncased", "hub name or local folder of the encoder", "paper App. C")
    # NOTE(paper vs paper): Sec. 4.1 names stefan-it/albert-large-german-cased "for German", App. C
    # bert-base-multilingual-uncased. Eq. (3) adds the two embedding outputs position by position,
    # so both need the encoder's width: mBERT's is 768, as BERT-base's; the German ALBERT's are
    # 128 (1024 after its own projection), which would need a projection the paper never mentions
    fraternal_model: str = arg("bert-base-multilingual-uncased", "model whose embedding layer and "
                               "tokenizer embed the German side (BEL_F), as wide as --model's",
                               "paper App. C")
    batch_size: int = arg(64, "sentences per step N (global, over all GPUs)", "paper Tab. 6", ge=1)
    max_len: int = arg(32, "tokens per training sentence, both languages", "paper Tab. 6", ge=1)
    lr: float = arg(1e-5, "peak learning rate, decayed linearly to 0", "paper Tab. 6", gt=0)
    eval_every: int = arg(151, "steps between STS-B dev evaluations", "paper Sec. 4.1", ge=1)
    cache_dir: str = arg("", "where tokenised data is cached, and the German file made from --data "
                         "(default: .cache/ and the German file beside --data)")
    tau: float = arg(0.05, "temperature of Eq. (6) and (7)", "paper Tab. 6", gt=0,
                     note="The paper uses 0.05 (Tab. 6; 0.034 for Chinese).")
    dropout: float = arg(0.15, "dropout rate rho of the encoder (makes h and h^+ differ)", "paper Tab. 6",
                         ge=0, lt=1, note="A rate; the paper uses 0.15 (Tab. 6).")
    eps: float = arg(0.9, "fusion rate epsilon of Eq. (3): weight of the English embedding", "paper Tab. 6",
                     ge=0, le=1, note="Eq. (3) mixes the two embeddings; the paper uses 0.9 (Tab. 6).")
    lam: float = arg(0.002, "forgetting rate lambda of Eq. (4)", "paper Tab. 6", ge=0,
                     note="The paper uses 0.002 (Tab. 6).")
    queue_len: int = arg(416, "hippocampus queue length k*N (need not be a multiple of N)", "paper Tab. 6",
                         ge=0, note="The paper uses 416 and tries 320 to 512 (Tab. 5).")
    margin: str = arg("computed", "M_i of Eq. (8): computed from the embedding layer, or fixed "
                      "e^omega_a - e^omega_b", "ours", choices=["computed", "fixed"])
    omega_a: float = arg(0.85, "'similarity omega_a' (used by --margin fixed)", "paper Tab. 6", ge=-1, le=1,
                         note="A cosine similarity; the paper lists 0.85 (Tab. 6).")
    omega_b: float = arg(0.80, "'similarity omega_b' (used by --margin fixed)", "paper Tab. 6", ge=-1, le=1,
                         note="A cosine similarity; the paper lists 0.80 (Tab. 6).")
    fuse: str = arg("layer", "what Eq. (3) fuses: the embedding layer's output (word+position+"
                    "type, LayerNorm) or the word embeddings only", "ours", choices=["layer", "word"])
    train_embeddings: bool = arg(False, "train the encoder's embedding layer BEL_S (Eq. 1 calls it "
                                 "'without trainable parameters')", "paper Sec. 3.1.1")
    # NOTE(ours): the paper says twice that IFCL is built on Sentence-BERT (no MLP); by default
    # SimCSE's recipe, an MLP over [CLS] in training only: the paper's Tab. 2 calls its bottom
    # row SimCSE, and its 76.83 is SimCSE's published STS-B figure (76.85)
    no_mlp: bool = arg(False, "no MLP over [CLS] in training (Sentence-BERT's pipeline); the queue "
                       "then holds raw [CLS]", "ours")
    # Tab. 1's caption: [CLS] trains, the mean of the last layer is evaluated. An encoder already
    # tuned for its mean (all-MiniLM-L6-v2, the testbed's) scores well there untrained, so a run
    # is read there on [CLS], the output the loss trains
    pooler: str = arg("avg", "sentence vector of the evaluations, best/ and the saved model: avg = mean "
                      "of the last layer (the paper's), cls_before_pooler = raw [CLS]", "paper Tab. 1",
                      choices=["avg", "cls_before_pooler"])
    no_fraternal: bool = arg(False, "drop the fraternal twins (and so Eq. 7 and the Twins loss)",
                             "paper Tab. 2")
    no_twins: bool = arg(False, "drop the Twins loss, Eq. (8)", "paper Tab. 2")
    no_queue: bool = arg(False, "drop the hippocampus queue (phi = 0 in Eq. 6)", "paper Tab. 2")

    def __post_init__(self) -> None:
        if self.no_fraternal:  # Tab. 2 "w/o FI, TL": the Twins loss compares h^+ with h^-
            self.no_twins = True

    def rules(self) -> None:
        if self.data.lower().endswith(".csv"):
            raise UserError(f"--data {self.data}: IFCL is unsupervised; give a text file with one "
                            f"English sentence a line.")
        if not self.no_queue and 1 - self.lam * math.ceil(self.queue_len / self.batch_size) <= 0:
            raise UserError(f"--queue_len {self.queue_len} with --lam {self.lam} and --batch_size "
                            f"{self.batch_size}: every forgetting coefficient 1 - lam*ceil(m/N) must be "
                            f"positive; shorten the queue or lower --lam.")
        if self.margin == "fixed" and self.omega_a < self.omega_b:
            raise UserError(f"--omega_a {self.omega_a} below --omega_b {self.omega_b}: the identical "
                            f"twins are the closer ones (Eq. 8, M = e^omega_a - e^omega_b >= 0). Pass "
                            f"--omega_a >= --omega_b (the paper's: 0.85 and 0.80).")


# =====================================================================================
# PAPER-SPECIFIC: the fusion, the hippocampus queue's forgetting coefficients, the losses
# =====================================================================================

def fuse(y: torch.Tensor, y_frat: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. (3): the fraternal input, the sentence's embedding fused with its German twin's,
    position by position: y = BEL_S(x) (N, L, d), y_frat = BEL_F(x^-) (N, L, d)."""
    # Eq. (3), f_theta's input: eps * y_i + (1 - eps) * y_i^-, where y_i^- = BEL_F(x_i^-) (Eq. 2)
    return eps * y + (1 - eps) * y_frat.to(y.dtype)                          # (N, L, d)


def forgetting_coefficients(queue_len: int, batch_size: int, lam: float) -> torch.Tensor:
    """Eq. (4): weight of each queue slot; slot 0 holds the newest anchor."""
    m = torch.arange(1, queue_len + 1, dtype=torch.float32)                  # (M,)  m = 1..k*N
    # Eq. (4): p_m = 1 - lambda * ceil(m / N)
    return 1 - lam * torch.ceil(m / batch_size)                              # (M,)


@common.fp32
def identical_loss(h: torch.Tensor, h_pos: torch.Tensor, queue: torch.Tensor, p: torch.Tensor,
                   tau: float) -> torch.Tensor:
    """Eq. (6): InfoNCE of the identical twins, with the queued anchors H_m as extra negatives
    weighted by p_m. queue (M, d) may have M = 0; a slot with p_m = 0 counts for nothing."""
    # Eq. (5): sim(h_i, h_j) = h_i^T h_j / (||h_i|| ||h_j||): unit rows, then dot products
    h = F.normalize(h, dim=-1)                                               # (N, d)
    sim = h @ F.normalize(h_pos, dim=-1).T                                   # (N, N)   sim(h_i, h_j^+)
    # the queue only feeds the loss: no gradient reaches H_m (Sec. 3.3)
    sim_q = h @ F.normalize(queue.detach().to(h.dtype), dim=-1).T            # (N, M)   sim(h_i, H_m)
    # phi = sum_m p_m e^{sim(h_i,H_m)/tau}: the weight enters as log p_m inside one logsumexp
    log_p = torch.log(p.to(sim.device, torch.float32))                       # (M,)  -inf where p_m = 0
    logits = torch.cat([sim / tau, sim_q / tau + log_p], 1)                  # (N, N + M)
    # Eq. (6): l_i = -log e^{sim(h_i,h_i^+)/tau} / (sum_j e^{sim(h_i,h_j^+)/tau} + phi)
    labels = torch.arange(h.shape[0], device=h.device)                       # (N,)
    return F.cross_entropy(logits, labels)                                   # ()


@common.fp32
def fraternal_loss(h: torch.Tensor, h_frat: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (7): InfoNCE of the fraternal twins, in-batch negatives only (no queue)."""
    sim = F.normalize(h, dim=-1) @ F.normalize(h_frat, dim=-1).T             # (N, N)   sim(h_i, h_j^-)
    # Eq. (7): l_i = -log e^{sim(h_i,h_i^-)/tau} / sum_j e^{sim(h_i,h_j^-)/tau}
    labels = torch.arange(h.shape[0], device=h.device)                      # (N,)
    return F.cross_entropy(sim / tau, labels)                                # ()


@common.fp32
def twins_loss(h: torch.Tensor, h_pos: torch.Tensor, h_frat: torch.Tensor,
               margin: torch.Tensor) -> torch.Tensor:
    """Eq. (8): keep the gap between the identical and the fraternal similarity at M_i."""
    s_pos = F.cosine_similarity(h, h_pos, dim=-1)                            # (N,)  sim(h_i, h_i^+)
    s_frat = F.cosine_similarity(h, h_frat, dim=-1)                          # (N,)  sim(h_i, h_i^-)
    # Eq. (8): l_i = | e^{sim(h_i,h_i^+)} - e^{sim(h_i,h_i^-)} - M_i |
    return (s_pos.exp() - s_frat.exp() - margin).abs().mean()                # ()


@common.fp32
def innate_margin(emb: torch.Tensor, emb_pos: torch.Tensor, emb_frat: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """M_i of Eq. (8) from the dropout-augmented embedding-layer outputs (N, L, d), all three
    pooled over the same tokens, the anchor's (`mask`, (N, L)). Returns (N,), detached.
    NOTE(ours): the paper gives no pooling for sim(emb_i, emb_i^+); we take the masked mean
    over tokens, then cosine. Detached: M_i is a target, not a path for gradient.
    NOTE(ours): the same tokens for the three views, so that M_i measures the two augmentations
    (dropout, fusion) and nothing else. Pooling emb^- over the fused input's (union) mask would
    average in the English side's [PAD] embeddings wherever the German is the longer, and M_i
    would then measure padding (0.82 on all-MiniLM-L6-v2 and Multi30k, 0.0147
    without; docs/ifcl.md, "What metrics.jsonl shows", has both figures and their commands)."""
    e, e_pos, e_frat = (common.masked_mean(x, mask) for x in (emb, emb_pos, emb_frat))  # (N, d) x3
    s_pos = F.cosine_similarity(e, e_pos, dim=-1)                            # (N,)  sim(emb_i, emb_i^+)
    s_frat = F.cosine_similarity(e, e_frat, dim=-1)                          # (N,)  sim(emb_i, emb_i^-)
    # Eq. (8): M_i = e^{sim(emb_i, emb_i^+)} - e^{sim(emb_i, emb_i^-)}
    return (s_pos.exp() - s_frat.exp()).detach()                             # (N,)


def fixed_margin(omega_a: float, omega_b: float) -> float:
    """NOTE(ours): Tab. 6 lists omega_a, omega_b ('similarity') but the text never uses them;
    one reading is a constant margin M = e^omega_a - e^omega_b (--margin fixed)."""
    return math.exp(omega_a) - math.exp(omega_b)


@common.fp32
def twins_stats(h: torch.Tensor, h_pos: torch.Tensor, h_frat: torch.Tensor | None = None) -> dict:
    """Batch means of sim(h_i, h_i^+) and, with h^-, of sim(h_i, h_i^-) and of the Twins gap
    e^{sim(h_i,h_i^+)} - e^{sim(h_i,h_i^-)}, which Eq. (8) pulls towards M_i. Detached."""
    s_pos = F.cosine_similarity(h, h_pos, dim=-1)                            # (N,)
    stats = {"cos_identical": s_pos.mean()}                                  # ()
    if h_frat is not None:
        s_frat = F.cosine_similarity(h, h_frat, dim=-1)                      # (N,)
        stats["cos_fraternal"] = s_frat.mean()                               # ()
        stats["twins_gap"] = (s_pos.exp() - s_frat.exp()).mean()             # ()
    return {k: v.detach() for k, v in stats.items()}


def queue_fill(filled: torch.Tensor, queue_len: int) -> torch.Tensor:
    """The share of the queue's slots that hold anchors, 0..1 (queue_len > 0)."""
    return filled.float() / queue_len                                        # ()


# =====================================================================================
# PAPER-SPECIFIC: the model (Algorithm 1: three views in one pass, the fusion, the queue)
# =====================================================================================

class IFCL(nn.Module):
    """One batch of Algorithm 1: y = BEL_S(x) and y^- = BEL_F(x^-) (Eq. 2), the fusion (Eq. 3),
    dropout on emb, emb^+ and emb^- (lines 3-6, dropout after the fusion), the transformer
    layers f_theta on the 3N rows in ONE pass (lines 7-9), the losses (Eq. 6-9), the queue
    update (line 23)."""

    def __init__(self, encoder: nn.Module, bel_f: nn.Module | None, args: Args, pad_id: int,
                 pad_id_frat: int):
        super().__init__()
        self.encoder, self.bel_f, self.args = encoder, bel_f, args
        self.pad_id, self.pad_id_frat = pad_id, pad_id_frat
        d = encoder.config.hidden_size
        self.mlp = None if args.no_mlp else common.MLP(d)   # see Args.no_mlp's NOTE
        emb = encoder.embeddings
        # NOTE(ours): Eq. (1) calls BEL_S "without trainable parameters": frozen by default.
        for prm in emb.parameters():
            prm.requires_grad_(args.train_embeddings)
        # the embedding layer's own dropout (rate rho) moves after the fusion (three_views)
        self.rho = emb.dropout.p
        emb.dropout = nn.Identity()
        if bel_f is not None:  # BEL_F: frozen, no dropout of its own
            bel_f.requires_grad_(False)
            bel_f.dropout = nn.Identity()
        # the hippocampus queue: slot 0 newest; `filled` slots hold anchors of earlier steps
        m = 0 if args.no_queue else args.queue_len
        self.register_buffer("queue", torch.zeros(m, d))                     # (M, d)
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))    # ()

    def f_theta(self, emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoder's transformer layers on a given embedding-layer output (B, L, d), then
        [CLS] -> MLP (raw [CLS] with --no_mlp): (B, d)."""
        # A Hugging Face model's forward takes token ids or word embeddings, never the embedding
        # layer's output; its layer stack (.encoder in BERT and RoBERTa, transformers 4.56 to 5.x)
        # does, with the additive mask forward builds (0 on tokens, the dtype's minimum on
        # padding). tests/test_ifcl.py holds it to the model's own forward.
        ext = (1 - mask[:, None, None, :].to(emb.dtype)) * torch.finfo(emb.dtype).min  # (B, 1, 1, L)
        cls = self.encoder.encoder(emb, attention_mask=ext)[0][:, 0]         # (B, d)
        return cls if self.mlp is None else self.mlp(cls)                    # (B, d)

    def three_views(self, batch: dict) -> tuple[torch.Tensor, ...]:
        """h, h^+, h^- of the batch's rows (3N, d); the dropout-augmented embedding-layer
        outputs emb, emb^+, emb^- (3N, L, d); the anchor's mask and the fused input's (N, L)."""
        a = self.args
        x, xf = batch["text"], batch["frat"]                                 # (N, L), (N, L')
        width = max(x["input_ids"].shape[1], xf["input_ids"].shape[1])
        x, xf = common.pad_batch(x, width, self.pad_id), common.pad_batch(xf, width, self.pad_id_frat)
        mask = x["attention_mask"]                                           # (N, L)
        # NOTE(ours): the fused input attends wherever either language has a token
        mask_frat = torch.maximum(mask, xf["attention_mask"])                # (N, L)
        # Eq. (2): y_i = BEL_S(x_i), y_i^- = BEL_F(x_i^-)
        # NOTE(ours): y is the embedding layer's output (word + position + type, LayerNorm);
        # --fuse word fuses the word embeddings only, before the rest.
        if a.fuse == "layer":
            y = self.encoder.embeddings(input_ids=x["input_ids"])           # (N, L, d)  y = BEL_S(x)
            with torch.no_grad():
                y_frat = self.bel_f(input_ids=xf["input_ids"])               # (N, L, d)  y^- = BEL_F(x^-)
            y3 = torch.cat([y, y, fuse(y, y_frat, a.eps)])                   # (3N, L, d)
        else:  # --fuse word: Eq. (3) on the word embeddings; position, type, LayerNorm follow
            w = self.encoder.embeddings.word_embeddings(x["input_ids"])      # (N, L, d)
            with torch.no_grad():
                w_frat = self.bel_f.word_embeddings(xf["input_ids"])         # (N, L, d)
            w3 = torch.cat([w, w, fuse(w, w_frat, a.eps)])                   # (3N, L, d)
            y3 = self.encoder.embeddings(inputs_embeds=w3)                   # (3N, L, d)
        # Algorithm 1, lines 3, 4, 6: emb, emb^+, emb^- each get their own dropout mask z
        emb = F.dropout(y3, self.rho, self.training)                         # (3N, L, d)
        # Eq. (1): h_i = f_theta(BEL_S(x_i), z_i), h_i^+ = f_theta(BEL_S(x_i), z_i^+); h_i^- by Eq. (3)
        z = self.f_theta(emb, torch.cat([mask, mask, mask_frat]))            # (3N, d)  lines 7-9
        return z, emb, mask, mask_frat

    def queue_weights(self, batch_size: int) -> torch.Tensor:
        """p_m of Eq. (4) for every slot, 0 for slots not filled yet (step 0: all empty)."""
        m = self.queue.shape[0]
        p = forgetting_coefficients(m, batch_size, self.args.lam).to(self.queue.device)  # (M,)
        return p * (torch.arange(m, device=p.device) < self.filled)           # (M,)

    @torch.no_grad()
    def push(self, h: torch.Tensor) -> None:
        """FIFO: the batch's anchors enter at slot 0, the oldest fall off the end.
        NOTE(ours): the queue holds the anchors h as the loss sees them ([CLS] -> MLP, or raw
        [CLS] with --no_mlp), detached."""
        m = self.queue.shape[0]
        if m == 0:
            return
        self.queue.copy_(torch.cat([h.detach().float(), self.queue])[:m])    # (M, d)
        self.filled.copy_((self.filled + h.shape[0]).clamp(max=m))           # ()

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        a = self.args
        x = batch["text"]                                                    # (N, L)
        n = x["input_ids"].shape[0]
        stats, h_frat = {}, None
        if a.no_fraternal:  # SimCSE's two views: emb, emb^+ (Algorithm 1, lines 3-4, 7-8)
            y = self.encoder.embeddings(input_ids=x["input_ids"])           # (N, L, d)  y = BEL_S(x)
            emb = F.dropout(torch.cat([y, y]), self.rho, self.training)     # (2N, L, d)
            z = self.f_theta(emb, torch.cat([x["attention_mask"]] * 2))     # (2N, d)
            h, h_pos = (common.gather(t) for t in z.split(n))               # (N, d) x2
        else:
            z, emb, mask, _ = self.three_views(batch)                        # (3N, d), (3N, L, d), (N, L)
            h, h_pos, h_frat = (common.gather(t) for t in z.split(n))        # (N, d) x3
            if a.margin == "computed":
                margin = common.gather(innate_margin(emb[:n], emb[n:2 * n], emb[2 * n:], mask))  # (N,)
            else:
                margin = torch.full((h.shape[0],), fixed_margin(a.omega_a, a.omega_b),
                                    device=h.device)                         # (N,)
            stats["margin"] = margin.mean()
        p = self.queue_weights(h.shape[0])                                   # (M,)  N = global batch
        l_identical = identical_loss(h, h_pos, self.queue, p, a.tau)         # ()  Eq. (6)
        stats["l_identical"] = l_identical
        # Eq. (9): L = sum_i (l_i^I + l_i^F + l_i^T)
        # An ablated term is left out (--no_fraternal drops l^F and l^T, --no_twins l^T).
        # NOTE(ours): the batch mean of each term, which only rescales the learning rate
        loss = l_identical                                                   # ()
        if h_frat is not None:
            stats["l_fraternal"] = fraternal_loss(h, h_frat, a.tau)          # ()  Eq. (7)
            loss = loss + stats["l_fraternal"]                               # ()
            if not a.no_twins:
                stats["l_twins"] = twins_loss(h, h_pos, h_frat, margin)      # ()  Eq. (8)
                loss = loss + stats["l_twins"]                               # ()
        stats.update(twins_stats(h, h_pos, h_frat))
        if self.queue.shape[0]:  # the share of the queue this step's Eq. (6) used
            stats["queue_fill"] = queue_fill(self.filled, self.queue.shape[0])
        self.push(h)  # after the loss, as in Algorithm 1 (line 23)
        return loss, {k: v.detach() for k, v in stats.items()}


# =====================================================================================
# The paper's rows (docs/ifcl.md maps each to its command); the end of a run prints the ones its
# flags select beside its own figures.
# =====================================================================================

# NOTE(ours): Tab. 2, Tab. 5 and Fig. 4b say "STS-B": the test set. Their full IFCL (80.27) is
# Tab. 1's STS-B test figure, Tab. 2's SimCSE (76.83) is about SimCSE's published STS-B test
# figure (76.85), and Fig. 4b plots "1.3k sentence pairs" (STS-B test has 1,379; dev 1,500).
# NOTE(ours): the paper gives BERT-large no settings of its own (Tab. 6 is "EnData", App. C lists
# base models only): Tab. 6's. Its fraternal side must be 1024 wide, as BERT-large: mBERT is 768
# and Sec. 4.1's German ALBERT embeds in 128; the paper does not say which it fused, or how.
LARGE = "the paper gives no BERT-large settings: Tab. 6's; its fraternal model is not known"
PAPER_ROWS = [
    # Tab. 1: the 7 STS tasks (test sets)
    common.PaperRow("Tab. 1", "IFCL-BERT_base",
                    {"STS12": 71.57, "STS13": 82.35, "STS14": 75.08, "STS15": 83.03, "STS16": 80.17,
                     "STSBenchmark": 80.27, "SICKRelatedness": 72.16, "avg": 77.80}),
    common.PaperRow("Tab. 1", "IFCL-BERT_large",
                    {"STS12": 73.88, "STS13": 84.31, "STS14": 76.64, "STS15": 84.01, "STS16": 79.56,
                     "STSBenchmark": 81.37, "SICKRelatedness": 76.30, "avg": 79.44},
                    model="bert-large-uncased", note=LARGE),
    # Tab. 2: the ablation, BERT-base, STS-B test
    common.PaperRow("Tab. 2", "IFCL_base", {"STSBenchmark": 80.27}),
    common.PaperRow("Tab. 2", "w/o FI, TL", {"STSBenchmark": 78.10},
                    flags={"no_fraternal": True, "no_twins": True}),
    common.PaperRow("Tab. 2", "w/o HQ", {"STSBenchmark": 78.81}, flags={"no_queue": True}),
    common.PaperRow("Tab. 2", "w/o TL, HQ", {"STSBenchmark": 77.26},
                    flags={"no_twins": True, "no_queue": True}),
    common.PaperRow("Tab. 2", "w/o FI, TL, HQ (SimCSE)", {"STSBenchmark": 76.83},
                    flags={"no_fraternal": True, "no_twins": True, "no_queue": True}),
    # Fig. 4b: the Twins loss knocked off (Sec. 4.4 gives its figure), STS-B test
    common.PaperRow("Fig. 4b", "IFCL w/o TL", {"STSBenchmark": 78.65}, flags={"no_twins": True}),
    # Tab. 5 (App. B): the queue length M = k*N, STS-B test
    *[common.PaperRow("Tab. 5", f"M={m}", {"STSBenchmark": x}, flags={"queue_len": m})
      for m, x in [(320, 78.76), (384, 79.15), (416, 80.27), (448, 79.79), (512, 78.13)]],
]


# =====================================================================================
# BEL_F's model, then the command: main() (the German file: plumbing/translation.py, one call)
# =====================================================================================

def check_fusable(args: Args, width: int, width_f: int) -> None:
    """Eq. (3) adds BEL_S(x) and BEL_F(x^-) position by position: both embedding layers must
    give vectors of one width (an ALBERT's is its embedding size, 128, not its hidden size)."""
    if width_f == width:
        return
    # NOTE(ours): the paper names no fraternal model as wide as BERT-large (mBERT is 768 wide,
    # Sec. 4.1's German ALBERT embeds in 128): we suggest XLM-R large, multilingual and 1024 wide
    examples = {768: "the default bert-base-multilingual-uncased",
                1024: "FacebookAI/xlm-roberta-large (ours: the paper names none that fits BERT-large)"}
    hint = f", e.g. --fraternal_model {examples[width]}" if width in examples else ""
    raise UserError(f"--fraternal_model {args.fraternal_model}: its embedding layer gives {width_f}-wide "
                    f"vectors, --model {args.model}'s gives {width}; Eq. (3) adds the two position by "
                    f"position, so they must match. Pass a multilingual model that embeds in {width}{hint}.")


def load_bel_f(args: Args, encoder: nn.Module) -> tuple:
    """BEL_F of Eq. (2): --fraternal_model's tokenizer and embedding layer, as wide as the
    encoder's (Eq. 3); the rest of that model is let go."""
    tok_f, enc_f = common.load_encoder(args.fraternal_model, flag="--fraternal_model")
    width, width_f = (m.get_input_embeddings().embedding_dim for m in (encoder, enc_f))
    check_fusable(args, width, width_f)
    return tok_f, enc_f.embeddings


def main(argv: list[str] | None = None) -> dict:
    args = common.parse_args(Args, argv, description=__doc__)
    if args.no_fraternal:
        print("note: --no_fraternal also drops the Twins loss (it compares h^+ with h^-)", file=sys.stderr)
    # x^-, the German sentences: their file checked now, before anything loads or is written
    german = None if args.no_fraternal else translation.fraternal_file(args)
    run = common.start(args, german.models if german else None)  # torchrun, all checked, run folder
    device = run.device                         # this process's: a GPU, or the CPU
    columns = common.load_columns(args.data)    # {"text": [...]}
    if german is not None:                      # rank 0 makes the file on the first run; the encoders wait
        columns["frat"] = german.sentences(len(columns["text"]), device)
    tokenizer, encoder = common.load_encoder(args.model, dropout=args.dropout)
    data = common.tokenize_columns(args, tokenizer, {"text": columns["text"]})
    bel_f, pad_f = None, 0
    if german is not None:
        tok_f, bel_f = load_bel_f(args, encoder)
        data |= common.tokenize_columns(args, tok_f, {"frat": columns["frat"]})
        pad_f = tok_f.pad_token_id or 0
    model = IFCL(encoder, bel_f, args, tokenizer.pad_token_id or 0, pad_f).to(device)
    # Table 1 caption: [CLS] in training, the mean of the last layer (--pooler avg) for evaluation
    return common.train(args, run, model, data, tokenizer, args.pooler, paper_rows=PAPER_ROWS)


if __name__ == "__main__":
    common.run_main(main)
