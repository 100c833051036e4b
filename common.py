"""What every method script shares, in the order a training run meets it, for a reader of the
papers; a script (simcse.py, focal_infonce.py, ifcl.py, conisi.py, rcl.py) holds its paper: losses,
heads, its paper's rows.

    Flags            TrainArgs: the shared flags, each with its source and range
    Data             the training file, tokenised once into integer arrays, batches
    Models           load_encoder, SimCSE's MLP and poolers, fp32 for the losses, make_encode
    STS evaluation   evaluate_sts as SimCSE's SentEval computes it; alignment and uniformity
    The paper's rows PaperRow: the published rows a run's flags reproduce
    Start-up         start: the run folder, every flag and file checked first; the seed
    The loop's parts what an evaluation records: STS-B dev, the final figures
    The step         train_step: forward, backward, clip, AdamW, schedule
    The loop         train: batch, step, log, evaluate, checkpoint; the final report

Under torchrun a loss sees the global batch: gather(x), every rank's rows (plumbing/ranks.py).
A module, not a command: `python tools/eval.py` scores a saved encoder with evaluate_sts. What keeps a
run safe and fast (the run folder and its checkpoints, the checks before a run starts, the report at its
end, downloads, the compiled step, signals) comes from plumbing/, a module for each thing it holds
(plumbing/__init__.py lists them). A reader of the papers need not open them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr

# `x as x`: a name the scripts and tools take from here though common.py itself does not call it
from plumbing import checkpoint, flags, inputs, report
from plumbing import start as starting
from plumbing.command_line import run_main as run_main
from plumbing.compiled_step import compiled_forward
from plumbing.downloads import in_data as in_data
from plumbing.errors import UserError
from plumbing.flags import NOT_TRAINING as NOT_TRAINING
from plumbing.flags import arg
from plumbing.flags import parse_args as parse_args
from plumbing.inputs import default_cache_dir
from plumbing.inputs import encoder_positions as encoder_positions
from plumbing.progress import Meter, progress
from plumbing.ranks import barrier, local_rows, world
from plumbing.ranks import gather as gather
from plumbing.run_folder import RunFolder
from plumbing.sts_data import STS_SUBSETS as STS_SUBSETS
from plumbing.sts_data import STS_TASKS, TASK_SHORT, load_sts_pairs
from plumbing.tokens import Tokens, clip, token_ids, tokenize

# =====================================================================================
# Flags: one @dataclass Args per script becomes argparse flags with help and source
# =====================================================================================

# arg() declares a field: its help, the source of its default, its range. NOT_TRAINING names
# the flags that say where and how a run is written, not what it trains: --resume may change
# them. Both, and the parser they make, are in plumbing/flags.py.


@dataclass
class TrainArgs:
    """The flags every training script shares: unsupervised SimCSE's BERT-base defaults, which
    the other papers start from. A script's `Args(TrainArgs)` adds fields and re-declares any
    whose default it changes."""
    data: str = arg(in_data("wiki1m_for_simcse.txt"), "one sentence a line (downloaded on first use)",
                    "SimCSE paper Sec. 3")
    model: str = arg("bert-base-uncased", "hub name or local folder of the encoder", "SimCSE paper Sec. 3")
    output_dir: str = arg("", "run folder: args.json, metrics.jsonl, best/, last/ (default: runs/<script>/"
                          "<the flags that differ from their defaults>, e.g. runs/focal_infonce/m0.2; "
                          "runs/<script>/default with none)")
    max_steps: int = arg(0, "stop after this many steps (0 = run all epochs)", ge=0)
    epochs: int = arg(1, "passes over the data (0 only with --max_steps)", "SimCSE paper App. A", ge=0)
    batch_size: int = arg(64, "sentences per step (global, over all GPUs)", "SimCSE paper App. A", ge=1)
    max_len: int = arg(32, "tokens per training sentence, at most the encoder's positions",
                       "SimCSE official code", ge=1)
    lr: float = arg(3e-5, "peak learning rate, decayed linearly to 0", "SimCSE paper App. A", gt=0)
    seed: int = arg(42, "seed for python, numpy and torch", "SimCSE official code", ge=0)
    eval_every: int = arg(125, "steps between STS-B dev evaluations (the best is kept in best/)",
                          "SimCSE official code", ge=1)
    sts_dir: str = arg(in_data("sts"), "SentEval's STS/ and SICK/ folders (downloaded on first use)")
    eval_untrained: bool = arg(False, "also evaluate the untrained --model on the 7 tasks at the end and "
                               "print its row beside the run's; it does not change training")
    resume: bool = arg(False, "continue the run in --output_dir from its last checkpoint")
    weight_decay: float = arg(0.0, "AdamW weight decay", "SimCSE official code", ge=0)
    max_grad_norm: float = arg(1.0, "gradient-norm clip (0 = none)", "SimCSE official code", ge=0)
    log_every: int = arg(10, "steps between metrics.jsonl lines", ge=1)
    cache_dir: str = arg("", "where tokenised data is cached (default: .cache beside --data)")
    compile: bool = arg(True, "torch.compile the step on CUDA (ignored on CPU)")
    # a script's own paper as the source of shared defaults it states too: {"lr": "paper Tab. 1"}
    SOURCES: ClassVar[dict[str, str]] = {}
    # defaults that replace the ones above when --data is a CSV (supervised SimCSE's)
    CSV_DEFAULTS: ClassVar[dict[str, Any]] = {}
    # a script's own flags that choose no paper row (another data file, say), beside flags.ROW_FREE
    OWN_ROW_FREE: ClassVar[tuple[str, ...]] = ()
    # the flags of files a script trains on beside --data: part of the run's identity, as --data is
    INPUTS: ClassVar[tuple[str, ...]] = ()

    def check(self) -> None:
        """What parse_args (ranges, rules()) leaves of the flags on their own, before any file is
        read: a budget to train. common.start then checks the files and the encoder, and opens the
        run folder (plumbing/start.py)."""
        if self.epochs == 0 and self.max_steps == 0:
            raise UserError("--epochs 0: train at least one epoch, or give --max_steps N to train "
                            "N steps whatever the epochs.")

    def rules(self) -> None:
        """A script's own rules between flags (its Args overrides this), run by parse_args; each
        error names the flag and what to pass instead."""

    def settle(self, data_rows: int) -> None:
        """Flags that depend on the data, settled before args.json is written (RCL's
        --eval_every 0: every 10% of an epoch); a script's Args overrides this."""


# =====================================================================================
# Data: the training file, tokenised once into an integer array; batches
# =====================================================================================

def load_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """{'text': [...]} for a text file (one sentence a line, UTF-8, blank lines skipped), or
    {'sent0', 'sent1'[, 'hard_neg']} for SimCSE's supervised CSV (a header sent0,sent1[,hard_neg];
    incomplete rows skipped). Read once; a problem is named with its line (plumbing/inputs.py)."""
    return inputs.read_columns(path, flag)


# tokenize(tokenizer, texts, max_len, cache_dir) -> Tokens: the texts as one (n, max_len) array of token
# ids, tokenised once and cached for the next run (plumbing/tokens.py); Tokens.batch(rows) cuts a batch


def tokenize_columns(args: Any, tokenizer, columns: dict[str, list[str]],
                     max_len: int | None = None) -> dict[str, Tokens]:
    """Tokenise every column of load_columns() with the encoder's tokenizer (cached)."""
    cache = default_cache_dir(args.data, args.cache_dir)
    return {k: tokenize(tokenizer, v, max_len or args.max_len, cache, desc=f"tokenizing {k}")
            for k, v in columns.items()}


def pad_batch(b: dict[str, torch.Tensor], width: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a batch to `width` columns: input_ids with `pad_id`, the mask and types with 0."""
    return {k: F.pad(v, (0, width - v.shape[1]), value=pad_id if k == "input_ids" else 0)
            for k, v in b.items()}                                         # (N, width) each


def concat_batches(batches: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stack batches along rows, padded to the widest: ONE forward pass through the encoder."""
    width = max(b["input_ids"].shape[1] for b in batches)
    padded = [pad_batch(b, width, pad_id) for b in batches]
    return {k: torch.cat([b[k] for b in padded]) for k in padded[0]}


@functools.lru_cache(maxsize=2)
def batch_plan(n: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """(steps, batch_size) row indices of one epoch: a seeded shuffle. NOTE(ours): the last
    partial batch is dropped, so every step has all its negatives."""
    steps = n // batch_size
    order = np.random.default_rng([seed, epoch]).permutation(n)                # (n,)
    return order[: steps * batch_size].reshape(steps, batch_size)


def device_batch(data: dict[str, Tokens], idx: np.ndarray, pad_to: int | None,
                 device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """The rows `idx` of every column, as tensors on the device (pinned for an async copy)."""
    pin = device.type == "cuda"
    return {k: {kk: (vv.pin_memory() if pin else vv).to(device, non_blocking=True)
                for kk, vv in col.batch(idx, pad_to).items()} for k, col in data.items()}


# =====================================================================================
# Models: the encoder, SimCSE's MLP and poolers, precision, encoding for evaluation
# =====================================================================================

POOLERS = ["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2"]
# encode(sentences, on_batch) -> (n, d) embeddings; on_batch(k) after each k sentences (make_encode)
Encode = Callable[[list[str], Callable[[int], Any]], np.ndarray]


def load_encoder(name: str, dropout: float | None = None, flag: str = "--model"):
    """(tokenizer, encoder) of a hub name or a folder: SDPA attention, fp32 (bf16 comes from
    autocast on a GPU); `dropout` overrides hidden and attention dropout. A hub name that is
    cached while the hub cannot be reached is read from the cache alone (inputs.hub_offline)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the run's own progress bar is the one that matters
    config = inputs.encoder_config(name, flag)  # one line within seconds if it is nowhere to be had
    for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
        if dropout is not None and hasattr(config, k):
            setattr(config, k, dropout)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=True)
        encoder = AutoModel.from_pretrained(name, config=config, attn_implementation="sdpa",
                                            dtype=torch.float32)
    except (OSError, RecursionError) as e:      # RecursionError: a JSON file nested too deeply
        raise inputs.not_loaded(flag, name, e)
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{flag} {name}: no fast tokenizer (tokenizer.json) was found; this project "
                        f"needs one.")
    # BERT's NSP pooler is in no loss (SimCSE's MLP is a module of its own, saved into it for
    # the `cls` pooler): frozen, so that neither AdamW nor DDP waits for its gradient
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler.requires_grad_(False)
    return tokenizer, encoder


class MLP(nn.Module):
    """SimCSE's MLP over [CLS]: Linear(d, d) + Tanh, the shape of BERT's own pooler. Initialised as
    in the official SimCSE and Focal-InfoNCE code, whose cl_init() runs BERT's init_weights() over
    it: weights from N(0, 0.02^2), bias 0 (not PyTorch's default uniform)."""

    def __init__(self, d: int, std: float = 0.02):
        super().__init__()
        self.dense = nn.Linear(d, d)
        nn.init.normal_(self.dense.weight, mean=0.0, std=std)               # BERT's initializer_range
        nn.init.zeros_(self.dense.bias)
        self.activation = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


def mlp_from_pooler(encoder: nn.Module, name: str | Path = "") -> MLP:
    """The `cls` pooler of a saved model: BERT's own pooler layer (dense + tanh) as an MLP."""
    dense = getattr(getattr(encoder, "pooler", None), "dense", None)
    if dense is None:
        raise UserError(f"--pooler cls: {name} has no pooler layer; use cls_before_pooler.")
    mlp = MLP(encoder.config.hidden_size).to(dense.weight.device)
    mlp.dense = dense
    return mlp


def masked_mean(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens the mask keeps: (N, L, d), (N, L) -> (N, d)."""
    m = attention_mask.unsqueeze(-1).to(x.dtype)                            # (N, L, 1)
    return (x * m).sum(1) / m.sum(1).clamp(min=1)                           # (N, d)


def pool(out, attention_mask: torch.Tensor, pooler: str, mlp: nn.Module | None = None) -> torch.Tensor:
    """SimCSE's poolers on an encoder output -> (N, d): cls = [CLS] through the MLP; cls_before_pooler
    = raw [CLS]; avg = masked mean of the last layer; avg_first_last / avg_top2 need hidden states."""
    if pooler == "cls_before_pooler":
        return out.last_hidden_state[:, 0]
    if pooler == "cls":
        if mlp is None:
            raise ValueError("pooler 'cls' needs the MLP")
        return mlp(out.last_hidden_state[:, 0])
    if pooler == "avg":
        return masked_mean(out.last_hidden_state, attention_mask)
    if pooler == "avg_first_last":
        return masked_mean((out.hidden_states[1] + out.hidden_states[-1]) / 2, attention_mask)
    if pooler == "avg_top2":
        return masked_mean((out.hidden_states[-1] + out.hidden_states[-2]) / 2, attention_mask)
    raise ValueError(f"unknown pooler {pooler!r}; one of {POOLERS}")


def autocast(device: torch.device | str):
    """bf16 autocast on CUDA, nothing (fp32) elsewhere."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fp32(fn: Callable) -> Callable:
    """Decorator for the losses: fn runs in fp32 under any autocast, its floating tensor arguments
    (in lists too) cast up to fp32. A bf16 cosine matrix loses about 0.04 in a logit at tau 0.05,
    which no .float() after it restores; the official SimCSE and Focal code compute in fp32."""
    def up(x):
        if isinstance(x, (list, tuple)):
            return type(x)(up(v) for v in x)
        if torch.is_tensor(x) and x.is_floating_point():
            return x.to(torch.promote_types(x.dtype, torch.float32))
        return x

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = up(args), {k: up(v) for k, v in kwargs.items()}
        flat = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])]
        device_type = next((t.device.type for t in flat if torch.is_tensor(t)), "cpu")
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)
    return wrapped


def make_encode(encoder: nn.Module, tokenizer, pooler: str, mlp: nn.Module | None = None,
                batch_size: int = 128) -> Encode:
    """encode(sentences, on_batch) -> (n, d) float32 numpy for evaluation: eval mode, no grad,
    batches of similar length, truncated only to the model's positions (not the training max_len);
    on_batch(k) after each k sentences (a progress bar). fp32 on every device, as SimCSE's
    evaluation.py: under bf16 a run's STS-B dev and the same weights evaluated again (best/,
    `python tools/eval.py`) differed by up to 0.7 on a GPU."""
    hidden = pooler in ("avg_first_last", "avg_top2")
    limit = inputs.max_positions(encoder.config, tokenizer)
    # the same ids as tokenizer(...), a third of the time; each list of sentences once: the dev
    # evaluations encode the same three lists
    encode_batch = token_ids(tokenizer, limit)
    tokenized: dict[tuple[str, ...], list[list[int]]] = {}

    @torch.inference_mode()
    def encode(sentences: list[str], on_batch: Callable[[int], Any] = lambda k: None) -> np.ndarray:
        modules = [m for m in (encoder, mlp) if m is not None]
        was_training = encoder.training
        for m in modules:
            m.eval()
        device = next(encoder.parameters()).device
        key = tuple(sentences)
        if key not in tokenized:
            if len(tokenized) >= 8:
                tokenized.clear()
            tokenized[key] = [e.ids for e in encode_batch(clip(sentences, limit))]
        ids = tokenized[key]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(sentences), encoder.config.hidden_size), np.float32)   # (n, d)
        for s in range(0, len(order), batch_size):
            rows = order[s:s + batch_size]
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt").to(device)
            with torch.autocast(device.type, enabled=False):      # fp32, inside a bf16 step's autocast too
                o = encoder(**batch, output_hidden_states=hidden)
                out[rows] = pool(o, batch["attention_mask"], pooler, mlp).float().cpu().numpy()  # (B, d)
            on_batch(len(rows))
        for m in modules:
            m.train(was_training)
        return out

    return encode


# =====================================================================================
# STS evaluation, as SimCSE's fork of SentEval computes it
# =====================================================================================

# SentEval's tasks, their subsets and their pairs as its readers parse them (load_sts_pairs: a pair
# without a gold score dropped, a sentence's whitespace normalised) are plumbing/sts_data.py's


def evaluating(desc: str, total: int):
    """The bar of an evaluation over its `total` sentences: rank 0's only, drawn once it has run a
    second (a short one draws none), erased when done (its figures are printed after it)."""
    return progress(total, desc, "sent", disable=world()[0] != 0, leave=False, delay=1.0)


def cosine_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Row-wise cosine; a zero vector gives 0, never NaN (SentEval's NaN -> 0)."""
    u, v = u.astype(np.float64), v.astype(np.float64)
    den = np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1)
    return np.where(den > 0, (u * v).sum(1) / np.where(den > 0, den, 1), 0.0)


def _spearman(sims: np.ndarray, gold: np.ndarray) -> float:
    r = spearmanr(sims, gold)[0]
    return 0.0 if np.isnan(r) else float(r) * 100


def evaluate_sts(encode: Encode, data_dir: str | Path,
                 tasks: list[str] | None = None, split: str = "test", desc: str = "evaluating") -> dict:
    """Spearman x100 of cosine similarity, as SimCSE's SentEval computes it. split="test": the 7
    tasks, STS12-16 reporting "all" (one Spearman over a task's pairs concatenated; per subset,
    their mean and weighted mean beside); "dev": STS-B dev and SICK-R trial. res["avg"]: the
    mean of the reported figures. A task's distinct sentences are encoded once, apart from the
    other tasks: its figure is the same whichever tasks are evaluated with it. encode(sentences,
    on_batch) as make_encode's. An evaluation longer than a second shows a bar on stderr, `desc`
    and the task, then each task's figure."""
    inputs.check_sts_dir(data_dir)
    if tasks is None:
        tasks = STS_TASKS if split == "test" else ["STSBenchmark", "SICKRelatedness"]
    loaded = {t: load_sts_pairs(data_dir, t, split) for t in tasks}
    uniq = {t: sorted({s for a, b, _ in subs.values() for s in a + b}) for t, subs in loaded.items()}
    res: dict[str, Any] = {}
    with evaluating(desc, sum(map(len, uniq.values()))) as bar:
        for k, (t, subs) in enumerate(loaded.items()):
            bar.set_description(f"{desc}: {TASK_SHORT[t]} {split} ({k + 1}/{len(tasks)})", refresh=False)
            emb = encode(uniq[t], bar.update)                               # (U, d)
            row = {s: i for i, s in enumerate(uniq[t])}
            sims = {name: cosine_rows(emb[[row[s] for s in a]], emb[[row[s] for s in b]])
                    for name, (a, b, _) in subs.items()}
            per = {name: {"spearman": _spearman(sims[name], gold), "n": len(gold)}
                   for name, (_, _, gold) in subs.items()}
            n = sum(p["n"] for p in per.values())
            gold = np.concatenate([g for _, _, g in subs.values()])
            res[t] = {"spearman": _spearman(np.concatenate(list(sims.values())), gold), "n": n}
            if t in STS_SUBSETS:
                res[t].update(subsets=per, mean=float(np.mean([p["spearman"] for p in per.values()])),
                              wmean=float(sum(p["spearman"] * p["n"] for p in per.values()) / n))
            bar.set_postfix_str(f"{TASK_SHORT[t]} {res[t]['spearman']:.2f}", refresh=False)
    res["avg"] = float(np.mean([res[t]["spearman"] for t in tasks]))
    return res


def alignment_uniformity(encode: Encode, data_dir: str | Path, split: str = "test",
                         desc: str = "evaluating") -> dict[str, float]:
    """Wang & Isola (2020), as SimCSE reports them, on STS-B (lower is better for both): alignment
    = mean ||f(x)-f(x+)||^2 over pairs with gold > 4; uniformity = log mean exp(-2||f(x)-f(y)||^2)
    over all distinct pairs of sentences; f normalised. NOTE(ours): the test split, Focal-InfoNCE
    Tab. 3's (its SpCorr column is Tab. 2's STS-B test figure); SimCSE names no split."""
    a, b, gold = load_sts_pairs(data_dir, "STSBenchmark", split)[split]
    sents = sorted(set(a) | set(b))
    with evaluating(f"{desc}: alignment and uniformity, STS-B {split}", len(sents)) as bar:
        f = F.normalize(torch.from_numpy(encode(sents, bar.update)).double(), dim=-1)  # (U, d)
    row = {s: i for i, s in enumerate(sents)}
    fa = f[[row[s] for s, g in zip(a, gold) if g > 4]]                      # (P, d)
    fb = f[[row[s] for s, g in zip(b, gold) if g > 4]]                      # (P, d)
    align = (fa - fb).norm(dim=1).pow(2).mean()                             # ()
    unif = torch.pdist(f).pow(2).mul(-2).exp().mean().log()                 # () over U(U-1)/2 pairs
    return {"alignment": float(align), "uniformity": float(unif)}


def saved_encoder(model: str | Path, pooler: str, batch_size: int = 128) -> Encode:
    """make_encode() of an encoder as saved (a hub name or a folder), read off with `pooler`."""
    tokenizer, encoder = load_encoder(str(model))
    encoder.to("cuda" if torch.cuda.is_available() else "cpu")
    mlp = mlp_from_pooler(encoder, model) if pooler == "cls" else None
    return make_encode(encoder, tokenizer, pooler, mlp, batch_size)


def evaluate_encoder(model: str, pooler: str, sts_dir: str | Path, tasks: list[str] | None = None,
                     split: str = "test", batch_size: int = 128, desc: str = "evaluating") -> dict:
    """evaluate_sts of an encoder as saved (hub name or folder), read off with `pooler`."""
    encode = saved_encoder(model, pooler, batch_size)
    return evaluate_sts(encode, sts_dir, tasks=tasks, split=split, desc=desc)


# =====================================================================================
# The paper's rows: the published figures a run's flags reproduce, printed beside its own
# =====================================================================================

# Which rows a run's flags reproduce is a matter of the flags: select_rows, in plumbing/flags.py
# (the script's default model stands in for one the paper did not train; ROW_FREE: the flags no
# row depends on, the budget and the data)
FIGURE_KEYS = (*STS_TASKS, "avg", "alignment", "uniformity")


@dataclass(frozen=True)
class PaperRow:
    """One row of a table of a method's paper, as data: the flags that reproduce it and the
    figures it published. A run ends by printing the rows its flags select beside its own."""
    table: str                           # "Tab. 2"
    name: str                            # the row as the paper names it: "SimCSE-BERT_base"
    figures: dict[str, float]            # keys of FIGURE_KEYS: {"STS12": 68.4, ..., "avg": 76.25}
    split: str = "test"                  # test: STS test sets (or all of STS-B test); dev: STS-B dev
    flags: dict[str, Any] = field(default_factory=dict)   # values that make the row, where not default
    model: str = ""                      # the encoder the paper trained ("": the script's --model default)
    data: str = ""                       # "": any text file; else the file name of the CSV it needs
    note: str = ""                       # printed with it: "a mean over seeds", "our reading: ..."

    @property
    def label(self) -> str:
        return f"{self.table} {self.name}"

    def headline(self) -> list[float]:
        """What a list of rows shows of this one (the docs' tables): the 7-task average if given."""
        return [self.figures["avg"]] if "avg" in self.figures else list(self.figures.values())


# =====================================================================================
# Start-up: every flag and file checked before anything is written
# =====================================================================================

def start(args: TrainArgs, models: dict[str, tuple[str, str]] | None = None) -> RunFolder:
    """Before a script loads a model (plumbing/start.py): torchrun's process group; every flag, then every
    file checked before anything is written (`models`: a script's own, {flag: (name, one more way out)});
    the run folder held, its record written. Then the seed. Returns the run folder, handed down to
    train(), with the device this process trains on (run.device). A --resume of a run that had finished
    shows its figures and stops."""
    run = starting.start(args, models, saved_figures)
    seed_everything(args.seed)
    return run


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# =====================================================================================
# The loop's parts: what an evaluation records
# =====================================================================================

# a log line's means since the last one are Meter's (plumbing/progress.py): kept on the device, read
# once a line, so that the log costs the step no wait for the GPU


def dev_figures(encode: Encode, sts_dir: str | Path,
                desc: str = "evaluating") -> dict[str, float]:
    """What the log records at an evaluation: STS-B dev (which chooses best/), SICK-R trial, their
    mean, and alignment and uniformity on STS-B test (Focal Tab. 3; against each other, SimCSE's
    Fig. 2: tools/compare.py --plot). `desc` labels its progress bar."""
    dev = evaluate_sts(encode, sts_dir, split="dev", desc=desc)
    return {"stsb_dev": dev["STSBenchmark"]["spearman"], "sickr_dev": dev["SICKRelatedness"]["spearman"],
            "avg_dev": dev["avg"], **alignment_uniformity(encode, sts_dir, desc=desc)}


def final_figures(encode: Encode, sts_dir: str | Path, desc: str) -> dict:
    """What the end of a run records: the 7 STS tasks, and alignment and uniformity on STS-B test
    (from the embeddings of STS-B test's sentences that the 7 tasks computed: the same list in the
    same batches, so the same figures as encoding them again)."""
    encode = remembered(encode)
    return {**evaluate_sts(encode, sts_dir, desc=desc), **alignment_uniformity(encode, sts_dir, desc=desc)}


def saved_figures(model: str | Path, pooler: str, sts_dir: str | Path, desc: str) -> dict:
    """final_figures of an encoder as saved (best/ at the end of a run, the untrained --model), read off
    with `pooler`: what plumbing/report.py prints and keeps."""
    return final_figures(saved_encoder(model, pooler), sts_dir, desc)


def remembered(encode: Encode) -> Encode:
    """`encode` that computes each list of sentences once: asked again, the same array."""
    done: dict[tuple[str, ...], np.ndarray] = {}

    def again(sentences: list[str], on_batch: Callable[[int], Any] = lambda k: None) -> np.ndarray:
        key = tuple(sentences)
        if key in done:
            on_batch(len(sentences))
        else:
            done[key] = encode(sentences, on_batch)
        return done[key]
    return again


# =====================================================================================
# The step: forward, backward, clip, AdamW, schedule, in nanoGPT's order
# =====================================================================================

def make_optimizer(params: list, lr: float, weight_decay: float, total: int, device: torch.device):
    """(AdamW, its schedule): on CUDA the fused AdamW kernel (one pass over weights, gradients
    and both moments); the learning rate decays linearly from its peak to 0 over `total`
    steps, no warm-up (SimCSE's HF Trainer default)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))


def train_step(model: Callable, batch: dict, opt, sched, max_grad_norm: float, device: torch.device,
               world_size: int = 1, amp: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step. model(batch) returns the loss, or (loss, {name: 0-dim tensor}) for
    the log; `model` may be the module's compiled form (CompiledModel, on a GPU). Returns
    detached copies of both."""
    with autocast(device) if amp else contextlib.nullcontext():
        out = model(batch)                                  # forward, in bf16 on a GPU
    loss, stats = out if isinstance(out, tuple) else (out, {})
    # under DDP every rank computes the same global loss (gather keeps the gradient of its own
    # rows only) and DDP averages the gradients: times world_size gives one process's gradient
    (loss * world_size).backward()
    if max_grad_norm > 0:
        params = [p for group in opt.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    opt.step()                                              # AdamW
    sched.step()                                            # linear decay
    opt.zero_grad(set_to_none=True)
    # copies: the next replay of a CUDA graph overwrites its outputs
    return loss.detach().float().clone(), {k: v.detach().float().clone() for k, v in stats.items()}


# =====================================================================================
# The loop: batch, step, log, evaluate, checkpoint; at the end the 7 STS tasks
# =====================================================================================

def train(args: TrainArgs, run: RunFolder, model: nn.Module, data: dict[str, Tokens], tokenizer, pooler: str,
          paper_rows: list[PaperRow] = (), should_stop: Callable[[int, torch.Tensor], bool] | None = None,
          final_eval: bool = True) -> dict:
    """Train `model` into `run` (start's run folder, or a stage of it), keeping the best model.encoder
    (+ model.mlp for the `cls` pooler) by STS-B dev; at the end the 7 tasks, beside the `paper_rows`
    that the flags select. model(batch) -> loss or (loss, {name: 0-dim tensor} to log), with batch =
    {column: {"input_ids", "attention_mask"}}. should_stop(step, loss), asked after every step (rcl.py's
    early stop; it keeps its own state, which a checkpoint keeps), ends training when it returns True;
    the run is evaluated and checkpointed at that step. What a checkpoint keeps, which model is best and
    when to stop are decided here; plumbing/checkpoint.py only writes and reads them."""
    rank, world_size = world()
    device = next(model.parameters()).device
    mlp = model.mlp if pooler == "cls" else None
    encode = make_encode(model.encoder, tokenizer, pooler, mlp)
    n = len(next(iter(data.values())))
    steps_per_epoch = n // args.batch_size
    total = steps_per_epoch * args.epochs
    if args.max_steps and (total == 0 or args.max_steps < total):    # --epochs 0: --max_steps alone
        total = args.max_steps
    model.train()       # from_pretrained() hands the encoder back in eval mode: dropout would be off
    opt, sched = make_optimizer([p for p in model.parameters() if p.requires_grad], args.lr,
                                args.weight_decay, total, device)
    forward = compiled_forward(model, device, args.compile, world_size)  # DDP; compiled on a GPU
    # on a GPU every batch has the compiled step's static shape, compiled or not: --compile, which
    # --resume may change, then changes no number; the CPU pads to the batch's longest sentence
    pad_to = args.max_len if device.type == "cuda" else None
    saved = (model.encoder, tokenizer, pooler, mlp)                 # what best/ keeps
    step, dev, best, best_step, stopped = 0, None, -math.inf, 0, False      # the loop's state
    if args.resume and (last := checkpoint.load_last(run)) is not None:    # verified, data only
        for part, state in ((model, last.model), (opt, last.opt), (sched, last.sched)):
            part.load_state_dict(state)
        if hasattr(should_stop, "load_state_dict"):      # rcl.py's EarlyStop
            should_stop.load_state_dict(last.should_stop)
        torch.set_rng_state(last.rng_cpu)
        if torch.cuda.is_available() and last.rng_cuda is not None:
            torch.cuda.set_rng_state(last.rng_cuda)
        step, dev, best, best_step = last.step, last.dev, last.best, last.best_step
        stopped = last.stopped_early
        checkpoint.resumed(run, last, saved)     # best/ checked (or saved again); the log cut back to last/'s
    meter = Meter(device)
    with progress(total, flags.script_name(args), "step", disable=rank != 0, initial=step) as bar:
        while step < total and not stopped:
            epoch, b = divmod(step, steps_per_epoch)
            idx = batch_plan(n, args.batch_size, args.seed, epoch)[b]      # the global batch's rows
            batch = device_batch(data, local_rows(idx), pad_to, device)   # this rank's share of them
            loss, stats = train_step(forward, batch, opt, sched, args.max_grad_norm, device, world_size)
            step += 1
            meter.add(loss, stats)
            bar.update(1)
            stopped = should_stop is not None and should_stop(step, loss)  # rcl.py's early stop
            evaluate_now = step % args.eval_every == 0 or step == total or stopped
            if step % args.log_every == 0 or evaluate_now:
                if not meter.finite():
                    raise run.nan_error(step, best_step)
                record = meter.record(step, float(sched.get_last_lr()[0]), epoch, args.batch_size)
                run.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                sent_s=f"{record['sent_per_s']:.0f}")
            if evaluate_now and rank == 0:                  # rank 0 evaluates; last/, best/ if the best
                dev = {"step": step, **dev_figures(encode, args.sts_dir, f"step {step}, evaluating")}
                best, best_step = (dev["stsb_dev"], step) if dev["stsb_dev"] > best else (best, best_step)
                dev["best_stsb_dev"] = best
                run.write(dev)
                checkpoint.save_last(run, checkpoint.Checkpoint(   # what last/ keeps: all to go on from here
                    model=model.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(), step=step,
                    dev=dev, best=best, best_step=best_step, stopped_early=stopped,
                    rng_cpu=torch.get_rng_state(),
                    rng_cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                    should_stop=should_stop.state_dict() if hasattr(should_stop, "state_dict") else None))
                if best_step == step:
                    checkpoint.save_best(run, dev, saved)
                bar.write(f"step {step}: STS-B dev {dev['stsb_dev']:.2f}  SICK-R dev "
                          f"{dev['sickr_dev']:.2f}  (best {best:.2f} at step {best_step})", file=sys.stderr)
            if evaluate_now:
                barrier()                                   # every rank waits for rank 0's checkpoint
    result = {"best_dev": best, "best_step": best_step, "steps": step, "total": total, "test": None,
              "stopped_early": stopped and step < total, "last_dev": (dev or {}).get("stsb_dev")}
    if final_eval and rank == 0:                        # best/ shown to be this run's before it loads
        best_dir = checkpoint.verified_best(run, best_step, best)
        result["test"] = report.final(best_dir, args, pooler, paper_rows, saved_figures)
        checkpoint.drop_last(run)                       # finished: last/ only served to continue it
    barrier()
    return result
