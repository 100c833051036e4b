"""IFCL: Identical and Fraternal Twins: Fine-Grained Semantic Contrastive Learning of Sentence
Representations.

Qingfa Xiao, Shuangyin Li, Lei Chen. ECAI 2023. arXiv:2307.10932. BibTeX key: xiao2023identical.

What it adds to SimCSE:
  - a third view per sentence, the fraternal twin h^-: the sentence's embedding-layer output
    fused with that of its German translation (Eq. 3), with its own InfoNCE (Eq. 7);
  - the Twins loss (Eq. 8), which keeps e^{sim(h,h+)} - e^{sim(h,h-)} at the margin the two
    augmentations had at the embedding layer, instead of pushing both similarities to 1;
  - a hippocampus queue of earlier anchors as extra negatives, older ones down-weighted (Eq. 4, 6).

Run:
  python ifcl.py --data wiki1m_for_simcse.txt     # bert-base + mBERT embeddings, Tab. 6's settings
The first run translates --data into German with --mt_model (t5-base, downloaded from the
Hugging Face hub on that run only), greedy and batched by length, with a progress bar
(sentences, sentences/s, time left), into wiki1m_for_simcse.de.t5-base.txt beside --data (or
under --cache_dir), then trains. How long that takes: README.md, "IFCL" (a GPU is the place for
it; t5-base's figure there is still to be measured, with the command to measure it). A killed
translation continues where it stopped; later runs find the file and train at once.
  python ifcl.py translate --data wiki1m_for_simcse.txt   # the same file, without training
  python ifcl.py --fraternal_data my.de.txt                # German lines made elsewhere
  python ifcl.py --model ../shared/models/all-MiniLM-L6-v2 --fraternal_model ../shared/models/all-MiniLM-L6-v2 \\
      --data ../shared/data/multi30k/train.en --fraternal_data ../shared/data/multi30k/train.de \\
      --sts_dir ../shared/data/sts --output_dir runs/ifcl-minilm   # the small real testbed (README)
  python ifcl.py ... --max_steps 20 --batch_size 16 --eval_every 10  # a quick CPU run
  python ifcl.py ... --no_queue                                      # Table 2, "w/o HQ"
  (Table 2: --no_fraternal = w/o FI, TL, needs no German; --no_twins --no_queue = w/o TL, HQ;
  all three = the identical twins' InfoNCE alone, in IFCL's setup: lr 1e-5, dropout 0.15,
  frozen embeddings, mean pooling for evaluation; not SimCSE's setup)

Measured numbers: README.md, "Results" (the multi30k + MiniLM testbed of ../shared/README.md;
the bert-base recipe prints the paper's Table 1 row beside yours at the end of a run).

Under DDP (torchrun): h, h^+, h^- and the innate margins are gathered from every rank before
the losses, so Eq. (6)-(8) see the global batch; every rank pushes the same gathered anchors
into its own copy of the queue, so the queues stay identical, and N in Eq. (4) is the global
batch size. The frozen fraternal embedding layer runs on each rank's own rows only.
On the first run rank 0 translates while the other ranks wait for the file (polling it, as a
collective's timeout is shorter than a translation), then every rank reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import UserError, arg


# =====================================================================================
# Hyperparameters (English setting, BERT-base)
# =====================================================================================

@dataclass
class Args(common.TrainArgs):
    """The shared flags are common.TrainArgs (SimCSE's defaults); IFCL changes and adds:"""
    sources = {"epochs": "paper Sec. 4.1", "seed": "ours"}
    data: str = arg("data/wiki1m_for_simcse.txt", "English sentences, one a line", "paper Sec. 4.1")
    fraternal_data: str = arg("", "German translations of --data, one a line, parallel to it; "
                              "left out: made from --data with --mt_model on the first run and "
                              "kept beside --data (or in --cache_dir) for the next ones", "paper Sec. 4.1")
    mt_model: str = arg("t5-base", "any Hugging Face seq2seq model that translates --data when "
                        "--fraternal_data is left out (T5: the paper; the size is ours)", "paper Sec. 4.1")
    model: str = arg("bert-base-uncased", "hub name or local folder of the encoder", "paper App. C")
    fraternal_model: str = arg("bert-base-multilingual-uncased", "model whose embedding layer and "
                               "tokenizer embed the German side (BEL_F)", "paper App. C")
    output_dir: str = arg("runs/ifcl", "run folder: args.json, metrics.jsonl, best/, last/")
    batch_size: int = arg(64, "sentences per step N (global, over all GPUs)", "paper Tab. 6", ge=1)
    max_len: int = arg(32, "tokens per training sentence, both languages", "paper Tab. 6", ge=1)
    lr: float = arg(1e-5, "peak learning rate, decayed linearly to 0", "paper Tab. 6", gt=0)
    eval_every: int = arg(151, "steps between STS-B dev evaluations", "paper Sec. 4.1", ge=1)
    cache_dir: str = arg("", "where tokenised data is cached, and the German file made from --data "
                         "(default: .cache/ and the German file beside --data)")
    tau: float = arg(0.05, "temperature of Eq. (6) and (7)", "paper Tab. 6", gt=0)
    dropout: float = arg(0.15, "dropout rate rho of the encoder (makes h and h^+ differ)", "paper Tab. 6",
                         ge=0, lt=1)
    eps: float = arg(0.9, "fusion rate epsilon of Eq. (3): weight of the English embedding", "paper Tab. 6",
                     ge=0, le=1)
    lam: float = arg(0.002, "forgetting rate lambda of Eq. (4)", "paper Tab. 6", ge=0)
    queue_len: int = arg(416, "hippocampus queue length k*N (need not be a multiple of N)", "paper Tab. 6",
                         ge=0)
    margin: str = arg("computed", "M_i of Eq. (8): computed from the embedding layer, or fixed "
                      "e^omega_a - e^omega_b", "ours", choices=["computed", "fixed"])
    omega_a: float = arg(0.85, "'similarity omega_a' (used by --margin fixed)", "paper Tab. 6")
    omega_b: float = arg(0.80, "'similarity omega_b' (used by --margin fixed)", "paper Tab. 6")
    fuse: str = arg("layer", "what Eq. (3) fuses: the embedding layer's output (word+position+"
                    "type, LayerNorm) or the word embeddings only", "ours", choices=["layer", "word"])
    train_embeddings: bool = arg(False, "train the encoder's embedding layer BEL_S (Eq. 1 calls it "
                                 "'without trainable parameters')", "paper Sec. 3.1.1")
    no_fraternal: bool = arg(False, "drop the fraternal twins (and so Eq. 7 and the Twins loss)",
                             "paper Tab. 2")
    no_twins: bool = arg(False, "drop the Twins loss, Eq. (8)", "paper Tab. 2")
    no_queue: bool = arg(False, "drop the hippocampus queue (phi = 0 in Eq. 6)", "paper Tab. 2")

    def rules(self) -> None:
        if self.data.lower().endswith(".csv"):
            raise UserError(f"--data {self.data}: IFCL is unsupervised; give a text file with one "
                            f"English sentence a line.")
        if not self.no_queue and 1 - self.lam * math.ceil(self.queue_len / self.batch_size) <= 0:
            raise UserError(f"--queue_len {self.queue_len} with --lam {self.lam} and --batch_size "
                            f"{self.batch_size}: every forgetting coefficient 1 - lam*ceil(m/N) must be "
                            f"positive; shorten the queue or lower --lam.")
        if self.no_fraternal:
            return
        made_here = made_from_data(self)
        if not Path(self.fraternal_data).is_file():
            if not made_here:
                check_fraternal_file(self)          # the user's file is missing
            check_mt_model(self.mt_model)           # it will be made on this first run
        elif Path(self.data).is_file():             # it must be parallel to --data
            read_fraternal(self, common.data_rows(self.data), made_here)


@dataclass
class TranslateArgs:
    data: str = arg("data/wiki1m_for_simcse.txt", "English sentences, one a line")
    out: str = arg("", "where the German lines go (written as <out>.part until complete); left "
                   "out: where `python ifcl.py` looks for them, <data>.de.<mt_model>.txt")
    cache_dir: str = arg("", "with --out left out: put the file here, not beside --data")
    mt_model: str = arg("t5-base", "any Hugging Face seq2seq model (T5: the paper; the size is ours; "
                        "Helsinki-NLP/opus-mt-en-de also works)", "paper Sec. 4.1")
    prefix: str = arg("auto", "text put before each sentence; auto = T5's 'translate English to "
                      "German: ' for T5 models, nothing otherwise", "ours")
    batch_size: int = arg(0, "sentences per generate() call, halved whenever the GPU runs out of "
                          "memory; 0 = 1024 on CUDA, 64 on the CPU", ge=0)
    chunk_size: int = arg(16384, "sentences sorted by length together and appended to the file "
                          "together (a kill loses at most one chunk's work)", ge=1)
    max_source_len: int = arg(256, "source tokens kept per sentence", ge=1)
    max_new_tokens: int = arg(128, "generated tokens per sentence at most", ge=1)
    num_beams: int = arg(1, "beam size (1 = greedy: a million sentences is a lot of beams)", ge=1)


# Paper Tab. 1, IFCL-BERT-base; printed beside this run's numbers at the end.
PAPER = {"STS12": 71.57, "STS13": 82.35, "STS14": 75.08, "STS15": 83.03, "STS16": 80.17,
         "STSBenchmark": 80.27, "SICKRelatedness": 72.16, "avg": 77.80}

T5_PREFIX = "translate English to German: "
AUTO_BATCH_CUDA, AUTO_BATCH_CPU = 1024, 64   # --batch_size 0 of `translate`


# =====================================================================================
# PAPER-SPECIFIC: the hippocampus queue's forgetting coefficients and the three losses
# =====================================================================================

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
                  mask: torch.Tensor, mask_frat: torch.Tensor) -> torch.Tensor:
    """M_i of Eq. (8) from the dropout-augmented embedding-layer outputs (N, L, d); emb and
    emb_pos use the anchor's mask, emb_frat the fused (union) mask. Returns (N,), detached.
    NOTE(ours): the paper gives no pooling for sim(emb_i, emb_i^+); we take the masked mean
    over tokens, then cosine. Detached: M_i is a target, not a path for gradient."""
    mean = common.masked_mean
    e, e_pos, e_frat = mean(emb, mask), mean(emb_pos, mask), mean(emb_frat, mask_frat)  # (N, d) x3
    s_pos = F.cosine_similarity(e, e_pos, dim=-1)                            # (N,)  sim(emb_i, emb_i^+)
    s_frat = F.cosine_similarity(e, e_frat, dim=-1)                          # (N,)  sim(emb_i, emb_i^-)
    # Eq. (8): M_i = e^{sim(emb_i, emb_i^+)} - e^{sim(emb_i, emb_i^-)}
    return (s_pos.exp() - s_frat.exp()).detach()                             # (N,)


def fixed_margin(omega_a: float, omega_b: float) -> float:
    """NOTE(ours): Tab. 6 lists omega_a, omega_b ('similarity') but the text never uses them;
    one reading is a constant margin M = e^omega_a - e^omega_b (--margin fixed)."""
    return math.exp(omega_a) - math.exp(omega_b)


# =====================================================================================
# PAPER-SPECIFIC: the model (three views in one pass, fusion, queue, MLP over [CLS])
# =====================================================================================

class IFCL(nn.Module):
    """h, h^+ and h^- in ONE forward pass over 3N rows: x, x again (a second dropout mask), and
    the fused x (Eq. 3). A hook on the encoder's embedding layer does the fusion and then the
    dropout, so that dropout comes after the fusion as in Algorithm 1 (line 6)."""

    def __init__(self, encoder: nn.Module, bel_f: nn.Module | None, args: Args, pad_id: int,
                 pad_id_frat: int):
        super().__init__()
        self.encoder, self.bel_f, self.args = encoder, bel_f, args
        self.pad_id, self.pad_id_frat = pad_id, pad_id_frat
        d = encoder.config.hidden_size
        # NOTE(ours): the paper does not say whether an MLP sits over [CLS] in training; like
        # SimCSE, [CLS] -> MLP in training only (evaluation uses the mean of the last layer).
        self.mlp = common.MLP(d)
        emb = encoder.embeddings
        # NOTE(ours): Eq. (1) calls BEL_S "without trainable parameters": frozen by default.
        for prm in emb.parameters():
            prm.requires_grad_(args.train_embeddings)
        # BERT's NSP pooler is never used: frozen, so that DDP sees no parameter without gradient
        if getattr(encoder, "pooler", None) is not None:
            for prm in encoder.pooler.parameters():
                prm.requires_grad_(False)
        # the embedding layer's own dropout (rate rho) moves into the hook, after the fusion
        self.rho = emb.dropout.p
        emb.dropout = nn.Identity()
        emb.register_forward_hook(self._fuse_then_dropout)
        self._y_frat: torch.Tensor | None = None
        if bel_f is not None:  # BEL_F: frozen, no dropout of its own
            bel_f.requires_grad_(False)
            bel_f.dropout = nn.Identity()
        # the hippocampus queue: slot 0 newest; `filled` slots hold anchors of earlier steps
        m = 0 if args.no_queue else args.queue_len
        self.register_buffer("queue", torch.zeros(m, d))                     # (M, d)
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))    # ()

    def _fuse_then_dropout(self, module: nn.Module, inputs, y: torch.Tensor) -> torch.Tensor:
        if self._y_frat is not None:  # --fuse layer: the last N rows become the fraternal input
            n = self._y_frat.shape[0]
            eps = self.args.eps
            # Eq. (3): eps * y_i + (1 - eps) * y_i^-, with y = BEL_S(x), y^- = BEL_F(x^-)
            y = torch.cat([y[:-n], eps * y[-n:] + (1 - eps) * self._y_frat.to(y.dtype)])  # (3N, L, d)
        return F.dropout(y, self.rho, module.training)                       # (B, L, d)

    def queue_weights(self, batch_size: int) -> torch.Tensor:
        """p_m of Eq. (4) for every slot, 0 for slots not filled yet (step 0: all empty)."""
        m = self.queue.shape[0]
        p = forgetting_coefficients(m, batch_size, self.args.lam).to(self.queue.device)  # (M,)
        return p * (torch.arange(m, device=p.device) < self.filled)           # (M,)

    @torch.no_grad()
    def push(self, h: torch.Tensor) -> None:
        """FIFO: the batch's anchors enter at slot 0, the oldest fall off the end.
        NOTE(ours): the queue holds the anchors h as the loss sees them ([CLS] -> MLP), detached."""
        m = self.queue.shape[0]
        if m == 0:
            return
        self.queue.copy_(torch.cat([h.detach().float(), self.queue])[:m])    # (M, d)
        self.filled.copy_((self.filled + h.shape[0]).clamp(max=m))           # ()

    def three_views(self, batch: dict) -> tuple[torch.Tensor, ...]:
        """[CLS]->MLP of x, x and the fused x in one pass (3N, d); the dropout-augmented
        embedding-layer outputs emb, emb^+, emb^- (3N, L, d) (Algorithm 1, lines 3-6); the
        anchor's mask and the fused input's mask (N, L)."""
        a = self.args
        x, xf = batch["text"], batch["frat"]                                 # (N, L), (N, L')
        width = max(x["input_ids"].shape[1], xf["input_ids"].shape[1])
        x, xf = common.pad_batch(x, width, self.pad_id), common.pad_batch(xf, width, self.pad_id_frat)
        mask = x["attention_mask"]                                           # (N, L)
        # NOTE(ours): the fused input attends wherever either language has a token
        mask_frat = torch.maximum(mask, xf["attention_mask"])                # (N, L)
        mask3 = torch.cat([mask, mask, mask_frat])                           # (3N, L)
        # NOTE(ours): Eq. (2) fuses y = BEL(x), the embedding layer's output (word + position +
        # type, LayerNorm); --fuse word fuses the word embeddings only, before the rest.
        if a.fuse == "layer":
            with torch.no_grad():
                self._y_frat = self.bel_f(input_ids=xf["input_ids"])         # (N, L, d)  BEL_F(x^-)
            try:
                ids3 = torch.cat([x["input_ids"]] * 3)                       # (3N, L)
                out = self.encoder(input_ids=ids3, attention_mask=mask3, output_hidden_states=True)
            finally:
                self._y_frat = None
        else:  # --fuse word: Eq. (3) on the word embeddings; position, type, LayerNorm follow
            w = self.encoder.embeddings.word_embeddings(x["input_ids"])      # (N, L, d)
            with torch.no_grad():
                w_f = self.bel_f.word_embeddings(xf["input_ids"])            # (N, L, d)
            # Eq. (3): eps * y_i + (1 - eps) * y_i^-
            fused = a.eps * w + (1 - a.eps) * w_f                            # (N, L, d)
            out = self.encoder(inputs_embeds=torch.cat([w, w, fused]), attention_mask=mask3,
                               output_hidden_states=True)
        z = self.mlp(out.last_hidden_state[:, 0])                            # (3N, d)
        return z, out.hidden_states[0], mask, mask_frat                      # hidden_states[0]: (3N, L, d)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        a = self.args
        x = batch["text"]                                                    # (N, L)
        n = x["input_ids"].shape[0]
        terms = {}
        if a.no_fraternal:  # SimCSE's two views in one pass
            out = self.encoder(**common.concat_batches([x, x]))
            z = self.mlp(out.last_hidden_state[:, 0])                        # (2N, d)
            h, h_pos = common.gather(z[:n]), common.gather(z[n:])            # (N, d), (N, d)
        else:
            z, emb, mask, mask_frat = self.three_views(batch)                # (3N, d), (3N, L, d)
            h, h_pos, h_frat = (common.gather(t) for t in z.split(n))        # (N, d) x3
            if a.margin == "computed":
                margin = common.gather(innate_margin(emb[:n], emb[n:2 * n], emb[2 * n:],
                                                     mask, mask_frat))       # (N,)
            else:
                margin = torch.full((h.shape[0],), fixed_margin(a.omega_a, a.omega_b),
                                    device=h.device)                         # (N,)
            terms["l_fraternal"] = fraternal_loss(h, h_frat, a.tau)
            terms["margin"] = margin.mean()
            if not a.no_twins:
                terms["l_twins"] = twins_loss(h, h_pos, h_frat, margin)
        p = self.queue_weights(h.shape[0])                                   # (M,)  N = global batch
        terms["l_identical"] = identical_loss(h, h_pos, self.queue, p, a.tau)
        self.push(h)  # after the loss, as in Algorithm 1 (line 23)
        # Eq. (9): sum over i of l^I + l^F + l^T; NOTE(ours): the batch mean (only rescales lr)
        loss = sum(v for k, v in terms.items() if k.startswith("l_"))
        return loss, {k: v.detach() for k, v in terms.items()}


# =====================================================================================
# Fraternal sentences: --data translated once (resumable), the parallel-file check
# =====================================================================================

def translate_command(data: str, out: str | None = None, mt_model: str = "t5-base") -> str:
    out = f" --out {out}" if out else ""
    return f"python ifcl.py translate --data {data}{out} --mt_model {mt_model}"


def mt_slug(mt_model: str) -> str:
    """The MT model as it appears in the German file's name: a hub name with '/' as '--'
    (the hub's own convention); a local folder as its name plus a hash of its absolute path.
    NOTE(ours): the name carries the model so that a file made by one model is never taken
    for another's; two local folders both called 'mt' get different names."""
    p = Path(mt_model).expanduser()
    if p.is_dir():
        full = str(p.resolve())
        name = f"{p.resolve().name}-{hashlib.sha256(full.encode()).hexdigest()[:8]}"
    else:
        name = mt_model.replace("/", "--")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def default_fraternal_path(data: str, mt_model: str, cache_dir: str = "") -> Path:
    """Where the German file made from --data by --mt_model lives: <data>.de.<model>.txt beside
    --data, or under --cache_dir when given or when --data's folder is not writable."""
    data_p = Path(data)
    name = f"{data_p.with_suffix('').name}.de.{mt_slug(mt_model)}.txt"
    if cache_dir:
        return Path(cache_dir) / name
    folder = data_p.resolve().parent
    probe = folder
    while not probe.exists():            # data/ before its first download: it will be created
        probe = probe.parent
    if os.access(probe, os.W_OK):
        return folder / name
    return common.default_cache_dir(data, "") / name


def made_from_data(args: Args) -> bool:
    """Whether --fraternal_data is the German file this script makes from --data (main() points
    it there when the flag is left out), not a file of the user's."""
    return args.fraternal_data == str(default_fraternal_path(args.data, args.mt_model, args.cache_dir))


def check_fraternal_file(args: Args) -> None:
    """Stop before anything is loaded when a --fraternal_data given by the user is missing."""
    if not Path(args.fraternal_data).is_file():
        raise UserError(f"--fraternal_data {args.fraternal_data}: no such file. Leave the flag out "
                        f"to translate --data with --mt_model {args.mt_model} on the first run, or "
                        f"make the file with "
                        f"`{translate_command(args.data, args.fraternal_data, args.mt_model)}`.")


def read_fraternal(args: Args, n: int, made_here: bool = False) -> list[str]:
    """The German lines, one per English sentence of --data (blank lines skipped in both).
    `made_here`: the file is the one this script made from --data (not a user's --fraternal_data)."""
    de = common.read_sentences(args.fraternal_data, "--fraternal_data")
    if len(de) == n:
        return de
    if made_here:
        raise UserError(f"{args.fraternal_data} (the German file made earlier from a --data of this "
                        f"name with --mt_model {args.mt_model}) has {len(de)} sentences but --data "
                        f"{args.data} has {n}: --data has changed since. Delete "
                        f"{args.fraternal_data} to translate --data again, or pass a parallel file "
                        f"with --fraternal_data.")
    raise UserError(f"--fraternal_data {args.fraternal_data} has {len(de)} sentences but --data "
                    f"{args.data} has {n}: the files must be parallel, line by line. Make it "
                    f"again with "
                    f"`{translate_command(args.data, args.fraternal_data + '.new', args.mt_model)}`, or "
                    f"leave --fraternal_data out to have it made on the first run.")


def mt_model_error(name: str, e: Exception) -> UserError:
    return UserError(f"--mt_model {name}: could not load it as a seq2seq model "
                     f"({str(e).splitlines()[0] if str(e) else type(e).__name__}). Translating --data "
                     f"into German needs it once (the file is kept and reused): give a hub name with "
                     f"the hub reachable, or a local folder. Or make the German file elsewhere with "
                     f"`python ifcl.py translate --data DATA --out FILE` and pass --fraternal_data FILE.")


def check_mt_model(name: str) -> None:
    """Before anything is written: the model's config loads and is a seq2seq one (the weights,
    possibly a download of a gigabyte, are loaded by the rank that translates)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise mt_model_error(name, e)
    if config.model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise mt_model_error(name, ValueError(f"its model type '{config.model_type}' is not a "
                                              f"sequence-to-sequence model"))


def load_mt_model(name: str, device: torch.device):
    """(tokenizer, model) for translation; bf16 weights on CUDA, fp32 on the CPU.
    NOTE(ours): bf16, not fp16: T5 overflows in fp16, and bf16 is what T5 was trained in."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForSeq2SeqLM.from_pretrained(name, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise mt_model_error(name, e)
    return tok, model


def translate_chunk(model, tok, texts: list[str], a: TranslateArgs, prefix: str,
                    device: torch.device, batch_size: int, on_batch) -> tuple[list[str], int]:
    """Translate `texts` in batches of similar length (greedy unless --num_beams) and return
    them in the input's order, with the batch size that fitted: on running out of GPU memory
    the batch is halved and tried again. `on_batch(k)` is called after each batch of k."""
    ids = tok([prefix + t for t in texts], truncation=True, max_length=a.max_source_len)["input_ids"]
    # longest first (stable: ties keep the input's order), so a batch that does not fit in
    # memory is met at the start of the chunk; similar lengths waste little on padding
    order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out: list[str] = [""] * len(texts)
    i = 0
    while i < len(order):
        rows = order[i:i + batch_size]
        width = max(len(ids[r]) for r in rows)
        x = torch.full((len(rows), width), pad, dtype=torch.long)           # (B, L)
        mask = torch.zeros((len(rows), width), dtype=torch.long)             # (B, L)
        for k, r in enumerate(rows):
            x[k, :len(ids[r])] = torch.tensor(ids[r])
            mask[k, :len(ids[r])] = 1
        gen = None
        try:
            with torch.inference_mode():
                gen = model.generate(input_ids=x.to(device), attention_mask=mask.to(device),
                                     num_beams=a.num_beams, do_sample=False,
                                     max_new_tokens=a.max_new_tokens)       # (B, T)
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
        if gen is None:                                 # outside the except: its frames freed
            batch_size //= 2
            torch.cuda.empty_cache()
            print(f"note: out of GPU memory; translating in batches of {batch_size}", file=sys.stderr)
            continue
        for r, t in zip(rows, tok.batch_decode(gen, skip_special_tokens=True)):
            out[r] = " ".join(t.split())                # one line each, whatever it generated
        i += len(rows)
        on_batch(len(rows))
    return out, batch_size


def translate_file(a: TranslateArgs, device: torch.device | None = None) -> Path:
    """Translate --data into --out (see `translate`); returns the finished file."""
    src = common.read_sentences(a.data, "--data")
    out = Path(a.out) if a.out else default_fraternal_path(a.data, a.mt_model, a.cache_dir)
    part, meta = out.with_name(out.name + ".part"), out.with_name(out.name + ".part.json")
    if out.exists():
        k = common.count_lines(out)
        if k == len(src):
            print(f"{out}: already complete ({k} lines)", file=sys.stderr)
            return out
        raise UserError(f"--out {out} exists with {k} lines but --data {a.data} has {len(src)} "
                        f"sentences. Delete it or choose another --out.")
    h = hashlib.sha256("\n".join(src).encode()).hexdigest()
    key = {"data_sha256": h, "lines": len(src), "mt_model": a.mt_model, "prefix": a.prefix,
           "num_beams": a.num_beams, "max_new_tokens": a.max_new_tokens,
           "max_source_len": a.max_source_len}
    done = 0
    if part.exists():
        old = json.loads(meta.read_text()) if meta.exists() else None
        if old != key:
            raise UserError(f"{part} is an unfinished translation of other input or settings "
                            f"({meta} says {old}). Delete both files to start afresh, or rerun "
                            f"with the earlier flags.")
        raw = part.read_bytes()
        keep = raw[: raw.rfind(b"\n") + 1]  # a line cut by the kill is translated again
        with open(part, "r+b") as f:
            f.truncate(len(keep))
        done = keep.count(b"\n")
        print(f"{part}: resuming after {done} of {len(src)} lines", file=sys.stderr)

    if done < len(src):
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        t_load = time.perf_counter()
        tok, model = load_mt_model(a.mt_model, device)  # before anything is written
        print(f"--mt_model {a.mt_model}: loaded in {time.perf_counter() - t_load:.0f} s on {device}",
              file=sys.stderr)
        if not part.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            common.write_text_atomic(meta, json.dumps(key, indent=2))
            part.write_bytes(b"")
        prefix = a.prefix
        # NOTE(ours): the paper says only "T5"; t5-base with T5's own task prefix by default
        if prefix == "auto":
            prefix = T5_PREFIX if model.config.model_type == "t5" else ""
        batch_size = a.batch_size or (AUTO_BATCH_CUDA if device.type == "cuda" else AUTO_BATCH_CPU)
        print(f"translating {len(src) - done} sentences of {a.data} into {out}", file=sys.stderr)
        bar = common.progress(total=len(src), desc="translating", unit="sent", initial=done)
        empty, t0 = 0, time.perf_counter()
        with open(part, "a", encoding="utf-8") as f:
            # Chunks start at multiples of --chunk_size of the input, each sorted by length
            # inside and appended whole, in the input's order. A chunk cut by a kill is
            # translated again whole (the same batches, so the same lines), and only its lines
            # past the finished ones are written: every finished line is kept.
            for c0 in range(done - done % a.chunk_size, len(src), a.chunk_size):
                chunk = src[c0:c0 + a.chunk_size]
                skip = max(0, done - c0)                # lines of this chunk already in <out>.part
                seen = [0]

                def on_batch(k: int) -> None:           # the bar counts new lines only
                    before, seen[0] = seen[0], seen[0] + k
                    bar.update(max(0, seen[0] - skip) - max(0, before - skip))
                lines, batch_size = translate_chunk(model, tok, chunk, a, prefix, device,
                                                    batch_size, on_batch)
                lines, chunk = lines[skip:], chunk[skip:]
                # NOTE(ours): an empty translation keeps the English line, so the files stay
                # parallel line for line (a blank German line would be skipped when read)
                empty += sum(not t for t in lines)
                f.write("".join((t or e) + "\n" for t, e in zip(lines, chunk)))
                f.flush()
                os.fsync(f.fileno())
        bar.close()
        secs = time.perf_counter() - t0
        new = len(src) - done
        print(f"translated {new} sentences in {secs:.1f} s ({new / max(secs, 1e-9):.1f} sentences/s)",
              file=sys.stderr)
        if empty:
            print(f"note: {empty} of {new} translations came back empty; their English line was "
                  f"kept in their place", file=sys.stderr)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()                    # the GPU's memory goes back to training
    n_out = common.count_lines(part)
    if n_out != len(src):
        raise UserError(f"{part}: {n_out} lines where {len(src)} were expected (did two runs "
                        f"translate into it at once?); delete it and {meta} and translate again.")
    os.replace(part, out)
    meta.unlink(missing_ok=True)
    print(f"{out}: {len(src)} lines", file=sys.stderr)
    return out


def translate(argv: list[str]) -> Path:
    """Translate --data into --out with a seq2seq model, the file `python ifcl.py` makes itself
    on its first run (--out left out: the same place and name). Batched by length (bf16 on
    CUDA, the batch halved when the GPU runs out of memory), with a progress bar, and
    resumable: lines go to <out>.part in chunks of the input's order (flushed after each)
    beside <out>.part.json, which says what is being translated; <out> appears only when every
    line is done, so a partial file is never taken for a finished one. A killed run continues
    where <out>.part stops."""
    args = common.parse_args(TranslateArgs, argv, description=translate.__doc__)
    common.check_ranges(args)
    return translate_file(args)


def failure_marker(out: Path) -> Path:
    """Rank 0 writes why it could not make `out` here, for the ranks waiting for it."""
    return out.with_name(out.name + ".failed")


def wait_for_file(out: Path, poll_s: float = 5.0) -> None:
    """Under torchrun, the ranks other than 0 wait for rank 0's translation: polling the file
    system, not a collective, whose timeout (minutes) is shorter than a translation (hours).
    The final name appears only once complete; a failure of rank 0 ends the wait with its
    message (and torchrun stops every rank when one dies)."""
    rank = common.world()[0]
    print(f"rank {rank}: waiting for rank 0 to translate --data into {out}", file=sys.stderr)
    failed = failure_marker(out)
    while not out.exists():
        if failed.exists():
            raise UserError(f"rank 0 could not make {out}: {failed.read_text()}")
        time.sleep(poll_s)


def make_fraternal_file(args: Args, device: torch.device) -> None:
    """Rank 0 translates --data into args.fraternal_data; the other ranks wait for the file."""
    out = Path(args.fraternal_data)
    rank, world_size = common.world()
    if rank > 0:
        return wait_for_file(out)
    try:
        translate_file(TranslateArgs(data=args.data, out=str(out), mt_model=args.mt_model), device)
    except BaseException as e:
        if world_size > 1:
            try:                                        # never hide e behind a failed note
                out.parent.mkdir(parents=True, exist_ok=True)
                common.write_text_atomic(failure_marker(out), str(e) or type(e).__name__)
            except OSError:
                pass
        raise


# =====================================================================================
# Plumbing: everything below calls common.py
# =====================================================================================

def main(argv: list[str] | None = None) -> dict | Path:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["translate"]:
        return translate(argv[1:])
    args = common.parse_args(Args, argv, description=__doc__)
    if args.no_fraternal and not args.no_twins:
        print("note: --no_fraternal also drops the Twins loss (it compares h^+ with h^-)",
              file=sys.stderr)
        args.no_twins = True
    if not args.no_fraternal and not args.fraternal_data:  # made from --data on the first run, then reused
        args.fraternal_data = str(default_fraternal_path(args.data, args.mt_model, args.cache_dir))
        if int(os.environ.get("RANK", "0")) == 0:  # an earlier launch's failure note goes
            failure_marker(Path(args.fraternal_data)).unlink(missing_ok=True)  # before the ranks meet
    made_here = not args.no_fraternal and made_from_data(args)   # as Args.rules() decides it
    to_translate = made_here and not Path(args.fraternal_data).is_file()
    device = common.start(args)                    # torchrun, flags checked, seed, output folder
    if to_translate:                               # the first run: rank 0 translates, the rest wait
        make_fraternal_file(args, device)
    columns = common.load_columns(args.data)       # {"text": [...]}
    n = len(columns["text"])
    if not args.no_fraternal:
        columns["frat"] = read_fraternal(args, n, made_here)  # stops before the encoders load
    tokenizer, encoder = common.load_encoder(args.model, dropout=args.dropout)
    cache = common.default_cache_dir(args.data, args.cache_dir)
    data = {"text": common.tokenize(tokenizer, columns["text"], args.max_len, cache, desc="tokenizing text")}
    bel_f, pad_f = None, 0
    if not args.no_fraternal:
        tok_f, enc_f = common.load_encoder(args.fraternal_model, flag="--fraternal_model")
        if enc_f.config.hidden_size != encoder.config.hidden_size:
            raise UserError(f"--fraternal_model {args.fraternal_model}: hidden size "
                            f"{enc_f.config.hidden_size}, but --model {args.model} has "
                            f"{encoder.config.hidden_size}; Eq. (3) adds the two embeddings, so "
                            f"they must match.")
        bel_f, pad_f = enc_f.embeddings, tok_f.pad_token_id or 0
        del enc_f                                  # only the embedding layer is kept
        data["frat"] = common.tokenize(tok_f, columns["frat"], args.max_len, cache,
                                       desc="tokenizing fraternal")
    model = IFCL(encoder, bel_f, args, tokenizer.pad_token_id or 0, pad_f).to(device)
    # Table 1 caption: [CLS] in training, the mean of the last layer for evaluation and saving
    return common.train(args, model, data, tokenizer, "avg", paper=("IFCL paper", PAPER))


if __name__ == "__main__":
    common.run_main(main)
