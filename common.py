"""What every method script shares, in the order a training run meets it, for a reader of the
papers; a script (simcse.py, focal_infonce.py, ifcl.py, conisi.py, rcl.py) holds its paper: losses,
heads, its paper's rows.

    Flags            TrainArgs: the shared flags, each with its source and range
    Data             the training file, tokenised once into integer arrays, batches
    Models           load_encoder, SimCSE's MLP and poolers, fp32 for the losses, make_encode
    STS evaluation   evaluate_sts as SimCSE's SentEval computes it; alignment and uniformity
    The paper's rows PaperRow, paper_report: the published rows a run's flags reproduce
    Distributed      gather: under torchrun every loss sees the global batch
    Start-up         start: every flag and file checked before anything is written
    The loop's parts the seed, the log's running means, what an evaluation records
    The step         train_step: forward, backward, clip, AdamW, schedule
    The loop         train: batch, step, log, evaluate, checkpoint; the final report

A module, not a command: `python tools/eval.py` scores a saved encoder with evaluate_sts, and
`python tools/download.py` fetches SimCSE's data. What keeps a run safe and fast comes from
plumbing/, a module for each thing it holds: flags (argparse from the Args dataclasses; which
paper rows a run's flags reproduce, select_rows), inputs (the files a run is given, checked; the
token cache), kept_rows (the untrained row, evaluated once), downloads (SimCSE's data on first
use), run_folder (the lock, the run's record and identity, how a checkpoint is written and read
back, stages), atomic_writes, export (a folder transformers and sentence-transformers load),
compiled_step (torch.compile, CUDA graphs, DDP; length-sorted sub-batches on a CPU), ranks,
progress (bars), errors (the one-line errors), command_line (exit statuses), interrupts (signals,
from a script's first line to its last) and translation (IFCL's German file). A reader of the
papers need not open them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr

# `x as x`: a name the scripts and tools take from here though common.py itself does not call it
from plumbing import downloads, export, flags, inputs, kept_rows
from plumbing.command_line import run_main as run_main
from plumbing.compiled_step import compiled_forward
from plumbing.downloads import in_data as in_data
from plumbing.errors import NothingToDo, UserError
from plumbing.flags import NOT_TRAINING as NOT_TRAINING
from plumbing.flags import arg, select_rows
from plumbing.flags import parse_args as parse_args
from plumbing.inputs import default_cache_dir, encoder_positions, read_sentences
from plumbing.progress import progress
from plumbing.ranks import barrier, world
from plumbing.run_folder import RunFolder, write_json

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
        read: a budget to train. common.start then checks the files and the encoder, and names the
        run folder (RunFolder.named)."""
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
    if str(path).lower().endswith(".csv"):
        return dict(inputs.read_csv_columns(path, flag))
    return {"text": read_sentences(path, flag)}


def data_rows(path: str | Path) -> int:
    """Examples in --data: its sentences, or its CSV rows."""
    return len(next(iter(load_columns(path).values())))


@dataclass
class Tokens:
    """Token ids of n sentences, right-padded to max_len in one compact integer array."""
    ids: np.ndarray      # (n, max_len) uint16 or int32
    lengths: np.ndarray  # (n,) int32, tokens per sentence (specials included)
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx: np.ndarray, pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask of rows `idx`, padded to the longest or to `pad_to`."""
        width = pad_to or int(self.lengths[idx].max())
        ids = torch.from_numpy(self.ids[idx, :width].astype(np.int64))      # (B, L)
        mask = torch.arange(width)[None, :] < torch.from_numpy(self.lengths[idx].astype(np.int64))[:, None]
        return {"input_ids": ids, "attention_mask": mask.long()}           # (B, L), (B, L)


# A token covers a few characters: a line is cut to CHARS_PER_TOKEN characters a token the model
# keeps before it is tokenised, so that one huge line costs no more memory than a long one. What is
# kept is the same unless a line's tokens average more than that many characters.
CHARS_PER_TOKEN = 64


def clip(texts: list[str], tokens: int) -> list[str]:
    return [t[:CHARS_PER_TOKEN * tokens] for t in texts]


def token_ids(tokenizer, max_len: int) -> Callable[[list[str]], list]:
    """encode_batch(texts) -> encodings (.ids), cut at max_len, unpadded: the Rust tokenizer (a copy)
    directly, on both cores, without the offsets and dicts that cost a third of the time at 1M lines."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_len)
    backend.no_padding()
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


def tokenize(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None = None,
             desc: str = "tokenizing") -> Tokens:
    """Tokenise once, before training, into a (n, max_len) array, kept in `cache_dir` for the
    next run on the same texts and tokenizer."""
    cache = inputs.token_cache(tokenizer, texts, max_len, cache_dir)
    if (kept := inputs.load_tokens(cache)) is not None:
        return Tokens(*kept)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((len(texts), max_len), pad_id, dtype=np.uint16 if len(tokenizer) < 65536 else np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    encode_batch = token_ids(tokenizer, max_len)
    with progress(total=len(texts), desc=desc, unit="sent", disable=len(texts) < 50000) as bar:
        for s in range(0, len(texts), 20000):
            for j, e in enumerate(encode_batch(clip(texts[s:s + 20000], max_len)), start=s):
                ids[j, :len(e.ids)], lengths[j] = e.ids, len(e.ids)
            bar.update(min(20000, len(texts) - s))
    inputs.save_tokens(cache, ids, lengths, pad_id)
    return Tokens(ids, lengths, pad_id)


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

STS_TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]


STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}


TASK_SHORT = {"STS12": "STS12", "STS13": "STS13", "STS14": "STS14", "STS15": "STS15",
              "STS16": "STS16", "STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}


def _norm(s: str) -> str:
    # SentEval splits on whitespace and joins again: the files are already tokenised, and a
    # sentence is neither lowercased nor cut to the training max_len (only, as clip() does, to what
    # no encoder's positions reach: one huge line costs no more memory than a long one)
    return " ".join(s[:CHARS_PER_TOKEN * 4096].split())


def load_sts_pairs(data_dir: str | Path, task: str, split: str = "test") -> dict[str, tuple]:
    """{subset: (sent1 list, sent2 list, gold array)} of one task, as SentEval's readers parse it."""
    d = Path(data_dir)
    if task in STS_SUBSETS:
        out = {}
        for sub in STS_SUBSETS[task]:
            inp, gs = (d / "STS" / f"STS{task[3:]}-en-test" / f"STS.{k}.{sub}.txt" for k in ("input", "gs"))
            pairs = [line.split("\t") for line in inp.read_text(encoding="utf-8").splitlines()]
            gold = gs.read_text(encoding="utf-8").splitlines()
            if len(pairs) != len(gold) or any(len(p) != 2 for p in pairs):
                raise UserError(f"{inp}: expected one tab-separated pair per gold line of {gs}")
            # a pair whose gold line is empty is dropped (STS13-16 leave some pairs unscored)
            keep = [i for i, g in enumerate(gold) if g != ""]
            out[sub] = ([_norm(pairs[i][0]) for i in keep], [_norm(pairs[i][1]) for i in keep],
                        np.array([float(gold[i]) for i in keep]))
        return out
    if task == "STSBenchmark":   # no header; gold in column 4, the sentences in columns 5 and 6
        path, skip, cols = d / "STS" / "STSBenchmark" / f"sts-{split}.csv", 0, (5, 6, 4)
    elif task == "SICKRelatedness":   # a header; the sentences in columns 1 and 2, gold in column 3
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        path, skip, cols = d / "SICK" / name, 1, (1, 2, 3)
    else:
        raise ValueError(f"unknown STS task {task!r}; one of {STS_TASKS}")
    rows = [line.strip().split("\t") for line in path.read_text(encoding="utf-8").splitlines()[skip:]]
    a, b, g = cols
    return {split: ([_norm(r[a]) for r in rows], [_norm(r[b]) for r in rows],
                    np.array([float(r[g]) for r in rows]))}


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


def format_sts_table(res: dict, others: list[tuple[str, dict]] = (), name: str = "this run") -> str:
    """The STS table of a result, other rows (label, {task: figure}) beside it ('-': none given)."""
    tasks = [t for t in STS_TASKS if t in res]
    rows = [(name, {**{t: res[t]["spearman"] for t in tasks}, "avg": res["avg"]}), *others]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{'':{width}s}" + "".join(f"{TASK_SHORT[t]:>8s}" for t in tasks) + f"{'Avg.':>8s}"]
    for label, figures in rows:
        cells = [f"{figures[t]:8.2f}" if t in figures else f"{'-':>8s}" for t in tasks + ["avg"]]
        lines.append(f"{label:{width}s}" + "".join(cells))
    lines.append("Spearman x100 of cosine similarity; STS12-16 report 'all' (one correlation over "
                 "each task's pairs); STS-B and SICK-R their test sets, unless the dev split is asked for.")
    return "\n".join(lines)


STS_PAIR_COUNTS = {  # kept pairs a subset (STS12-16) or a split (train, dev, test), asserted by check_sts
    "STS12": [750, 750, 459, 750, 399], "STS13": [189, 750, 561], "STS14": [450, 300, 750, 750, 750, 750],
    "STS15": [375, 750, 375, 750, 750], "STS16": [254, 249, 230, 244, 209],
    "STSBenchmark": [5749, 1500, 1379], "SICKRelatedness": [4500, 500, 4927]}


def check_sts(folder: Path) -> None:
    """The STS data are whole when every task parses to SentEval's kept pair counts."""
    for task in STS_TASKS:
        splits = ["test"] if task in STS_SUBSETS else ["train", "dev", "test"]
        try:
            got = [len(g) for split in splits for _, _, g in load_sts_pairs(folder, task, split).values()]
        except (OSError, ValueError, IndexError, UserError) as e:
            raise UserError(f"STS data in {folder}: {task} cannot be read ({e}): the download is "
                            f"incomplete or corrupted. {downloads.NOT_KEPT}")
        if got != STS_PAIR_COUNTS[task]:
            raise UserError(f"STS data in {folder}: {task} has {got} pairs, expected "
                            f"{STS_PAIR_COUNTS[task]}: the download is incomplete or corrupted. "
                            f"{downloads.NOT_KEPT}")


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


def paper_report(res: dict, picked: list[tuple[str, PaperRow]], note: str, dev_best: float | None,
                 untrained: dict | None = None) -> str:
    """The end of a run: the note; the 7 STS tasks beside the untrained encoder's (a result of
    final_figures with its "label", if given) and the rows on test sets; alignment and uniformity
    (STS-B test) and STS-B dev (best), each beside the rows that give them."""
    lines = [f"note: {note}"] if note else []
    sts_rows = [(label, r.figures) for label, r in picked if r.split == "test"
                and set(r.figures) - {"alignment", "uniformity"}]
    if untrained:       # the row a run starts from, first under the run's
        figures = {t: untrained[t]["spearman"] for t in STS_TASKS if t in untrained}
        sts_rows.insert(0, (untrained["label"], {**figures, "avg": untrained["avg"]}))
    lines.append(format_sts_table(res, sts_rows))
    if untrained and untrained.get("kept_in"):
        how = ("kept from an earlier run of the same weights, pooler, STS data and evaluation code:"
               if untrained.get("reused") else "evaluated now, kept for the next run of this model in")
        lines.append(f"({untrained['label']}: {how} {untrained['kept_in']})")
    if "alignment" in res:
        beside = [f"; {label}: {r.figures['alignment']:.3f} / {r.figures['uniformity']:.3f}"
                  for label, r in picked if r.split == "test" and "alignment" in r.figures]
        if untrained:
            beside.insert(0, f"; {untrained['label']}: {untrained['alignment']:.3f} / "
                             f"{untrained['uniformity']:.3f}")
        lines.append(f"alignment / uniformity on STS-B test (lower is better): this run "
                     f"{res['alignment']:.3f} / {res['uniformity']:.3f}" + "".join(beside))
    beside = [f"; {label}: {r.figures['STSBenchmark']:.2f}" for label, r in picked if r.split == "dev"]
    if beside and dev_best is not None:
        lines.append(f"STS-B dev: this run {dev_best:.2f} (the best evaluation, kept in best/)"
                     + "".join(beside))
    lines += [f"({label}: {r.note})" for label, r in picked if r.note]
    return "\n".join(lines)


# =====================================================================================
# Distributed (torchrun): every loss sees the global batch
# =====================================================================================

def init_distributed() -> torch.device:
    """Start the process group under torchrun (NCCL on CUDA, gloo on CPU) and pick the device:
    one GPU a process, so more processes on a machine than its GPUs is refused first."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus and local_world > gpus:
        if int(os.environ.get("LOCAL_RANK", "0")) > 0:
            raise SystemExit(2)                     # the same refusal, said once, by local rank 0
        raise UserError(f"torchrun --nproc_per_node {local_world}: this machine has {gpus} GPU"
                        f"{'s' if gpus > 1 else ''} visible, and each process trains on one. Pass "
                        f"--nproc_per_node {gpus} (the batch is split over them; --batch_size stays "
                        f"global).")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if gpus else "gloo")
    if gpus:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def local_rows(rows: np.ndarray) -> np.ndarray:
    """This rank's share of a global batch's row indices (all of them in one process)."""
    rank, n = world()
    k = len(rows) // n
    return rows[rank * k:(rank + 1) * k]


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out, 0)

    @staticmethod
    def backward(ctx, grad):
        # only the local shard's gradient flows back; each rank computes the same global
        # loss, so summing (not averaging) over ranks gives the one-process gradient
        return grad.chunk(dist.get_world_size(), 0)[dist.get_rank()].contiguous()


def gather(x: torch.Tensor) -> torch.Tensor:
    """(n_local, ...) -> (n_local * world, ...): every rank's rows in rank order, the gradient kept
    for this rank's; identity in one process. Gather every tensor a loss uses."""
    return x if world()[1] == 1 else _GatherWithGrad.apply(x)


# =====================================================================================
# Start-up: every flag and file checked before anything is written
# =====================================================================================

def start(args: TrainArgs, models: dict[str, tuple[str, str]] | None = None) -> torch.device:
    """Before a script loads a model: torchrun's process group; every flag, then every file checked
    before anything is written (the default data downloaded on first use; offline, whatever cannot
    be had named at once: the data, --model and a script's own `models`, {flag: (name, one more way
    out)}); the flags that depend on the data settled; the seed; the run folder, held, with its
    record (args.json, run.json, code/), and named on stderr. A --resume of a run that had finished
    shows its figures and stops."""
    device = init_distributed()
    args.check()                                    # the flags on their own
    run = RunFolder.named(args)                     # --output_dir, or the default for these flags and code
    if world()[0] == 0:     # the default data into data/ on first use, else what is missing named at once
        downloads.missing_pieces(args.data, args.sts_dir, check_sts,
                                 {"--model": (args.model, ""), **(models or {})})
    barrier()
    # a missing, empty or non-UTF-8 --data stops here (with the line), then too small a one
    rows = data_rows(args.data)
    inputs.check_batch(rows, args.batch_size, args.data, world()[1])
    inputs.check_sts_dir(args.sts_dir)
    check_sts_files(args.sts_dir)
    inputs.check_model_folder(args.model)           # a local folder's files whole (weights, JSON)
    positions = encoder_positions(args.model)
    if args.max_len > positions:
        raise UserError(f"--max_len {args.max_len}: {args.model} has {positions} positions. "
                        f"Pass --max_len {positions} or less.")
    args.settle(rows)
    seed_everything(args.seed)
    run.open()              # held by this process; its record written, or --resume held to it
    if world()[0] == 0:     # the default folder's name is long: where the run goes, said once
        what = ("--resume: the run goes on there from its last checkpoint" if args.resume else
                "the flags in args.json, the log in metrics.jsonl; last/ at each evaluation, best/ at "
                "the best STS-B dev")
        print(f"run folder: {args.output_dir} ({what})", file=sys.stderr)
    if args.resume and (figures := run.finished()) is not None:
        run.drop_last()     # a kill between its figures and this left it: a finished run cannot continue
        report_finished(args, run, figures)
    return device


def check_sts_files(sts_dir: str | Path) -> None:
    """Every STS file a run reads (the dev sets at each evaluation, the 7 test sets at the end),
    read now: a missing or damaged one is named before anything is written."""
    dev = [("STSBenchmark", "dev"), ("SICKRelatedness", "dev")]
    for task, split in [(t, "test") for t in STS_TASKS] + dev:
        try:
            load_sts_pairs(sts_dir, task, split)
        except (OSError, ValueError, IndexError) as e:      # UnicodeDecodeError is a ValueError
            raise UserError(f"--sts_dir {sts_dir}: {task} ({split}) cannot be read ({e}). Pass the folder "
                            f"of SentEval's STS data (`python tools/download.py --what sts` makes data/sts).")


# =====================================================================================
# The loop's parts: the seed, the log's running means, what an evaluation records
# =====================================================================================

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class Meter:
    """The log's running sums, kept on the device (read once a log line: the only wait): loss and
    terms since the last log line, and whether any loss was NaN or infinite."""

    def __init__(self, device: torch.device):
        self.zero = torch.zeros((), device=device)
        self.bad = self.zero.bool()
        self.loss = self.zero
        self.steps = 0
        self.stats = {}
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        self.bad |= ~torch.isfinite(loss)
        self.loss = self.loss + loss
        self.steps += 1
        self.stats = {k: self.stats.get(k, 0) + v for k, v in stats.items()}

    def finite(self) -> bool:
        return not bool(self.bad)

    def record(self, step: int, lr: float, epoch: int, batch_size: int) -> dict:
        """The training record of metrics.jsonl: means since the last one; then starts again."""
        seconds = time.perf_counter() - self.t0
        record = {"step": step, "loss": float(self.loss) / self.steps, "lr": lr, "epoch": epoch,
                  "sent_per_s": batch_size * self.steps / seconds if seconds > 0 else 0.0,
                  **{k: float(v) / self.steps for k, v in self.stats.items()}}
        self.loss, self.steps, self.stats, self.t0 = self.zero, 0, {}, time.perf_counter()
        return record


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

def train(args: TrainArgs, model: nn.Module, data: dict[str, Tokens], tokenizer, pooler: str,
          paper_rows: list[PaperRow] = (), should_stop: Callable[[int, torch.Tensor], bool] | None = None,
          final_eval: bool = True) -> dict:
    """Train `model` into --output_dir, keeping the best model.encoder (+ model.mlp for the `cls`
    pooler) by STS-B dev; at the end the 7 tasks, beside the `paper_rows` that the flags select.
    model(batch) -> loss or (loss, {name: 0-dim tensor} to log), with batch = {column:
    {"input_ids", "attention_mask"}}. should_stop(step, loss), asked after every step (rcl.py's
    early stop; it keeps its own state, which a checkpoint keeps), ends training when it returns
    True; the run is evaluated and checkpointed at that step. What a checkpoint keeps, which
    model is best and when to stop are decided here; RunFolder only writes and reads them."""
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
    run, saved = RunFolder.of(args), (model.encoder, tokenizer, pooler, mlp)
    step, dev, best, best_step, stopped = 0, None, -math.inf, 0, False      # the loop's state
    parts = {"model": model, "opt": opt, "sched": sched, "should_stop": should_stop}  # what last/ keeps
    if args.resume and (ckpt := run.load_last()) is not None:     # this run's last/: verified, data only
        with run.restoring():                                      # a state that does not fit: one line
            for name, part in parts.items():
                if hasattr(part, "load_state_dict"):               # should_stop: rcl.py's EarlyStop
                    part.load_state_dict(ckpt[name])
            torch.set_rng_state(ckpt["rng_cpu"])
            if torch.cuda.is_available() and ckpt.get("rng_cuda") is not None:
                torch.cuda.set_rng_state(ckpt["rng_cuda"])
            step, dev, best, best_step, stopped = (ckpt[k] for k in ("step", "dev", "best", "best_step",
                                                                     "stopped_early"))
        run.resumed(ckpt, saved)           # best/ checked (or saved again); the log cut back to last/'s
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
                run.save_last({**{k: v.state_dict() for k, v in parts.items() if hasattr(v, "state_dict")},
                               "step": step, "dev": dev, "best": best, "best_step": best_step,
                               "stopped_early": stopped, "rng_cpu": torch.get_rng_state(),
                               "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                               "run": run.identity})
                if best_step == step:
                    run.save_best(dev, saved)
                bar.write(f"step {step}: STS-B dev {dev['stsb_dev']:.2f}  SICK-R dev "
                          f"{dev['sickr_dev']:.2f}  (best {best:.2f} at step {best_step})", file=sys.stderr)
            if evaluate_now:
                barrier()                                   # every rank waits for rank 0's checkpoint
    result = {"best_dev": best, "best_step": best_step, "steps": step, "total": total, "test": None,
              "stopped_early": stopped and step < total, "last_dev": (dev or {}).get("stsb_dev")}
    if final_eval and rank == 0:                        # best/ shown to be this run's before it loads
        result["test"] = final_report(run.verified_best(best_step, best), args, pooler, paper_rows)
        run.drop_last()                                 # finished: last/ only served to continue it
    barrier()
    return result


def final_report(best_dir: Path, args: TrainArgs, pooler: str, paper_rows: list[PaperRow]) -> dict:
    """Reload the best checkpoint as a user would, evaluate the 7 STS tasks and alignment and
    uniformity (with --eval_untrained, the untrained --model too, read off with the same pooler),
    print them beside the paper's rows that the flags select, keep all of it (with the pooler:
    tools/compare.py labels the run with it) in best/test_metrics.json; then say what to run next."""
    res = final_figures(saved_encoder(best_dir, pooler), args.sts_dir, "final evaluation of best/")
    picked, note = select_rows(args, list(paper_rows))
    rows = [{"label": label, **dataclasses.asdict(r)} for label, r in picked]
    kept = {**res, "pooler": pooler, "paper_rows": rows, "paper_note": note}
    if args.eval_untrained:
        kept["untrained"] = untrained_figures(args, pooler)
    report(best_dir, args, kept)
    return res


def untrained_figures(args: TrainArgs, pooler: str) -> dict:
    """final_figures of the untrained --model, read off with the run's pooler, labelled; kept (plumbing/
    kept_rows.py) for every later run of the same weights, pooler, STS data and evaluation code, which reads
    it back: "kept_in" says where, "reused" whether it was read back."""
    # NOTE(ours): `cls` reads [CLS] through the encoder's own pretrained pooler layer (BERT's NSP
    # dense + tanh), as tools/eval.py and compare.py --baseline do: the run's MLP started from a
    # random draw, a seed's rather than the encoder's
    name = Path(args.model).name or args.model
    label = f"untrained {name} [{'cls: its pretrained pooler' if pooler == 'cls' else pooler}]"
    row = {"label": label, "model": args.model, "pooler": pooler}
    pairs = {t: {k: (a, b, g.tolist()) for k, (a, b, g) in load_sts_pairs(args.sts_dir, t).items()}
             for t in STS_TASKS}
    made_of = kept_rows.key(args.model, pooler, pairs)
    path = kept_rows.where(made_of, args.sts_dir, args.cache_dir) if made_of else None
    if path and (figures := kept_rows.read(path, made_of, STS_TASKS)) is not None:
        return {**row, **figures, "kept_in": str(path), "reused": True}
    figures = final_figures(saved_encoder(args.model, pooler), args.sts_dir, f"untrained {name}")
    if path and kept_rows.write(path, made_of, figures):
        return {**row, **figures, "kept_in": str(path), "reused": False}
    return {**row, **figures}


def report(best_dir: Path, args: TrainArgs, kept: dict, write: bool = True) -> None:
    """Print a run's final figures (`kept`: best/test_metrics.json) beside its paper rows and the
    untrained encoder's, keep them, and say what to run next."""
    picked = [(r["label"], PaperRow(**{k: v for k, v in r.items() if k != "label"}))
              for r in kept["paper_rows"]]
    dev = json.loads((best_dir / "dev_metrics.json").read_text()).get("stsb_dev")
    print(paper_report(kept, picked, kept["paper_note"], dev, kept.get("untrained")))
    if write:
        write_json(best_dir / "test_metrics.json", kept)
    print(export.what_next(best_dir, args.model, kept["pooler"], args.sts_dir), file=sys.stderr)


def report_finished(args: TrainArgs, run: RunFolder, kept: dict) -> None:
    """--resume of a run that had finished: nothing to train. Its figures again, as kept (with
    --eval_untrained, the untrained encoder's beside them, evaluated now), then stop."""
    if world()[0] == 0:
        new = args.eval_untrained and "untrained" not in kept
        if new:
            kept["untrained"] = untrained_figures(args, kept["pooler"])
        report(run.out / "best", args, kept, write=new)
    raise NothingToDo(f"{run.out} had finished: nothing to train; the figures above are the ones it kept in "
                      f"{run.out / 'best' / 'test_metrics.json'}.")
