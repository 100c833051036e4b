r"""SimCSE: Simple Contrastive Learning of Sentence Embeddings.

Tianyu Gao, Xingcheng Yao, Danqi Chen. EMNLP 2021. arXiv:2104.08821. BibTeX key: gao2021simcse.
Official code: github.com/princeton-nlp/SimCSE.

The baseline every other script in this repository is read against:
  - unsupervised: each sentence is encoded twice; dropout alone makes the two views differ,
    and the other sentences of the batch are the negatives (Eq. 4);
  - supervised: an NLI entailment is the positive, its contradiction a hard negative (Eq. 5);
  - [CLS] through an MLP in training; unsupervised evaluation uses the raw [CLS].

Run (data/ is filled on first use, or by `python tools/download.py`):
  python simcse.py                                   # unsupervised bert-base-uncased on wiki1m
  python simcse.py --model sentence-transformers/all-MiniLM-L6-v2 --max_steps 100 \
      --eval_every 50                                # a short run of a small encoder (a CPU will do)
  python simcse.py --dropout 0                       # an ablation: Tab. 3, the dropout p (default 0.1)
  python simcse.py --data data/nli_for_simcse.csv    # supervised SimCSE (its defaults follow the CSV)

docs/simcse.md: the paper's rows, each with its command (every ablation is a flag); where the
code departs from the paper; the measured numbers (a MiniLM testbed; the bert-base recipe prints
the paper's numbers beside yours at the end of a run).
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
from common import arg

# =====================================================================================
# Hyperparameters (unsupervised BERT-base unless the data is a CSV)
# =====================================================================================

@dataclass
class Args(common.TrainArgs):
    """TrainArgs' defaults are this paper's (common.py); SimCSE adds:"""
    data: str = arg(common.in_data("wiki1m_for_simcse.txt"), "one sentence a line (unsupervised) or a CSV "
                    "sent0,sent1[,hard_neg] (supervised)", "paper Sec. 3")
    eval_every: int = arg(125, "steps between STS-B dev evaluations (run_unsup_example.sh; the "
                          "paper's App. A says every 250)", "official code", ge=1)
    tau: float = arg(0.05, "temperature of the contrastive loss", "paper Tab. D.1", gt=0,
                     note="The paper's Tab. D.1 tries 0.001 to 1; 0.05 is its best.")
    pooler: str = arg("cls_before_pooler", "sentence vector (Tab. 6): cls = [CLS] + MLP in training and "
                      "evaluation (sup); cls_before_pooler = MLP in training only, raw [CLS] for "
                      "evaluation (unsup); avg_first_last = mean of the first and last layers, no MLP",
                      "official code", choices=["cls", "cls_before_pooler", "avg_first_last"])
    no_mlp: bool = arg(False, "no MLP over [CLS] in training either (Tab. 6 'w/o MLP')", "paper Tab. 6")
    dropout: float = arg(0.1, "dropout p of the encoder's hidden layers and attention probabilities, the "
                         "only noise between the two views (replaces --model's own; BERT's is 0.1)",
                         "paper Tab. 3", ge=0, lt=1,
                         note="A rate; the paper's Tab. 3 tries 0, 0.01, 0.05, 0.1, 0.15, 0.2 and 0.5, "
                              "and 0.1 (BERT's own) is its best.")
    fixed_mask: bool = arg(False, "the same dropout mask on both views of a sentence (Tab. 3 'Fixed 0.1'): "
                           "the two views are then one vector", "paper Tab. 3")
    alpha: float = arg(1.0, "weight alpha of each anchor's own hard negative (Eq. 8, Sec. 6.3; the "
                       "official code's --hard_negative_weight is ln(alpha))", "paper Tab. 7", gt=0,
                       note="A weight on e^{sim/tau}; the paper's Tab. 7 tries 0.5, 1 and 2, and 1 is its "
                            "best.")
    no_hard_neg: bool = arg(False, "leave out the CSV's hard_neg column: Eq. (1) with the CSV's pairs as "
                            "positives (Tab. 7 'N/A'; Tab. 4); set by itself for a CSV without that column",
                            "paper Tab. 7")

    def rules(self) -> None:
        csv = str(self.data).lower().endswith(".csv")
        if self.no_mlp and self.pooler == "cls":
            raise common.UserError("--no_mlp with --pooler cls: the cls pooler is [CLS] through the MLP. "
                                   "Use --pooler cls_before_pooler with --no_mlp (Tab. 6 'w/o MLP').")
        if self.fixed_mask and csv:
            raise common.UserError(f"--fixed_mask with --data {self.data}: one dropout mask for a sentence's "
                                   f"two views is Tab. 3's unsupervised variant; a CSV's pairs are two "
                                   f"sentences. Drop --fixed_mask, or train on a text file.")
        if not csv and (self.alpha != 1 or self.no_hard_neg):
            flag = f"--alpha {self.alpha:g}" if self.alpha != 1 else "--no_hard_neg"
            raise common.UserError(f"{flag} with --data {self.data}: it acts on the hard negatives of "
                                   f"supervised SimCSE, a CSV sent0,sent1,hard_neg. Pass --data "
                                   f"data/nli_for_simcse.csv, or drop {flag}.")
        if self.no_hard_neg and self.alpha != 1:
            raise common.UserError(f"--alpha {self.alpha:g} with --no_hard_neg: there is no hard negative "
                                   f"to weight. Drop one of the two.")

    def settle(self, data_rows: int) -> None:
        # a CSV of pairs (no hard_neg column) trains Eq. (1): --no_hard_neg is set, so that
        # args.json and the paper's rows it selects say what the run trains
        csv = str(self.data).lower().endswith(".csv")
        if csv and not self.no_hard_neg and "hard_neg" not in common.load_columns(self.data):
            print(f"note: --data {self.data} has no hard_neg column: Eq. (1) with its pairs as positives "
                  f"(--no_hard_neg)", file=sys.stderr)
            self.no_hard_neg = True

    # Supervised SimCSE (a CSV): paper App. A / official run_sup_example.sh; flags still win
    CSV_DEFAULTS = {"batch_size": 512, "lr": 5e-5, "epochs": 3, "pooler": "cls"}


# =====================================================================================
# PAPER-SPECIFIC: the losses
# =====================================================================================

@common.fp32
def simcse_loss(h: torch.Tensor, h_pos: torch.Tensor, tau: float) -> torch.Tensor:
    """Unsupervised SimCSE, Eq. (4): row i is the anchor h_i, column j the second view h_j^+."""
    # sim(h_i, h_j^+) = cos(h_i, h_j^+) for every pair of the batch
    sim = F.normalize(h, dim=-1) @ F.normalize(h_pos, dim=-1).T               # (N, N)
    # Eq. (4): l_i = -log e^{sim(h_i, h_i^+)/tau} / sum_j e^{sim(h_i, h_j^+)/tau}
    labels = torch.arange(h.shape[0], device=h.device)                        # (N,)
    return F.cross_entropy(sim / tau, labels)                                 # ()


@common.fp32
def simcse_sup_loss(h: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor,
                    tau: float, alpha: float = 1.0) -> torch.Tensor:
    """Supervised SimCSE with Sec. 6.3's weight alpha on each anchor's own hard negative h_i^-,
    Eq. (8): the hard negatives h_j^- are extra columns. alpha = 1 is Eq. (5) itself."""
    h, h_pos, h_neg = (F.normalize(x, dim=-1) for x in (h, h_pos, h_neg))
    n = h.shape[0]
    sim = torch.cat([h @ h_pos.T, h @ h_neg.T], dim=1)                        # (N, 2N)
    # alpha^{1_i^j}, 1_i^j = 1 iff i = j: alpha e^{s/tau} = e^{s/tau + ln alpha}, so ln(alpha) is
    # added to the logit of column N + i in row i only (the other rows' h_j^- keep weight 1).
    # NOTE(paper vs code): the official code adds its hard_negative_weight there: it is ln(alpha)
    eye = torch.eye(n, dtype=sim.dtype, device=sim.device)                   # (N, N)
    log_w = torch.cat([torch.zeros_like(eye), math.log(alpha) * eye], dim=1)  # (N, 2N)
    # Eq. (5) / (8): l_i = -log e^{sim(h_i,h_i^+)/tau}
    #     / sum_j (e^{sim(h_i,h_j^+)/tau} + alpha^{1_i^j} e^{sim(h_i,h_j^-)/tau}); alpha = 1: Eq. (5)
    labels = torch.arange(n, device=h.device)                                 # (N,)
    return F.cross_entropy(sim / tau + log_w, labels)                         # ()


# =====================================================================================
# PAPER-SPECIFIC: the model (encoder + MLP over [CLS])
# =====================================================================================

class SimCSE(nn.Module):
    def __init__(self, encoder: nn.Module, tau: float, supervised: bool,
                 pooler: str = "cls_before_pooler", mlp: bool = True, fixed_mask: bool = False,
                 alpha: float = 1.0):
        super().__init__()
        self.encoder, self.tau, self.supervised, self.pooler = encoder, tau, supervised, pooler
        self.fixed_mask, self.alpha = fixed_mask, alpha
        # MLP over [CLS] (Linear + Tanh), freshly initialised; BERT's NSP pooler is not used.
        # None: Tab. 6's "w/o MLP" (--no_mlp) and "First-last avg." rows
        use_mlp = mlp and pooler != "avg_first_last"
        self.mlp = common.MLP(encoder.config.hidden_size) if use_mlp else None

    def embed(self, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.pooler == "avg_first_last":
            out = self.encoder(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                               output_hidden_states=True)
            return common.pool(out, ids["attention_mask"], "avg_first_last")   # (B, d)
        out = self.encoder(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
        h = out.last_hidden_state[:, 0]                                       # (B, d) [CLS]
        return self.mlp(h) if self.mlp is not None else h                     # (B, d)

    def forward(self, batch: dict) -> torch.Tensor:
        if not self.supervised:
            x = batch["text"]                                                 # (N, L)
            n = x["input_ids"].shape[0]
            if self.fixed_mask:
                # Tab. 3 "Fixed 0.1": one dropout mask z for both views, so h^z and h^+ = h^z are
                # one vector. NOTE(ours): one pass, h_pos = h: two passes under one mask give the
                # same values and the same gradients (tests/test_simcse.py), at half the cost
                h = common.gather(self.embed(x))                              # (N, d)
                return simcse_loss(h, h, self.tau)
            # the same sentences twice in ONE forward pass: two independent dropout masks
            z = self.embed(common.concat_batches([x, x]))                     # (2N, d)
            h, h_pos = z[:n], z[n:]                                           # (N, d), (N, d)
            return simcse_loss(common.gather(h), common.gather(h_pos), self.tau)
        cols = [batch["sent0"], batch["sent1"]] + ([batch["hard_neg"]] if "hard_neg" in batch else [])
        n = cols[0]["input_ids"].shape[0]
        pad_id = self.encoder.config.pad_token_id or 0
        z = self.embed(common.concat_batches(cols, pad_id))                   # (2N or 3N, d)
        h, h_pos = common.gather(z[:n]), common.gather(z[n:2 * n])            # (N, d), (N, d)
        if len(cols) == 2:  # pairs without hard negatives (--no_hard_neg)
            # Eq. (1): l_i = -log e^{sim(h_i, h_i^+)/tau} / sum_j e^{sim(h_i, h_j^+)/tau}, h_i^+ the pair's
            # second sentence: the loss of Eq. (4), with NLI pairs instead of two dropout masks
            return simcse_loss(h, h_pos, self.tau)
        return simcse_sup_loss(h, h_pos, common.gather(z[2 * n:]), self.tau, self.alpha)


# =====================================================================================
# The paper's rows: the end of a run prints those its flags select beside its own figures
# (docs/simcse.md maps each to its command). Every figure is as printed in the paper, but the
# BERT-large averages: the official repository's README (the paper has no BERT-large row).
# =====================================================================================

NLI = "nli_for_simcse.csv"
TAB5 = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg")


def _tab5(name: str, figures: tuple, model: str = "", data: str = "", **flags) -> common.PaperRow:
    return common.PaperRow("Tab. 5", name, dict(zip(TAB5, figures)), "test", flags, model, data)


def _dev(table: str, name: str, stsb: float, data: str = "", note: str = "", **flags) -> common.PaperRow:
    return common.PaperRow(table, name, {"STSBenchmark": stsb}, "dev", flags, data=data, note=note)


TAB3_NOTE = ("Sec. 3: with p = 0 or one mask for both views ('Fixed 0.1') the pair's two embeddings are "
             "exactly the same, and it leads to a dramatic performance degradation; all models greatly "
             "improve uniformity, but the alignment of these two variants degrades drastically (Fig. 2): "
             "see alignment and uniformity in metrics.jsonl")
D1_NOTE = ("our reading: the table does not say which SimCSE it trained; its 0.05 figure is the "
           "supervised 86.2 of Tab. 6 and 7")
FIRST_LAST_NOTE = ("the official code averaged the embedding layer and the last layer until its commit "
                   "206d7ae (Jan 2022, 'fix first-last avg'); here, as there now, the first Transformer "
                   "layer and the last")
PAPER_ROWS = [
    # Tab. 5: 7 STS test sets; App. A's batch size and learning rate per encoder
    _tab5("Unsup-SimCSE-BERT_base", (68.40, 82.41, 74.38, 80.91, 78.56, 76.85, 72.23, 76.25)),
    _tab5("Unsup-SimCSE-RoBERTa_base", (70.16, 81.77, 73.24, 81.36, 80.65, 80.22, 68.56, 76.57),
          "roberta-base", batch_size=512, lr=1e-5),
    _tab5("Unsup-SimCSE-RoBERTa_large", (72.86, 83.99, 75.62, 84.77, 81.80, 81.98, 71.26, 78.90),
          "roberta-large", batch_size=512, lr=3e-5),
    _tab5("Sup-SimCSE-BERT_base", (75.30, 84.67, 80.19, 85.40, 80.82, 84.25, 80.39, 81.57), data=NLI),
    _tab5("Sup-SimCSE-RoBERTa_base", (76.53, 85.21, 80.95, 86.03, 82.57, 85.83, 80.50, 82.52),
          "roberta-base", NLI),
    _tab5("Sup-SimCSE-RoBERTa_large", (77.46, 87.27, 82.36, 86.66, 83.93, 86.70, 81.95, 83.76),
          "roberta-large", NLI, lr=1e-5),
    # BERT-large: the official README's 7-task averages only (App. A: lr 1e-5; batch 64 / 512)
    common.PaperRow("official README", "unsup-simcse-bert-large-uncased", {"avg": 78.41}, "test",
                    {"lr": 1e-5}, "bert-large-uncased",
                    note="the paper's Tab. 5 has no BERT-large row; the official README gives its average"),
    common.PaperRow("official README", "sup-simcse-bert-large-uncased", {"avg": 82.21}, "test",
                    {"lr": 1e-5}, "bert-large-uncased", NLI,
                    note="the paper's Tab. 5 has no BERT-large row; the official README gives its average"),
    # Tab. 3: dropout p, unsupervised BERT-base, STS-B dev
    *[_dev("Tab. 3", f"p = {p}", s, note=TAB3_NOTE if p == "0.0" else "",
           **({} if p == "0.1" else {"dropout": float(p)})) for p, s in
      [("0.0", 71.1), ("0.01", 72.6), ("0.05", 81.1), ("0.1", 82.5), ("0.15", 81.4), ("0.2", 80.5),
       ("0.5", 71.0)]],
    _dev("Tab. 3", "Fixed 0.1", 43.6, note=TAB3_NOTE, fixed_mask=True),
    # Tab. 6: the pooler, STS-B dev; Unsup. on a text file, Sup. on the NLI CSV (default pooler cls)
    _dev("Tab. 6", "[CLS] w/ MLP, Unsup.", 81.7, pooler="cls"),
    _dev("Tab. 6", "[CLS] w/ MLP (train), Unsup.", 82.5),
    _dev("Tab. 6", "[CLS] w/o MLP, Unsup.", 80.9, no_mlp=True),
    _dev("Tab. 6", "First-last avg., Unsup.", 81.2, note=FIRST_LAST_NOTE, pooler="avg_first_last"),
    _dev("Tab. 6", "[CLS] w/ MLP, Sup.", 86.2, NLI),
    _dev("Tab. 6", "[CLS] w/ MLP (train), Sup.", 85.8, NLI, pooler="cls_before_pooler"),
    _dev("Tab. 6", "[CLS] w/o MLP, Sup.", 86.2, NLI, pooler="cls_before_pooler", no_mlp=True),
    _dev("Tab. 6", "First-last avg., Sup.", 86.1, NLI, FIRST_LAST_NOTE, pooler="avg_first_last"),
    # Tab. 7: the hard negatives of supervised SimCSE, STS-B dev
    _dev("Tab. 7", "N/A", 84.9, NLI, no_hard_neg=True),
    *[_dev("Tab. 7", f"Contradiction, alpha = {a}", s, NLI, **({} if a == "1.0" else {"alpha": float(a)}))
      for a, s in [("0.5", 86.1), ("1.0", 86.2), ("2.0", 86.2)]],
    # Tab. 4: supervised datasets, STS-B dev, "full"; only these two cells are in the text we cite
    _dev("Tab. 4", "SNLI+MNLI entailment, full", 84.9, NLI, "the sample (134k pairs) column is not printed "
         "here: its figures could not be checked in a citable copy of the paper", no_hard_neg=True),
    _dev("Tab. 4", "SNLI+MNLI entailment + hard neg.", 86.2, NLI),
    # Tab. D.1: the temperature, STS-B dev
    *[_dev("Tab. D.1", f"tau = {t}", s, NLI, D1_NOTE, **({} if t == "0.05" else {"tau": float(t)}))
      for t, s in [("0.001", 84.9), ("0.01", 85.4), ("0.05", 86.2), ("0.1", 82.0), ("1", 64.0)]],
]


# =====================================================================================
# The command: main() reads the flags, loads the data and the encoder, and trains (common.py)
# =====================================================================================

def main(argv: list[str] | None = None) -> dict | None:
    args = common.parse_args(Args, argv, description=__doc__)
    run = common.start(args)                     # torchrun, flags checked, the run folder, seed
    device = run.device                          # this process's: a GPU, or the CPU
    columns = common.load_columns(args.data)     # {"text"} or {"sent0", "sent1"[, "hard_neg"]}
    supervised = "sent0" in columns
    if args.no_hard_neg:
        columns.pop("hard_neg", None)            # Tab. 7 "N/A": the pairs alone
    tokenizer, encoder = common.load_encoder(args.model, dropout=args.dropout)
    data = common.tokenize_columns(args, tokenizer, columns)
    model = SimCSE(encoder, args.tau, supervised, args.pooler, mlp=not args.no_mlp,
                   fixed_mask=args.fixed_mask, alpha=args.alpha).to(device)
    return common.train(args, run, model, data, tokenizer, args.pooler, paper_rows=PAPER_ROWS)


if __name__ == "__main__":
    common.run_main(main)
