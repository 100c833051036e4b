r"""RCL: Regularized Contrastive Learning of Semantic Search.

Mingxi Tan, Alexis Rolland, Andong Tian. NLPCC 2022 (Springer LNCS). arXiv:2209.13241.
BibTeX key: tan2022regularized.

What it adds to (supervised) SimCSE, in two stages (Algorithm 1):
  - stage 1: one "entropy model" per phi, trained from the same checkpoint with the contrastive
    loss plus phi times -sum_{j != i} s_ij log s_ij (Eq. 2), s_i being row i's softmax over all
    columns (its positive and any hard negatives included): only the entropy sum skips j = i;
    stopped early once its loss stops falling; the weights it stops with regulate stage 2;
  - stage 2: the final model, again from the original checkpoint, with the contrastive loss plus
    two regulators per entropy model that pull q_i and ind_i towards the frozen entropy model's
    embeddings of the same sentences against the batch (Eq. 3; no hard negatives).

Run (data/ is filled on first use, or by `python tools/download.py`):
  python rcl.py     # paper form: nli-roberta-base-v2 (SRoBERTa-base), SimCSE's NLI triplets
                    # (data/nli_for_simcse.csv), 4 phis; the run folder is runs/rcl/default
  python rcl.py --model sentence-transformers/all-MiniLM-L6-v2 --phi 0.01 0.02 --max_steps 4 \
      --eval_every 2 --batch_size 8                  # a quick CPU run of both stages on the NLI CSV
  python rcl.py --phi 0.01                           # an ablation: Tab. 4, 2 regulators
  python rcl.py --resume                             # a restart reuses the finished entropy models

docs/rcl.md: the paper's rows, each with its command (Tab. 3's untrained start and Tab. 5's entropy
models are scored by `python tools/eval.py`); where the code departs from the paper (early
stopping, hard negatives, tau); what metrics.jsonl shows; DDP; the measured numbers (a MiniLM
testbed, the unsupervised form).
"""

from __future__ import annotations

import plumbing.interrupts  # first: Ctrl-C in the imports: one line. Not found? Run it inside its clone

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import UserError, arg

# =====================================================================================
# Hyperparameters (the paper's STS setting: SRoBERTa-base on NLI)
# =====================================================================================

@dataclass
class Args(common.TrainArgs):
    """The shared flags are common.TrainArgs; RCL changes and adds (both stages share them):"""
    SOURCES = {"epochs": "paper App. A", "batch_size": "paper App. A", "max_len": "ours", "seed": "ours",
               "weight_decay": "ours", "max_grad_norm": "ours"}
    data: str = arg(common.in_data("nli_for_simcse.csv"), "a CSV sent0,sent1[,hard_neg] (the paper's NLI "
                    "form) or one sentence a line (unsupervised form: two dropout views)", "paper App. A")
    model: str = arg("sentence-transformers/nli-roberta-base-v2", "hub name or local folder of the "
                     "encoder; both stages start from it", "paper App. A")
    output_dir: str = arg("", "run folder: entropy_phi<phi>/ per entropy model (end/, best/), then the "
                          "final model's args.json, metrics.jsonl, best/, last/ (default: runs/rcl/<the "
                          "flags that differ from their defaults>, e.g. runs/rcl/phi0.01)")
    lr: float = arg(1e-5, "peak learning rate, decayed linearly to 0 (SimCSE's RoBERTa-base value; "
                    "the paper gives none)", "ours", gt=0)
    eval_every: int = arg(0, "steps between STS-B dev evaluations (0 = every 10%% of an epoch, "
                          "resolved before args.json is written)", "paper App. A", ge=0)
    resume: bool = arg(False, "continue the run in --output_dir: finished entropy models are reused")
    # NOTE(ours): App. A prints the STS setting's phi as [0.01, 0.0, 0.03, 0.04]; we read 0.02 for
    # the 0.0, the value of its own grid search, of its retrieval setting and of Tab. 4's 8 regulators
    phi: list[float] = arg([0.01, 0.02, 0.03, 0.04], "entropy weight of each entropy model, one "
                           "model per value (negative values allowed, Algorithm 1); a value given twice "
                           "regulates twice with its one model (--phi 0 0: the control of a two-model run "
                           "with the entropy term off, so that only self-distillation is left)",
                           "paper App. A")
    tau: float = arg(0.05, "temperature of every term of Eq. (2) and Eq. (3)", "ours", gt=0,
                     note="The paper's equations have no temperature; ours is 0.05 (SimCSE's).")
    patience: int = arg(3, "stop an entropy model once its mean training loss has not decreased for "
                        "this many checks (0 = no early stopping)", "paper App. A", ge=0)
    # NOTE(ours): App. A stops "if the loss doesn't decrease within 3 steps" and says training
    # "will converge quickly". One batch's loss is noise, so a check compares means over an
    # interval; at the 10%-of-an-epoch evaluations the earliest stop would be at 40% of the
    # epoch. 50 steps: on SimCSE's NLI triplets (275,601; 4,306 steps an epoch at batch 64) a
    # check every 1.2% of the epoch, the earliest stop at 4 checks = 4.6% of it
    stop_every: int = arg(50, "steps between the early-stopping checks of an entropy model (each "
                          "compares the mean training loss of these steps)", "ours", ge=1)
    # NOTE(ours): the paper does not say which weights of an entropy model regulate; Algorithm 1
    # uses the model stage 1 ends with. The best STS-B dev checkpoint tends to be the one nearest
    # the start (Tab. 5: entropy models score below it), working against what stage 1 is for
    regulate_with: str = arg("end", "which weights of each entropy model stage 2 uses: end = those its "
                             "training stopped with (early stop or the last step), best = its best "
                             "STS-B dev checkpoint", "paper Algorithm 1", choices=["end", "best"])
    final_hard_negatives: bool = arg(False, "give the final model the CSV's hard negatives too (Eq. 3 "
                                     "has none; App. A names them for the entropy models only)",
                                     "paper App. A")
    pooler: str = arg("avg", "sentence vector for training, evaluation and the saved model: masked "
                      "mean (SRoBERTa) or raw [CLS]", "paper App. A", choices=["avg", "cls_before_pooler"])

    def settle(self, data_rows: int) -> None:
        if self.eval_every == 0:   # App. A: every 10% of an epoch
            self.eval_every = max(1, data_rows // self.batch_size // 10)

    def rules(self) -> None:
        if (self.final_hard_negatives and Path(self.data).is_file()
                and "hard_neg" not in common.load_columns(self.data)):
            raise UserError(f"--final_hard_negatives: --data {self.data} has no hard_neg column. Give a CSV "
                            f"sent0,sent1,hard_neg, or leave the flag out.")


# =====================================================================================
# PAPER-SPECIFIC: the losses
# =====================================================================================

@common.fp32
def contrastive_loss(q: torch.Tensor, ind: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (1) with a temperature: row i is the query q_i, its positive the column ind_i;
    ind is (N, d), or (2N, d) with the hard negatives after the positives (extra columns)."""
    # cos(q_i, ind_j) for every query and every column
    sim = F.normalize(q, dim=-1) @ F.normalize(ind, dim=-1).T                 # (N, M)
    # Eq. (1): l_i = -log e^{cos(q_i, ind_i)/tau} / sum_j e^{cos(q_i, ind_j)/tau}
    labels = torch.arange(q.shape[0], device=q.device)                        # (N,)
    return F.cross_entropy(sim / tau, labels)                                 # ()


@common.fp32
def entropy_loss(q: torch.Tensor, ind: torch.Tensor, phi: float, tau: float) -> torch.Tensor:
    """Eq. (2), the entropy models' objective: the contrastive cross-entropy of row i minus
    phi * sum_{j != i} s_ij log s_ij, with s_ij the softmax over all columns k of cos(q_i, ind_k)/tau.
    NOTE(ours): the paper's Eq. (1)-(3) have no temperature; from a plain encoder that does not
    train, so tau divides every cosine (as in SimCSE)."""
    n = q.shape[0]
    sim = F.normalize(q, dim=-1) @ F.normalize(ind, dim=-1).T                 # (N, M)
    # log score_train_ij = log e^{cos(q_i, ind_j)/tau} / sum_k e^{cos(q_i, ind_k)/tau}
    log_s = F.log_softmax(sim / tau, dim=1)                                   # (N, M)
    ce = -log_s.diagonal()                                                    # (N,)
    # the entropy sum skips only j = i; hard-negative columns (j >= N) are in it
    diag = torch.eye(n, ind.shape[0], dtype=torch.bool, device=q.device)      # (N, M)
    s_log_s = (log_s.exp() * log_s).masked_fill(diag, 0.0)                    # (N, M)
    # Eq. (2): J_i = -log e^{cos(q_i, ind_i)/tau} / sum_j e^{cos(q_i, ind_j)/tau}
    #               - phi * sum_{j!=i} s_ij log s_ij
    return (ce - phi * s_log_s.sum(1)).mean()                                 # ()


@common.fp32
def regulator_terms(q: torch.Tensor, ind: torch.Tensor, aug_q: list[torch.Tensor],
                    aug_ind: list[torch.Tensor], tau: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The regulators of Eq. (3), a pair per entropy model n (aug_q[n], aug_ind[n]: (N, d)): q_i
    against Au_q_i^n and ind_i against Au_ind_i^n, each a cross-entropy over the batch (0-dim).
    NOTE(ours): the regulators use the N positives of ind only, not the hard negatives."""
    if len(aug_q) != len(aug_ind):
        raise ValueError(f"{len(aug_q)} aug_q tensors but {len(aug_ind)} aug_ind tensors")
    n = q.shape[0]
    labels = torch.arange(n, device=q.device)                                 # (N,)
    q_n, ind_n = F.normalize(q, dim=-1), F.normalize(ind[:n], dim=-1)         # (N, d), (N, d)
    terms = []
    for au_q, au_ind in zip(aug_q, aug_ind):
        sim_q = q_n @ F.normalize(au_q, dim=-1).T                             # (N, N)
        sim_ind = ind_n @ F.normalize(au_ind, dim=-1).T                       # (N, N)
        # Eq. (3), regulators: -log e^{cos(q_i, Au_q_i^n)/tau} / sum_k e^{cos(q_i, Au_q_k^n)/tau}
        #                      -log e^{cos(ind_i, Au_ind_i^n)/tau} / sum_k e^{cos(ind_i, Au_ind_k^n)/tau}
        terms.append((F.cross_entropy(sim_q / tau, labels), F.cross_entropy(sim_ind / tau, labels)))
    return terms


@common.fp32
def regularized_loss(q: torch.Tensor, ind: torch.Tensor, aug_q: list[torch.Tensor],
                     aug_ind: list[torch.Tensor], tau: float) -> torch.Tensor:
    """Eq. (3), the final model's objective: the contrastive term plus, for every entropy model,
    its two regulators. NOTE(ours): Eq. (3)'s first numerator reads cos(q_i, ind_j): ind_i is meant."""
    # Eq. (3), first term: -log e^{cos(q_i, ind_i)/tau} / sum_k e^{cos(q_i, ind_k)/tau}
    loss = contrastive_loss(q, ind, tau)                                      # ()
    for t_q, t_ind in regulator_terms(q, ind, aug_q, aug_ind, tau):          # + the regulators of each n
        loss = loss + t_q + t_ind                                             # ()
    return loss


@common.fp32
def row_entropy(q: torch.Tensor, ind: torch.Tensor, tau: float) -> torch.Tensor:
    """For the log: mean over i of -sum_{j != i} s_ij log s_ij (what phi weighs in Eq. 2)."""
    sim = F.normalize(q, dim=-1) @ F.normalize(ind, dim=-1).T                 # (N, M)
    log_s = F.log_softmax(sim / tau, dim=1)                                   # (N, M)
    diag = torch.eye(q.shape[0], ind.shape[0], dtype=torch.bool, device=q.device)  # (N, M)
    return -(log_s.exp() * log_s).masked_fill(diag, 0.0).sum(1).mean().detach()    # ()


class EarlyStop:
    """App. A: stop an entropy model once its loss has not decreased for `patience` checks, one
    every `every` steps, of the mean training loss since the last one; common.train asks it after
    every step and keeps its state in last/. NOTE(ours): the paper's "3 steps" read as 3 checks (as
    HF's EarlyStoppingCallback counts patience): 3 noisy batches without a new low would stop a
    model after about 6 steps, a near-copy of its start. The training loss: no held-out pairs."""

    def __init__(self, patience: int, every: int):
        self.patience, self.every, self.best, self.since = patience, every, math.inf, 0
        self.sum, self.steps = 0.0, 0           # the loss since the last check (a tensor: no wait)

    def __call__(self, step: int, loss: torch.Tensor) -> bool:
        self.sum, self.steps = self.sum + loss, self.steps + 1
        if step % self.every:
            return False
        mean, self.sum, self.steps = float(self.sum) / self.steps, 0.0, 0
        if mean < self.best:
            self.best, self.since = mean, 0
        else:
            self.since += 1
        return self.since >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "since": self.since, "sum": float(self.sum), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.since, self.sum, self.steps = (state[k] for k in ("best", "since", "sum", "steps"))


def early_stop(patience: int, every: int) -> EarlyStop | None:
    return EarlyStop(patience, every) if patience > 0 else None


# =====================================================================================
# PAPER-SPECIFIC: the models (an entropy model, the final model with its frozen regulators)
# =====================================================================================

def embed(encoder: nn.Module, pooler: str, cols: list[dict]) -> torch.Tensor:
    """Several column batches through the encoder in ONE forward pass, pooled -> (sum B, d)."""
    x = common.concat_batches(cols, encoder.config.pad_token_id or 0)         # (sum B, L)
    out = encoder(input_ids=x["input_ids"], attention_mask=x["attention_mask"])
    return common.pool(out, x["attention_mask"], pooler)                      # (sum B, d)


def query_index(encoder: nn.Module, pooler: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, ind), gathered over ranks: NLI form q = sent0, ind = sent1 [+ hard_neg after them];
    unsupervised form q, ind = two dropout views of the same sentences (as SimCSE)."""
    if "text" in batch:
        n = batch["text"]["input_ids"].shape[0]
        z = embed(encoder, pooler, [batch["text"], batch["text"]])            # (2N, d)
        return common.gather(z[:n]), common.gather(z[n:])                     # (N, d), (N, d)
    cols = [batch["sent0"], batch["sent1"]] + ([batch["hard_neg"]] if "hard_neg" in batch else [])
    n = cols[0]["input_ids"].shape[0]
    z = embed(encoder, pooler, cols)                                          # (2N or 3N, d)
    # gather positives and hard negatives apart, so the global ind keeps all positives first
    ind = torch.cat([common.gather(z[k * n:(k + 1) * n]) for k in range(1, len(cols))])  # (N or 2N, d)
    return common.gather(z[:n]), ind                                          # (N, d), (N or 2N, d)


class EntropyModel(nn.Module):
    """Stage 1: the encoder trained with Eq. (2) for one phi."""

    def __init__(self, encoder: nn.Module, pooler: str, phi: float, tau: float):
        super().__init__()
        self.encoder, self.pooler, self.phi, self.tau = encoder, pooler, phi, tau

    def forward(self, batch: dict):
        q, ind = query_index(self.encoder, self.pooler, batch)                # (N, d), (M, d)
        entropy = row_entropy(q, ind, self.tau)                               # ()
        # for the log: phi * H, the part of Eq. (2) that is not SimCSE's, beside the loss
        stats = {"entropy": entropy, "phi_entropy": self.phi * entropy}       # (), ()
        return entropy_loss(q, ind, self.phi, self.tau), stats


class RCL(nn.Module):
    """Stage 2: the encoder trained with Eq. (3); Au comes from the frozen entropy models."""

    def __init__(self, encoder: nn.Module, pooler: str, tau: float, entropy_encoders: list[nn.Module],
                 phis: list[float] | None = None):
        super().__init__()
        self.encoder, self.pooler, self.tau = encoder, pooler, tau
        self.names = regulator_names(phis if phis is not None else list(range(len(entropy_encoders))))
        # A plain list on purpose: not submodules, so they stay out of state_dict (the
        # checkpoint keeps one model; they are reloaded from entropy_phi*/end or best), out of the
        # optimizer and DDP, and model.train() cannot switch their dropout on.
        self.entropy_encoders = entropy_encoders

    @torch.no_grad()
    def augment(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Au_q^n, Au_ind^n for every entropy model n, gathered: (N, d) each, no gradient."""
        aug_q, aug_ind = [], []
        for enc in self.entropy_encoders:
            if "text" in batch:  # eval mode: no dropout, so both views share one Au
                a = common.gather(embed(enc, self.pooler, [batch["text"]]))   # (N, d)
                aug_q.append(a)
                aug_ind.append(a)
                continue
            n = batch["sent0"]["input_ids"].shape[0]
            a = embed(enc, self.pooler, [batch["sent0"], batch["sent1"]])     # (2N, d)
            aug_q.append(common.gather(a[:n]))                                # (N, d)
            aug_ind.append(common.gather(a[n:]))                              # (N, d)
        return aug_q, aug_ind

    def forward(self, batch: dict):
        q, ind = query_index(self.encoder, self.pooler, batch)                # (N, d), (M, d)
        aug_q, aug_ind = self.augment(batch)                                  # K x (N, d) each
        loss = regularized_loss(q, ind, aug_q, aug_ind, self.tau)             # ()
        with torch.no_grad():      # for the log: each term of Eq. (3) apart
            stats = {"contrastive": contrastive_loss(q, ind, self.tau)}       # ()
            stats["regulators"] = loss.detach() - stats["contrastive"]        # ()
            for name, (t_q, t_ind) in zip(self.names, regulator_terms(q, ind, aug_q, aug_ind, self.tau)):
                stats[f"reg_q_{name}"], stats[f"reg_ind_{name}"] = t_q, t_ind    # (), ()
        return loss, stats


def regulator_names(phis: list[float]) -> list[str]:
    """The log's name of each entropy model's regulators: phi0.01, ...; a value given twice
    (--phi 0 0) is phi0 then phi0_2."""
    names = [f"phi{phi:g}" for phi in phis]
    return [name if k == 0 else f"{name}_{k + 1}" for name, k in
            ((name, names[:i].count(name)) for i, name in enumerate(names))]


# =====================================================================================
# PAPER-SPECIFIC: Algorithm 1. Stage 1 trains an entropy model per phi, stage 2 the final model
# regulated by them; each entropy model is a stage of the run folder (run.stage: plumbing/run_folder.py)
# =====================================================================================

def trained_with(args: Args, phi: float) -> dict:
    """What an entropy model was trained from: a --resume reuses it only with the same settings."""
    return {"phi": phi, "model": args.model, "data": str(Path(args.data).resolve()), "tau": args.tau,
            "pooler": args.pooler, "max_len": args.max_len, "seed": args.seed, "patience": args.patience,
            "stop_every": args.stop_every}


def entropy_stage(args: Args, run: common.RunFolder, data: dict) -> list[Path]:
    """Stage 1: one entropy model per phi, each from the original checkpoint; one finished earlier
    (with the same settings) is reused, not retrained. Prints the summary of all of them. Returns
    the folders of the weights that regulate (end/ or best/, --regulate_with)."""
    folders, summaries, start_figures = {}, [], {}
    for phi in dict.fromkeys(args.phi):     # a value given twice: one model, which regulates twice
        stage = run.stage(f"entropy_phi{phi:g}", trained_with(args, phi))
        summary = stage.finished()
        if summary is None:
            summary = train_entropy_model(args, phi, stage, data, start_figures)
        elif not (stage.out / args.regulate_with).is_dir():
            raise UserError(f"--regulate_with {args.regulate_with}: {stage.out} has no "
                            f"{args.regulate_with}/ (made by an earlier rcl.py?). Delete {stage.out} "
                            f"to train it again, or pass --regulate_with best.")
        elif common.world()[0] == 0:
            print(f"entropy model phi={phi:g}: reusing {stage.out / args.regulate_with} "
                  f"({where_stopped(summary)}, best STS-B dev {summary['best_dev']:.2f})")
        folders[phi] = stage.out / args.regulate_with
        summaries.append(summary)
    if common.world()[0] == 0:
        print(summary_table(summaries, args.regulate_with))
    return [folders[phi] for phi in args.phi]


def train_entropy_model(args: Args, phi: float, stage: common.RunFolder, data: dict,
                        start_figures: dict | None = None) -> dict:
    """Stage 1 for one phi, from the original checkpoint, in the stage's folder:
    Eq. (2), stopped early when the loss stops falling; then the stage is finished with the weights
    it stopped with (end/) and its summary, for both end/ and best/. `start_figures` caches the
    starting checkpoint's row entropy and STS-B dev (the same for every phi): measured on first use."""
    stage.open()
    device = stage.device
    common.seed_everything(args.seed)  # the same start for every phi, skipped ones or not
    tokenizer, encoder = common.load_encoder(args.model)
    model = EntropyModel(encoder, args.pooler, phi, args.tau).to(device)
    at_start = {} if start_figures is None else start_figures
    if not at_start:  # the starting checkpoint (common.train loads last/ only later, on --resume)
        at_start["entropy_start"] = probe_entropy(model, data, args, device)
        if common.world()[0] == 0:
            dev = common.evaluate_sts(common.make_encode(encoder, tokenizer, args.pooler),
                                      args.sts_dir, split="dev", desc="the entropy models' start")
            at_start["dev_start"] = dev["STSBenchmark"]["spearman"]
    # a stop is evaluated and checkpointed at its step: last/ and last_dev are of the weights at the stop
    res = common.train(args, stage, model, data, tokenizer, args.pooler,
                       should_stop=early_stop(args.patience, args.stop_every), final_eval=False)
    _, best = common.load_encoder(str(stage.out / "best"))
    summary = {**stage.settings, "steps": res["steps"], "total": res["total"],
               "epoch_steps": len(next(iter(data.values()))) // args.batch_size,
               "stopped_early": res["stopped_early"], "best_dev": res["best_dev"],
               "best_step": res["best_step"], "dev_start": at_start.get("dev_start"),
               "dev_end": res["last_dev"], "entropy_start": at_start["entropy_start"],
               "entropy_end": probe_entropy(model, data, args, device),
               "entropy_best": probe_entropy(EntropyModel(best, args.pooler, phi, args.tau).to(device),
                                             data, args, device)}
    if common.world()[0] == 0:
        entropy, dev = regulating(summary, args.regulate_with)
        print(f"entropy model phi={phi:g}: {where_stopped(summary)}; its {args.regulate_with}/ weights, "
              f"which regulate: row entropy {summary['entropy_start']:.4f} -> {entropy:.4f}, STS-B dev "
              f"{figure(summary['dev_start'], '.2f')} -> {dev:.2f}")
    stage.finish(summary, encoder, tokenizer, args.pooler)      # end/, DONE.json; last/ dropped
    return summary


@torch.no_grad()
def probe_entropy(model: EntropyModel, data: dict, args: Args, device: torch.device) -> float:
    """Row entropy (Eq. 2's term, the log's "entropy") of `model` on the first training batch.
    NOTE(ours): a no-grad pass with the same batch and the same dropout draw before and after
    training, so start -> end differs only by the weights; in fp32 on every device, as the
    evaluation. The global RNG is left as it was."""
    first = common.batch_plan(len(next(iter(data.values()))), args.batch_size, args.seed, 0)[0]
    batch = common.device_batch(data, common.local_rows(first), None, device)
    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(args.seed)
        _, stats = model(batch)
    model.train(was_training)
    return float(stats["entropy"])


def load_frozen(folder: Path, device: torch.device) -> nn.Module:
    """An entropy model as a regulator: eval mode (no dropout), no gradient."""
    _, enc = common.load_encoder(str(folder), flag=f"entropy model {folder}")
    return enc.requires_grad_(False).eval().to(device)


def train_final(args: Args, run: common.RunFolder, data: dict, folders: list[Path]) -> dict:
    """Stage 2: the final model from the original checkpoint with Eq. (3), regulated by the
    entropy models in `folders`; without the hard negatives unless --final_hard_negatives."""
    device = run.device
    common.seed_everything(args.seed)
    tokenizer, encoder = common.load_encoder(args.model)
    loaded = {d: load_frozen(d, device) for d in dict.fromkeys(folders)}   # a model given twice: loaded once
    regulators = [loaded[d] for d in folders]
    model = RCL(encoder, args.pooler, args.tau, regulators, args.phi).to(device)
    # App. A: the final model sees "the positive instances and entailment instances"
    data = {k: v for k, v in data.items() if k != "hard_neg" or args.final_hard_negatives}
    return common.train(args, run, model, data, tokenizer, args.pooler, paper_rows=PAPER_ROWS)


# =====================================================================================
# The stage-1 summary: where each entropy model stopped, and how far it moved
# =====================================================================================

def figure(x, spec: str) -> str:
    """x formatted, or "?" for a figure that a DONE.json written by an older rcl.py lacks."""
    return "?" if x is None else format(x, spec)


def regulating(summary: dict, which: str) -> tuple[float | None, float | None]:
    """(row entropy, STS-B dev) of an entropy model's end/ or best/ weights, from its DONE.json."""
    return summary.get(f"entropy_{which}"), summary.get("dev_end" if which == "end" else "best_dev")


def where_stopped(summary: dict) -> str:
    """'stopped early at step 350 of 4306 (8% of an epoch)', or 'trained its 4306 steps'."""
    if not summary.get("stopped_early"):
        return f"trained its {summary['steps']} steps"
    share = (f" ({100 * summary['steps'] / summary['epoch_steps']:.0f}% of an epoch)"
             if summary.get("epoch_steps") else "")
    return f"stopped early at step {summary['steps']} of {summary.get('total', '?')}{share}"


def summary_table(records: list[dict], regulate_with: str = "end") -> str:
    """The stage-1 summary: where each entropy model stopped, and how far the weights that
    regulate (`regulate_with`) moved from the start: row entropy (beside the phi = 0 model's,
    when there is one: the control for what phi does) and STS-B dev."""
    zero = next((regulating(r, regulate_with)[0] for r in records if r["phi"] == 0), None)
    lines = [f"Stage 1, entropy models; the figures are of the weights that regulate ({regulate_with}/): "
             f"row entropy = Eq. 2's term on the first training batch, no grad; STS-B dev x 100",
             f"{'phi':>7}  {'row entropy start -> ' + regulate_with:<26}  {'- phi 0':>8}  "
             f"{'STS-B dev start -> ' + regulate_with:<24}  best (step)  where it stopped"]
    for r in records:
        entropy, dev = regulating(r, regulate_with)
        vs = f"{entropy - zero:+.4f}" if None not in (entropy, zero) else "-"
        lines.append(f"{r['phi']:>7g}  {figure(r.get('entropy_start'), '.4f'):>10} -> "
                     f"{figure(entropy, '.4f'):<12}  {vs:>8}  {figure(r.get('dev_start'), '.2f'):>8} -> "
                     f"{figure(dev, '.2f'):<12}  {figure(r['best_dev'], '.2f')} ({r['best_step']})  "
                     f"{where_stopped(r)}")
    return "\n".join(lines)


# =====================================================================================
# The paper's rows (docs/rcl.md maps each to its command); the end of a run prints the ones its
# flags select beside its own figures. All are SRoBERTa-base trained on SNLI and MNLI (App. A),
# SimCSE's NLI triplets here: a run on another file (a text file: the unsupervised form) has none
# =====================================================================================

NLI = "nli_for_simcse.csv"
TAB4_AVG_BY_PHI = {(0.01,): 81.47, (0.01, 0.02): 81.98, (0.01, 0.02, 0.03): 82.29,
                   (0.01, 0.02, 0.03, 0.04): 82.40, (0.01, 0.02, 0.03, 0.04, 0.05): 82.42}

PAPER_ROWS = [
    common.PaperRow("Tab. 3", "RCL(ours)",
                    {"STS12": 76.15, "STS13": 85.84, "STS14": 80.89, "STS15": 86.58, "STS16": 83.36,
                     "STSBenchmark": 84.85, "SICKRelatedness": 79.14, "avg": 82.40},
                    data=NLI, note=f"a mean of 5 runs, on the NLI triplets ({NLI})"),
    # Tab. 4: the 7-task average per number of regulators, two per entropy model (phi)
    *(common.PaperRow("Tab. 4", f"Number of Regulator: {2 * len(phi)} (phi = {', '.join(map(str, phi))})",
                      {"avg": avg}, flags={"phi": list(phi)}, data=NLI,
                      note=f"on the NLI triplets ({NLI}); Tab. 4 does not say over how many runs")
      for phi, avg in TAB4_AVG_BY_PHI.items()),
]


# =====================================================================================
# The command: main() reads the flags, loads the data and the encoder, and trains (common.py)
# =====================================================================================

def main(argv: list[str] | None = None) -> dict:
    args = common.parse_args(Args, argv, description=__doc__)
    run = common.start(args)                     # torchrun, flags checked, the run folder, seed
    columns = common.load_columns(args.data)     # {"text"} or {"sent0", "sent1"[, "hard_neg"]}
    tokenizer, _ = common.load_encoder(args.model)
    data = common.tokenize_columns(args, tokenizer, columns)
    return train_final(args, run, data, entropy_stage(args, run, data))


if __name__ == "__main__":
    common.run_main(main)
