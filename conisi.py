r"""ConIsI: A Contrastive Framework with Inter-sentence Interaction for Self-supervised
Sentence Representation.

Meng Sun, Degen Huang. CCL 2022 (Proceedings of the 21st Chinese National Conference on
Computational Linguistics, pp. 748-760; ACL Anthology 2022.ccl-1.67). No arXiv version.
BibTeX key: sun2022conisi.

What it adds to unsupervised SimCSE:
  - the positive of x_i is the pair Y_i = (x_i, x_i), encoded as ONE sequence of double length,
    instead of a second dropout view; head g = ELU(BN(W1 h + b1)) on [CLS] (Eq. 2-4);
  - an interactive objective: a linear score r tells Y_i = (x_i, x_i) from a composed pair
    Z_i = (x_i, c_i), with c_i another batch sentence (s), subword noise (o1) or antonyms (o2);
  - loss (1 - lam) * contrastive + lam * interactive (Eq. 10); evaluation uses raw [CLS].

Run (data/ is filled on first use, or by `python tools/download.py`):
  python conisi.py                        # ConIsI-s, bert-base-uncased on wiki1m: runs/conisi/default
  python conisi.py --model sentence-transformers/all-MiniLM-L6-v2 --max_steps 4 --eval_every 2 \
      --batch_size 8 --max_len 16         # a quick CPU run (no paper row: batch and max_len differ)
  python conisi.py --lam 0                # an ablation: Tab. 5 "w/o fine-grained classification loss"

docs/conisi.md: the paper's rows, each with its command; where the code departs from the paper
(our reading of BatchNorm's batches, --bn); what metrics.jsonl shows; DDP; the measured numbers
(a MiniLM testbed).
"""

from __future__ import annotations

import plumbing.interrupts  # first: Ctrl-C in the imports: one line. Not found? Run it inside its clone

import random
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import UserError, arg

# =====================================================================================
# Hyperparameters (ConIsI-s, BERT-base)
# =====================================================================================

@dataclass
class Args(common.TrainArgs):
    """Shared flags: common.TrainArgs (SimCSE's defaults, kept by Tab. 3 and Sec. 4.3); ConIsI's:"""
    OWN_ROW_FREE = ("antonyms",)   # the antonym table's file: a run with another still shows its row
    SOURCES = {"model": "paper Tab. 3", "lr": "paper Tab. 3", "data": "paper Sec. 4.1",
               "epochs": "paper Sec. 4.3", "seed": "paper Sec. 4.3", "eval_every": "paper Sec. 4.3",
               "weight_decay": "paper Sec. 4.3"}
    batch_size: int = arg(64, "sentences per step (global, over all GPUs); at least 2 per process "
                          "(BatchNorm)", "paper Tab. 3", ge=2)
    max_len: int = arg(32, "tokens per single sentence; the pairs Y, Z get twice as many",
                       "paper Tab. 3", ge=1)
    tau: float = arg(0.05, "temperature of the contrastive loss, Eq. (3)", "paper Sec. 4.3", gt=0,
                     note="The paper uses 0.05 (Sec. 4.3).")
    lam: float = arg(0.8, "weight of the interactive loss, Eq. (10): 0.8 for BERT-base, 0.1 for "
                     "RoBERTa-base and BERT-large; 0 = no Z at all, 1 = no contrastive loss (Tab. 5)",
                     "paper Tab. 3", ge=0, le=1, note="Eq. (10) is a convex combination; the paper tries "
                     "0 to 0.9 (Tab. 7), uses 0.8 (BERT-base), 0.1 (RoBERTa-base, BERT-large) (Tab. 3).")
    strategy: str = arg("s", "how c_i of Z_i = (x_i, c_i) is built: s = another sentence of the "
                        "batch, o1 = subword replacement, o2 = WordNet antonyms", "paper Sec. 3.2",
                        choices=["s", "o1", "o2"])
    # NOTE(ours): the paper never says which rows form a BatchNorm batch; joint is our reading
    # (normalised apart, Y and Z leave BN with the same mean per feature: Eq. (8) loses its
    # easiest cue); separate is the other. At --lam 0 there is no Z: Y is alone.
    bn: str = arg("joint", "BatchNorm batches of the head g, our reading (the paper does not say): "
                  "joint = x alone (N), Y and Z together (2N, encoder 2's one pass); separate = x, Y, "
                  "Z each alone (N); at --lam 0 Y alone either way", "ours", choices=["joint", "separate"])
    dropout: float = arg(0.1, "encoder dropout (hidden and attention)", "paper Sec. 4.3", ge=0, lt=1,
                         note="The paper uses 0.1 (Sec. 4.3).")
    replace_share: float = arg(0.15, "o1: share of subword tokens chosen; o2: share of words "
                               "(at least one either way)", "ours", ge=0, le=1,
                               note="A share; the paper gives none (ours: 0.15, BERT's masking rate).")
    random_share: float = arg(0.8, "o1: a chosen token becomes a random token this often, else "
                              "stays unchanged", "paper Sec. 3.2.1", ge=0, le=1,
                              note="A probability; the paper uses 0.8 (Sec. 3.2.1).")
    antonyms: str = arg("", "o2: a word<TAB>antonym file to use instead of nltk's WordNet")

    def rules(self) -> None:
        if self.data.lower().endswith(".csv"):
            raise UserError(f"--data {self.data}: ConIsI is self-supervised and reads one sentence a "
                            f"line; give a text file (e.g. wiki1m_for_simcse.txt), not a CSV.")

    def settle(self, data_rows: int) -> None:
        # the processes, once torchrun's group has started (rules() run before: parse_args)
        world_size = common.world()[1]
        if self.batch_size // world_size < 2:
            raise UserError(f"--batch_size {self.batch_size}: ConIsI needs at least 2 sentences per "
                            f"process (the head's BatchNorm, and strategy s draws c_i from the other "
                            f"sentences). Use --batch_size {2 * world_size} or more.")
        # the encoder's positions, once common.start has checked the files and found --model
        positions = common.encoder_positions(self.model)
        if 2 * self.max_len > positions:
            raise UserError(f"--max_len {self.max_len}: the pairs Y and Z need up to {2 * self.max_len} "
                            f"positions, more than {self.model} has ({positions}). Pass --max_len "
                            f"{positions // 2} or less.")


# =====================================================================================
# PAPER-SPECIFIC: the losses
# =====================================================================================

@common.fp32
def contrastive_loss(h_x: torch.Tensor, h_Y: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (3)-(4): row i is the single sentence h_i^x, column j the sentence pair h_j^Y."""
    # sim(h_i^x, h_j^Y) = cos(h_i^x, h_j^Y) for every pair of the batch
    sim = F.normalize(h_x, dim=-1) @ F.normalize(h_Y, dim=-1).T               # (N, N)
    labels = torch.arange(h_x.shape[0], device=h_x.device)                    # (N,)
    # Eq. (3)-(4): l_i = -log e^{sim(h_i^x, h_i^Y)/tau} / sum_j e^{sim(h_i^x, h_j^Y)/tau}; mean over i
    return F.cross_entropy(sim / tau, labels)                                 # ()


@common.fp32
def interactive_loss(r_Y: torch.Tensor, r_Z: torch.Tensor) -> torch.Tensor:
    """Eq. (8)-(9): the same-sentence pair Y_i should outscore the composed pair Z_i."""
    logits = torch.stack([r_Y, r_Z], dim=1)                                   # (N, 2)
    labels = torch.zeros(r_Y.shape[0], dtype=torch.long, device=r_Y.device)   # (N,)
    # Eq. (8)-(9): l_i = -log e^{r_i^Y} / (e^{r_i^Y} + e^{r_i^Z}); mean over i
    return F.cross_entropy(logits, labels)                                    # ()


@common.fp32
def conisi_loss(h_x: torch.Tensor, h_Y: torch.Tensor, r_Y: torch.Tensor, r_Z: torch.Tensor,
                tau: float, lam: float) -> torch.Tensor:
    """Eq. (10): the contrastive and interactive losses, balanced by lam."""
    # Eq. (10): L = (1 - lam) * L_Contrastive + lam * L_Interactive
    return (1 - lam) * contrastive_loss(h_x, h_Y, tau) + lam * interactive_loss(r_Y, r_Z)  # ()


@common.fp32
def interactive_accuracy(r_Y: torch.Tensor, r_Z: torch.Tensor) -> torch.Tensor:
    """For the log: how often the classifier ranks Y_i above Z_i."""
    return (r_Y > r_Z).float().mean()                                         # ()


# =====================================================================================
# PAPER-SPECIFIC: sentence pairs as one sequence (Sec. 3.1.1-3.1.3)
# =====================================================================================

@dataclass(frozen=True)
class PairTemplate:
    """Where the tokenizer puts its special tokens: single = [*single_pre] x [*single_suf],
    pair = [*pre] a [*mid] b [*suf], with the token type of every position."""
    single_pre: int
    single_suf: int
    pre: tuple[int, ...]
    mid: tuple[int, ...]
    suf: tuple[int, ...]
    pre_types: tuple[int, ...]
    mid_types: tuple[int, ...]
    suf_types: tuple[int, ...]
    a_type: int
    b_type: int
    pad_id: int
    use_types: bool


def pair_template(tokenizer, flag: str = "--model") -> PairTemplate:
    """Read the tokenizer's own sentence-pair form off a probe ([CLS] a [SEP] b [SEP], types
    0/1 for BERT; <s> a </s></s> b </s> for RoBERTa)."""
    # NOTE(ours): pairs follow the tokenizer's own pair template, read off a probe (Sec. 3.1.3:
    # BERT's sentence-pair input; for RoBERTa, the sentences separated by "</s>")
    n_a, n_b = (len(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in ("a", "b"))
    one = tokenizer("a", return_special_tokens_mask=True)
    two = tokenizer("a", "b", return_special_tokens_mask=True, return_token_type_ids=True)
    ids, special = two["input_ids"], two["special_tokens_mask"]
    types = two.get("token_type_ids") or [0] * len(ids)

    def run(seq: list[int], start: int, value: int) -> int:  # where the run of `value` ends
        return next((k for k in range(start, len(seq)) if seq[k] != value), len(seq))

    s1 = run(one["special_tokens_mask"], 0, 1)
    p1 = run(special, 0, 1)
    a_end = run(special, p1, 0)
    p2 = run(special, a_end, 1)
    b_end = run(special, p2, 0)
    if (s1 + n_a > len(one["input_ids"]) or a_end - p1 != n_a or b_end - p2 != n_b
            or any(m != 1 for m in special[b_end:])):
        raise UserError(f"{flag}: its tokenizer has no pair form ([CLS] a [SEP] b [SEP] or <s> a </s></s> "
                        f"b </s>), which ConIsI needs for Y and Z. Use a BERT- or RoBERTa-style encoder.")
    return PairTemplate(
        single_pre=s1, single_suf=len(one["input_ids"]) - s1 - n_a,
        pre=tuple(ids[:p1]), mid=tuple(ids[a_end:p2]), suf=tuple(ids[b_end:]),
        pre_types=tuple(types[:p1]), mid_types=tuple(types[a_end:p2]), suf_types=tuple(types[b_end:]),
        a_type=types[p1], b_type=types[p2],
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        use_types="token_type_ids" in tokenizer.model_input_names)


def compose_pairs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                  tpl: PairTemplate) -> dict[str, torch.Tensor]:
    """Join two single-sentence batches row by row into one pair sequence per row:
    [CLS] a_i [SEP] b_i [SEP]. Y_i = compose(x, x) repeats the truncated x_i (Sec. 3.1.1), so a
    pair has at most twice max_len tokens (the paper's doubled max length, Sec. 3.1.3).
    Example (BERT: [CLS] 101, [SEP] 102, [PAD] 0), Y = compose_pairs(x, x, tpl), x_i = "hello world":
      x_i input_ids [101, 7592, 2088, 102, 0]  attention_mask [1, 1, 1, 1, 0]
      Y_i input_ids [101, 7592, 2088, 102, 7592, 2088, 102, 0, 0]  [CLS] hello world [SEP] hello world [SEP]
          token_type_ids [0, 0, 0, 0, 1, 1, 1, 0, 0]  attention_mask [1, 1, 1, 1, 1, 1, 1, 0, 0]"""
    a_ids, b_ids = a["input_ids"], b["input_ids"]                             # (N, La), (N, Lb)
    n, la_w, lb_w = a_ids.shape[0], a_ids.shape[1], b_ids.shape[1]
    dev, cut = a_ids.device, tpl.single_pre + tpl.single_suf
    la = a["attention_mask"].sum(1, keepdim=True) - cut                       # (N, 1) words of a_i
    lb = b["attention_mask"].sum(1, keepdim=True) - cut                       # (N, 1) words of b_i
    width = len(tpl.pre) + len(tpl.mid) + len(tpl.suf) + (la_w - cut) + (lb_w - cut)
    pos = torch.arange(width, device=dev)[None, :]                            # (1, W)
    e1 = len(tpl.pre)                                                         # end of [CLS]
    e2 = e1 + la                                                              # (N, 1) end of a_i
    e3 = e2 + len(tpl.mid)                                                    # (N, 1) end of [SEP]
    e4 = e3 + lb                                                              # (N, 1) end of b_i
    e5 = e4 + len(tpl.suf)                                                    # (N, 1) end of pair

    def fixed(vals: tuple[int, ...], start) -> torch.Tensor:                  # (N or 1, W)
        t = torch.tensor(vals or (0,), device=dev)                           # (P,)
        return t[(pos - start).clamp(0, max(len(vals) - 1, 0))]

    a_tok = a_ids.gather(1, (pos - e1 + tpl.single_pre).clamp(0, la_w - 1).expand(n, -1))  # (N, W)
    b_tok = b_ids.gather(1, (pos - e3 + tpl.single_pre).clamp(0, lb_w - 1))   # (N, W)
    ids = torch.full((n, width), tpl.pad_id, dtype=a_ids.dtype, device=dev)   # (N, W)
    types = torch.zeros((n, width), dtype=a_ids.dtype, device=dev)            # (N, W)
    for end, tok, typ in ((e5, fixed(tpl.suf, e4), fixed(tpl.suf_types, e4)),
                          (e4, b_tok, tpl.b_type),
                          (e3, fixed(tpl.mid, e2), fixed(tpl.mid_types, e2)),
                          (e2, a_tok, tpl.a_type),
                          (e1, fixed(tpl.pre, 0), fixed(tpl.pre_types, 0))):
        inside = pos < end                                                    # (N or 1, W)
        ids = torch.where(inside, tok, ids)                                   # (N, W)
        types = torch.where(inside, torch.as_tensor(typ, device=dev), types)  # (N, W)
    mask = (pos < e5).long()                                                  # (N, W)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


# =====================================================================================
# PAPER-SPECIFIC: the three ways to build c_i (Sec. 3.2)
# =====================================================================================

def other_index(n: int, device: torch.device | str = "cpu",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Strategy s (Sec. 3.2.2): for each i a uniformly drawn k != i of the same batch."""
    if n < 2:
        raise UserError(f"--strategy s draws c_i from the other sentences of a batch, but this "
                        f"batch has {n}. Raise --batch_size to at least 2 per process.")
    shift = torch.randint(1, n, (n,), device=device, generator=generator)    # (N,) in 1..N-1
    return (torch.arange(n, device=device) + shift) % n                       # (N,) never i


def subword_replace(ids: torch.Tensor, mask: torch.Tensor, special_ids: torch.Tensor,
                    candidates: torch.Tensor, share: float, random_share: float,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Strategy o1 (Sec. 3.2.1): choose a share of each row's subword tokens; a chosen token
    becomes a random token (from `candidates`) `random_share` of the time, else stays.
    Special tokens and padding are never chosen. Returns (new ids, chosen positions)."""
    dev = ids.device
    content = mask.bool() & ~torch.isin(ids, special_ids)                     # (N, L)
    n_c = content.sum(1, keepdim=True)                                        # (N, 1)
    # NOTE(ours): the proportion is not given: 15% as BERT's masking, and at least one token
    k = torch.where(n_c > 0, (n_c * share).round().clamp(min=1), 0)           # (N, 1)
    score = torch.rand(ids.shape, device=dev, generator=generator)            # (N, L)
    rank = score.masked_fill(~content, 2.0).argsort(1).argsort(1)             # (N, L) 0 = first pick
    chosen = (rank < k) & content                                             # (N, L)
    swap = chosen & (torch.rand(ids.shape, device=dev, generator=generator) < random_share)  # (N, L)
    pick = torch.randint(len(candidates), ids.shape, device=dev, generator=generator)  # (N, L)
    return torch.where(swap, candidates[pick], ids), chosen                   # (N, L), (N, L)


def change_one(new: torch.Tensor, ids: torch.Tensor, chosen: torch.Tensor, candidates: torch.Tensor,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The o1 guard: in a row where subword_replace changed none of its chosen tokens, one of
    them (drawn uniformly) becomes a random candidate other than itself. Every other row, and a
    row with no chosen token (no content token at all), is returned as it is."""
    # NOTE(ours): the 20% "unchanged" draw (or a random token equal to the original) can leave
    # c_i = x_i, most often in a short sentence: Z_i would then be Y_i under the opposite label
    dev = ids.device
    same = ((new == ids) | ~chosen).all(1, keepdim=True)                      # (N, 1) nothing changed
    score = torch.rand(ids.shape, device=dev, generator=generator).masked_fill(~chosen, -1.0)  # (N, L)
    one = F.one_hot(score.argmax(1), ids.shape[1]).bool() & chosen & same      # (N, L) <= 1 a row
    j = torch.randint(len(candidates) - 1, ids.shape, device=dev, generator=generator)  # (N, L)
    # a draw from the candidates other than the token itself: a draw of the token becomes the last one
    other = torch.where(candidates[j] == ids, candidates[-1], candidates[j])  # (N, L)
    return torch.where(one, other, new)                                       # (N, L)


def antonym_replace(sentence: str, antonyms: Callable[[str], list[str]] | Mapping[str, list[str]],
                    share: float, rng: random.Random) -> str | None:
    """Strategy o2 (Sec. 3.2.1): swap round(share x words) words (at least one) for an
    antonym, chosen among the words that have one; None when no word has any."""
    look = antonyms.get if isinstance(antonyms, Mapping) else antonyms
    words = list(re.finditer(r"[A-Za-z]+", sentence))
    options = [(m, sorted(look(m.group().lower()) or ())) for m in words]
    options = [(m, ants) for m, ants in options if ants]
    if not options:
        return None
    # NOTE(ours): the share of words is not given; we reuse --replace_share, at least one word
    n_swap = min(len(options), max(1, round(share * len(words))))
    picked = sorted(rng.sample(range(len(options)), n_swap))
    out, last = [], 0
    for j in picked:
        m, ants = options[j]
        new = rng.choice(ants)
        new = new[0].upper() + new[1:] if m.group()[0].isupper() else new    # keep a capital
        out += [sentence[last:m.start()], new]
        last = m.end()
    return "".join(out) + sentence[last:]


# =====================================================================================
# PAPER-SPECIFIC: the model (encoder + head g + interaction classifier f)
# =====================================================================================

class ConIsI(nn.Module):
    def __init__(self, encoder: nn.Module, tpl: PairTemplate, tau: float, lam: float,
                 strategy: str, special_ids: list[int], vocab_size: int,
                 replace_share: float = 0.15, random_share: float = 0.8, bn: str = "joint"):
        super().__init__()
        if bn not in ("joint", "separate"):
            raise UserError(f"--bn {bn}: choose joint or separate.")
        self.encoder, self.tpl, self.tau, self.lam, self.strategy = encoder, tpl, tau, lam, strategy
        self.replace_share, self.random_share, self.bn = replace_share, random_share, bn
        d = encoder.config.hidden_size
        # Eq. (2): g(h) = ELU(BN_1(W_1 h + b_1)); Eq. (6) reuses W_1, b_1 and BN_1 (shared)
        self.g = nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ELU())
        # Eq. (7): r = W_3 h + b_3. NOTE(ours): W_3 maps d -> 1, since Eq. (8) uses r as a logit
        self.w3 = nn.Linear(d, 1)
        self.w3.requires_grad_(lam != 0)  # in no loss at lam 0: frozen, so DDP waits for no gradient
        special = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[special[special < vocab_size]] = False
        self.register_buffer("special_ids", special, persistent=False)                # (S,)
        self.register_buffer("candidates", keep.nonzero().squeeze(1), persistent=False)  # (V - S,)

    def cls(self, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        use_types = self.tpl.use_types and "token_type_ids" in ids
        kw = {"token_type_ids": ids["token_type_ids"]} if use_types else {}
        out = self.encoder(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], **kw)
        return out.last_hidden_state[:, 0]                                    # (B, d)

    def head(self, h_cls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g and f on one batch of [CLS] rows; BatchNorm's statistics are over exactly these rows."""
        if self.training and h_cls.shape[0] < 2:
            raise UserError("the ConIsI head's BatchNorm needs at least 2 sentences per batch and "
                            "process in training. Raise --batch_size.")
        # Eq. (2) / (6): h = ELU(BN(W_1 h_[CLS] + b_1))
        h = self.g(h_cls)                                                     # (N, d)
        # Eq. (7): r = W_3 h + b_3, one logit per pair
        r = self.w3(h).squeeze(-1)                                            # (N,)
        return h, r

    def head_pairs(self, h_YZ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """g and f on the pairs' [CLS] rows, Y_1..Y_N then Z_1..Z_N: (h_Y, r_Y, r_Z)."""
        n = h_YZ.shape[0] // 2
        if self.bn == "separate":  # --bn separate: Y and Z each their own batch of N
            h_Y, r_Y = self.head(h_YZ[:n])                                    # (N, d), (N,)
            _, r_Z = self.head(h_YZ[n:])                                      # (N,)
            return h_Y, r_Y, r_Z
        # NOTE(ours): BN over Y and Z together, one batch of 2N (encoder 2's one pass; why: Args.bn)
        g_YZ, r_YZ = self.head(h_YZ)                                          # (2N, d), (2N,)
        return g_YZ[:n], r_YZ[:n], r_YZ[n:]                                   # (N, d), (N,), (N,)

    def make_c(self, batch: dict) -> dict[str, torch.Tensor]:
        """c_i for Z_i = (x_i, c_i), per --strategy, as a single-sentence batch."""
        x = batch["text"]
        ids, mask = x["input_ids"], x["attention_mask"]                       # (N, L), (N, L)
        if self.strategy == "s":
            k = other_index(ids.shape[0], ids.device)                         # (N,)
            return {"input_ids": ids[k], "attention_mask": mask[k]}
        noisy, chosen = subword_replace(ids, mask, self.special_ids, self.candidates,
                                        self.replace_share, self.random_share)  # (N, L), (N, L)
        noisy = change_one(noisy, ids, chosen, self.candidates)               # (N, L)
        # NOTE(ours): a row with no content token (special tokens only, e.g. [UNK]s) has nothing
        # to replace: its c_i is another sentence of the batch, drawn as strategy s draws it
        bare = ~chosen.any(1, keepdim=True)                                   # (N, 1)
        k = other_index(ids.shape[0], ids.device)                             # (N,)
        o1 = {"input_ids": torch.where(bare, ids[k], noisy),                  # (N, L)
              "attention_mask": torch.where(bare, mask[k], mask)}             # (N, L)
        if self.strategy == "o1":
            return o1
        # o2: the antonym column. NOTE(ours): a row with no antonym (c_i = x_i, so Z_i = Y_i
        # under the opposite label) falls back to o1, the other "from original sentence" way
        c = batch["anto"]
        width = max(ids.shape[1], c["input_ids"].shape[1])
        x_p, c_p, o1_p = (common.pad_batch(b, width, self.tpl.pad_id) for b in (x, c, o1))  # (N, W) each
        same = ((x_p["input_ids"] == c_p["input_ids"]).all(1)
                & (x_p["attention_mask"] == c_p["attention_mask"]).all(1))[:, None]  # (N, 1)
        return {k: torch.where(same, o1_p[k], c_p[k]) for k in c_p}           # (N, W)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = batch["text"]                                                     # (N, L)
        Y = compose_pairs(x, x, self.tpl)                                     # (N, <=2L) (x_i, x_i)
        h_x, _ = self.head(self.cls(x))                                       # (N, d) BN over x alone
        if self.lam == 0:  # Tab. 5 "w/o fine-grained classification loss": no Z is built, and
            # Y is a BatchNorm batch of its own, so no c_i reaches the loss, not even through BN
            h_Y, _ = self.head(self.cls(Y))                                   # (N, d) BN over Y alone
            loss = contrastive_loss(common.gather(h_x), common.gather(h_Y), self.tau)  # () Eq. (10), lam 0
            return loss, {"loss_contrastive": loss.detach()}
        Z = compose_pairs(x, self.make_c(batch), self.tpl)                    # (N, <=2L) (x_i, c_i)
        h_YZ = self.cls(common.concat_batches([Y, Z], self.tpl.pad_id))       # (2N, d) one pass
        h_Y, r_Y, r_Z = self.head_pairs(h_YZ)                                 # (N, d), (N,), (N,)
        h_x, h_Y, r_Y, r_Z = (common.gather(t) for t in (h_x, h_Y, r_Y, r_Z))
        loss = conisi_loss(h_x, h_Y, r_Y, r_Z, self.tau, self.lam)
        with torch.no_grad():
            stats = {"loss_contrastive": contrastive_loss(h_x, h_Y, self.tau),
                     "loss_interactive": interactive_loss(r_Y, r_Z),
                     "acc_interactive": interactive_accuracy(r_Y, r_Z)}
            # the interactive term's share of Eq. (10)'s value, not of its gradient (the contrastive
            # term's logits carry 1/tau, r none): near 0, lam only rescales Eq. (4)
            stats["share_interactive"] = self.lam * stats["loss_interactive"] / loss.detach()   # ()
        return loss, stats


# =====================================================================================
# The paper's rows (docs/conisi.md maps each to its command): the end of a run prints the ones
# its flags select beside its own figures
# =====================================================================================

# Tab. 3 sets batch 64 and lr 3e-5 for every model (the defaults), max_len 32 (28 for
# BERT-large) and lam for ConIsI-s only: 0.8 for BERT-base, 0.1 for RoBERTa-base and BERT-large
LAM_READING = "Tab. 3 gives lam for ConIsI-s only: lam {lam} for {strategy} is our reading"
TAB7_AVG_BY_LAM = {0.0: 77.00, 0.1: 77.97, 0.2: 77.42, 0.3: 77.78, 0.4: 77.81, 0.5: 78.03,
                   0.6: 77.76, 0.7: 77.93, 0.8: 78.30, 0.9: 77.58}   # Tab. 7, ConIsI-s-BERT_base

PAPER_ROWS = [
    common.PaperRow("Tab. 4", "ConIsI-s-BERT_base",
                    {"STS12": 70.92, "STS13": 84.35, "STS14": 76.67, "STS15": 83.53, "STS16": 78.94,
                     "STSBenchmark": 82.15, "SICKRelatedness": 71.55, "avg": 78.30}),
    common.PaperRow("Tab. 4", "ConIsI-s-RoBERTa_base",
                    {"STS12": 71.21, "STS13": 83.31, "STS14": 75.11, "STS15": 81.13, "STS16": 80.73,
                     "STSBenchmark": 80.50, "SICKRelatedness": 69.39, "avg": 77.34},
                    flags={"lam": 0.1}, model="roberta-base"),
    common.PaperRow("Tab. 4", "ConIsI-s-BERT_large",
                    {"STS12": 72.33, "STS13": 86.14, "STS14": 77.42, "STS15": 84.83, "STS16": 79.60,
                     "STSBenchmark": 81.76, "SICKRelatedness": 74.78, "avg": 79.55},
                    flags={"lam": 0.1, "max_len": 28}, model="bert-large-uncased"),
    # Tab. 5, ConIsI-s-BERT_base and its two ablations (its SimCSE row is simcse.py's)
    common.PaperRow("Tab. 5", "ConIsI-s-BERT_base", {"avg": 78.30}),
    common.PaperRow("Tab. 5", "w/o fine-grained classification loss", {"avg": 77.00}, flags={"lam": 0.0}),
    common.PaperRow("Tab. 5", "w/o contrastive loss", {"avg": 67.68}, flags={"lam": 1.0}),
    # Tab. 6, the three strategies for c_i, on BERT-base and on RoBERTa-base
    common.PaperRow("Tab. 6", "ConIsI-o1-BERT_base", {"avg": 77.14}, flags={"strategy": "o1"},
                    note=LAM_READING.format(lam=0.8, strategy="o1")),
    common.PaperRow("Tab. 6", "ConIsI-o2-BERT_base", {"avg": 77.35}, flags={"strategy": "o2"},
                    note=LAM_READING.format(lam=0.8, strategy="o2")),
    common.PaperRow("Tab. 6", "ConIsI-s-BERT_base", {"avg": 78.30}),
    common.PaperRow("Tab. 6", "ConIsI-o1-RoBERTa_base", {"avg": 78.35}, flags={"lam": 0.1, "strategy": "o1"},
                    model="roberta-base", note=LAM_READING.format(lam=0.1, strategy="o1")),
    common.PaperRow("Tab. 6", "ConIsI-o2-RoBERTa_base", {"avg": 78.13}, flags={"lam": 0.1, "strategy": "o2"},
                    model="roberta-base", note=LAM_READING.format(lam=0.1, strategy="o2")),
    common.PaperRow("Tab. 6", "ConIsI-s-RoBERTa_base", {"avg": 77.34}, flags={"lam": 0.1},
                    model="roberta-base"),
    # Tab. 7, ConIsI-s-BERT_base per lam
    *(common.PaperRow("Tab. 7", f"ConIsI-s-BERT_base, lam = {lam:g}", {"avg": avg}, flags={"lam": lam})
      for lam, avg in TAB7_AVG_BY_LAM.items()),
    # lam 0 builds no c_i (ConIsI.forward), so o1 and o2 train the run of the lam 0 rows
    *(common.PaperRow(table, name, {"avg": 77.00}, flags={"lam": 0.0, "strategy": strategy},
                      note=f"at lam 0 no c_i is built: --strategy {strategy} trains the same run as s")
      for table, name in (("Tab. 5", "w/o fine-grained classification loss"),
                          ("Tab. 7", "ConIsI-s-BERT_base, lam = 0"))
      for strategy in ("o1", "o2")),
]


# =====================================================================================
# Antonym tables for --strategy o2 (nltk's WordNet or a file), then the command: main()
# =====================================================================================

def wordnet_antonyms() -> Callable[[str], list[str]]:
    """word -> its WordNet antonyms (lemma names, '_' as spaces), through nltk."""
    try:
        from nltk.corpus import wordnet as wn
    except ImportError:
        raise UserError("--strategy o2 takes antonyms from WordNet through nltk, which is not installed. "
                        "Run: pip install nltk && python -m nltk.downloader wordnet (or pass --antonyms "
                        "FILE with word<TAB>antonym lines).")
    try:
        wn.ensure_loaded()
    except LookupError:
        raise UserError("--strategy o2: nltk is installed but its WordNet data is missing. "
                        "Run: python -m nltk.downloader wordnet (or pass --antonyms FILE).")

    @lru_cache(maxsize=None)
    def lookup(word: str) -> list[str]:
        return sorted({a.name().replace("_", " ") for lemma in wn.lemmas(word) for a in lemma.antonyms()})
    return lookup


def read_antonym_table(path: str | Path, flag: str = "--antonyms") -> dict[str, list[str]]:
    """A word<TAB>antonym file, one pair a line (a word may have several lines)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Give word<TAB>antonym lines, or leave the "
                        f"flag out to use WordNet (pip install nltk).")
    table: dict[str, list[str]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in ((i, text) for i, text in enumerate(lines, start=1) if text.strip()):
        cells = [c.strip() for c in line.split("\t")]
        if len(cells) != 2 or not all(cells):
            raise UserError(f"{flag} {path}: line {i} is {line!r}; expected word<TAB>antonym.")
        table.setdefault(cells[0].lower(), []).append(cells[1])
    if not table:
        raise UserError(f"{flag} {path}: the file holds no word<TAB>antonym lines.")
    return table


def antonym_column(sentences: list[str], lookup: Callable[[str], list[str]] | Mapping[str, list[str]],
                   share: float, seed: int) -> list[str]:
    """c_i text for o2; a sentence with no antonym is returned as it is (o1 takes over)."""
    rng = random.Random(seed)
    out = [antonym_replace(s, lookup, share, rng) for s in sentences]
    missing = sum(c is None for c in out)
    if missing:
        print(f"note: --strategy o2: {missing} of {len(out)} sentences have no word with an "
              f"antonym; their c_i uses subword replacement (o1) instead", file=sys.stderr)
    return [c if c is not None else s for c, s in zip(out, sentences)]


def main(argv: list[str] | None = None) -> dict:
    args = common.parse_args(Args, argv, description=__doc__)
    lookup = None
    if args.strategy == "o2":  # before start(): a missing nltk stops the run before it writes
        lookup = read_antonym_table(args.antonyms) if args.antonyms else wordnet_antonyms()
    run = common.start(args)                     # torchrun, flags checked, the run folder, seed
    device = run.device                          # this process's: a GPU, or the CPU
    columns = common.load_columns(args.data)     # {"text": [...]}
    tokenizer, encoder = common.load_encoder(args.model, dropout=args.dropout)
    tpl = pair_template(tokenizer)
    if lookup is not None:
        columns["anto"] = antonym_column(columns["text"], lookup, args.replace_share, args.seed)
    data = common.tokenize_columns(args, tokenizer, columns)
    vocab = min(len(tokenizer), encoder.get_input_embeddings().num_embeddings)
    model = ConIsI(encoder, tpl, args.tau, args.lam, args.strategy, tokenizer.all_special_ids,
                   vocab, args.replace_share, args.random_share, args.bn).to(device)
    if common.world()[1] > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # Sec. 4.2: evaluation and the saved model use the raw [CLS] of the single sentence
    return common.train(args, run, model, data, tokenizer, "cls_before_pooler", paper_rows=PAPER_ROWS)


if __name__ == "__main__":
    common.run_main(main)
