r"""SimCSE: Simple Contrastive Learning of Sentence Embeddings.

Tianyu Gao, Xingcheng Yao, Danqi Chen. EMNLP 2021. arXiv:2104.08821. BibTeX key: gao2021simcse.

The baseline every other script in this repository is read against:
  - unsupervised: each sentence is encoded twice; dropout alone makes the two views differ,
    and the other sentences of the batch are the negatives (Eq. 4);
  - supervised: an NLI entailment is the positive, its contradiction a hard negative (Eq. 5);
  - [CLS] through an MLP in training; unsupervised evaluation uses the raw [CLS].

Run:
  python simcse.py                                   # bert-base-uncased on wiki1m (downloaded on first use)
  python simcse.py --data data/nli_for_simcse.csv    # supervised SimCSE (its defaults follow the CSV)
  python simcse.py --model ../shared/models/all-MiniLM-L6-v2 --data ../shared/data/english_sentences.txt \
      --sts_dir ../shared/data/sts --output_dir runs/minilm   # the small real testbed (README)
  python tools/bench.py --method simcse              # time the training step (GPU: bf16, CUDA graphs)
The paper's ablation rows, one flag each (README.md maps every row to its command):
  python simcse.py --tau 0.01                        # Tab. D.1: the temperature (0.001 ... 1)
  python simcse.py --pooler cls                      # Tab. 6 "w/ MLP": the MLP kept for evaluation
  python simcse.py --no_mlp                          # Tab. 6 "w/o MLP": raw [CLS] in training too
  python simcse.py --pooler avg_first_last           # Tab. 6 "First-last avg.": no [CLS], no MLP
  (the default is Tab. 6 "w/ MLP (train)"; with --data nli.csv the same flags give the "Sup." column)

Measured numbers: README.md, "Results" (the MiniLM testbed; the bert-base recipe prints the
paper's numbers beside yours at the end of a run).
"""

from __future__ import annotations

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
    data: str = arg("data/wiki1m_for_simcse.txt", "one sentence a line (unsupervised) or a CSV "
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

    def rules(self) -> None:
        if self.no_mlp and self.pooler == "cls":
            raise common.UserError("--no_mlp with --pooler cls: the cls pooler is [CLS] through the MLP. "
                                   "Use --pooler cls_before_pooler with --no_mlp (Tab. 6 'w/o MLP').")


    # Supervised SimCSE (a CSV): paper App. A / official run_sup_example.sh; flags still win
    csv_defaults = {"batch_size": 512, "lr": 5e-5, "epochs": 3, "pooler": "cls"}


# The paper's rows (README.md maps each to its command); the end of a run prints the ones its
# flags select beside its own figures
PAPER_ROWS = [
    common.PaperRow("Tab. 5", "Unsup-SimCSE-BERT_base",
                    {"STS12": 68.40, "STS13": 82.41, "STS14": 74.38, "STS15": 80.91, "STS16": 78.56,
                     "STSBenchmark": 76.85, "SICKRelatedness": 72.23, "avg": 76.25}),
    common.PaperRow("Tab. 5", "Sup-SimCSE-BERT_base",
                    {"STS12": 75.30, "STS13": 84.67, "STS14": 80.19, "STS15": 85.40, "STS16": 80.82,
                     "STSBenchmark": 84.25, "SICKRelatedness": 80.39, "avg": 81.57},
                    data="nli_for_simcse.csv"),
]


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
                    tau: float) -> torch.Tensor:
    """Supervised SimCSE, Eq. (5): the hard negatives h_j^- are extra columns."""
    h, h_pos, h_neg = (F.normalize(x, dim=-1) for x in (h, h_pos, h_neg))
    sim = torch.cat([h @ h_pos.T, h @ h_neg.T], dim=1)                        # (N, 2N)
    # Eq. (5): l_i = -log e^{sim(h_i,h_i^+)/tau} / sum_j (e^{sim(h_i,h_j^+)/tau} + e^{sim(h_i,h_j^-)/tau})
    labels = torch.arange(h.shape[0], device=h.device)                        # (N,)
    return F.cross_entropy(sim / tau, labels)                                 # ()


# =====================================================================================
# PAPER-SPECIFIC: the model (encoder + MLP over [CLS])
# =====================================================================================

class SimCSE(nn.Module):
    def __init__(self, encoder: nn.Module, tau: float, supervised: bool,
                 pooler: str = "cls_before_pooler", mlp: bool = True):
        super().__init__()
        self.encoder, self.tau, self.supervised, self.pooler = encoder, tau, supervised, pooler
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
            # the same sentences twice in ONE forward pass: two independent dropout masks
            z = self.embed(common.concat_batches([x, x]))                     # (2N, d)
            h, h_pos = z[:n], z[n:]                                           # (N, d), (N, d)
            return simcse_loss(common.gather(h), common.gather(h_pos), self.tau)
        cols = [batch["sent0"], batch["sent1"]] + ([batch["hard_neg"]] if "hard_neg" in batch else [])
        n = cols[0]["input_ids"].shape[0]
        pad_id = self.encoder.config.pad_token_id or 0
        z = self.embed(common.concat_batches(cols, pad_id))                   # (2N or 3N, d)
        h, h_pos = common.gather(z[:n]), common.gather(z[n:2 * n])            # (N, d), (N, d)
        if len(cols) == 2:  # pairs without hard negatives: Eq. (4) with NLI positives
            return simcse_loss(h, h_pos, self.tau)
        return simcse_sup_loss(h, h_pos, common.gather(z[2 * n:]), self.tau)


# =====================================================================================
# Plumbing: everything below calls common.py
# =====================================================================================

def main(argv: list[str] | None = None) -> dict | None:
    args = common.parse_args(Args, argv, description=__doc__)
    device = common.start(args)                  # torchrun, flags checked, seed, output folder
    columns = common.load_columns(args.data)     # {"text"} or {"sent0", "sent1"[, "hard_neg"]}
    supervised = "sent0" in columns
    tokenizer, encoder = common.load_encoder(args.model)
    data = common.tokenize_columns(args, tokenizer, columns)
    model = SimCSE(encoder, args.tau, supervised, args.pooler, mlp=not args.no_mlp).to(device)
    return common.train(args, model, data, tokenizer, args.pooler, paper_rows=PAPER_ROWS)


if __name__ == "__main__":
    common.run_main(main)
