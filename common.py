"""What every method script shares, in the order a training run meets it; a script (simcse.py,
focal_infonce.py, ifcl.py, conisi.py, rcl.py) holds its paper: losses, heads, its paper's rows.

    Flags            arg(), TrainArgs: the shared flags, each with its source and range
    Data             the training file, tokenised once into integer arrays, batches
    Models           load_encoder, SimCSE's MLP and poolers, fp32 for the losses, make_encode
    STS evaluation   evaluate_sts as SimCSE's SentEval computes it; alignment and uniformity
    The paper's rows PaperRow, select_rows: the published rows a run's flags reproduce
    Distributed      gather: under torchrun every loss sees the global batch
    The step         train_step: forward, backward, clip, AdamW, schedule
    The loop         train: batch, step, log, evaluate, checkpoint; the final report
Below the `Infrastructure` banner (a reader may stop there): downloads, input checks, the run
folder (lock, the run's record, checkpoint and resume), the export, the compiled step, and the
command line (python common.py eval | download). tools/ holds compare.py, bench.py, translate.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import errno
import functools
import hashlib
import io
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import time
import typing
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from tqdm.auto import tqdm  # comes with transformers

try:
    import fcntl  # POSIX: the run-folder lock (hold_run_folder)
except ImportError:                    # Windows
    fcntl = None


class UserError(Exception):
    """A problem with the user's input (a file, a flag): printed as one clear message."""


def progress(total: int | None, desc: str, unit: str = "it", disable: bool = False, initial: int = 0):
    """The progress bar of every long loop (tokenising, downloading, training, translating)."""
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable,
                dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


# =====================================================================================
# Flags: one @dataclass Args per script becomes argparse flags with help and source
# =====================================================================================

def arg(default: Any, help: str, source: str = "ours", choices: list | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, note: str = "", positional: bool = False) -> Any:
    """A dataclass field: its help, where its default comes from (paper Tab. N, paper Sec. N,
    official code, ours), its range (ge >=, gt >, le <=, lt <; each element of a list) and a
    `note` for a range error (the values the paper used). `positional`: compare's bare words."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt}
    meta = {"help": help, "source": source, "choices": choices, "note": note, "positional": positional,
            "range": {k: v for k, v in bounds.items() if v is not None}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# Flags that say where and how a run is written and shown, not what it trains: --resume may
# change them, the default run folder's name leaves them out, compare.py ignores them
NOT_TRAINING = ("output_dir", "resume", "log_every", "sts_dir", "cache_dir", "compile")


@dataclass
class TrainArgs:
    """The flags every training script shares: unsupervised SimCSE's BERT-base defaults, which
    the other papers start from. A script's `Args(TrainArgs)` adds fields and re-declares any
    whose default it changes."""
    data: str = arg("data/wiki1m_for_simcse.txt", "one sentence a line (downloaded on first use)",
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
    sts_dir: str = arg("data/sts", "SentEval's STS/ and SICK/ folders (downloaded on first use)")
    resume: bool = arg(False, "continue the run in --output_dir from its last checkpoint")
    weight_decay: float = arg(0.0, "AdamW weight decay", "SimCSE official code", ge=0)
    max_grad_norm: float = arg(1.0, "gradient-norm clip (0 = none)", "SimCSE official code", ge=0)
    log_every: int = arg(10, "steps between metrics.jsonl lines", ge=1)
    cache_dir: str = arg("", "where tokenised data is cached (default: .cache beside --data)")
    compile: bool = arg(True, "torch.compile the step on CUDA (ignored on CPU)")
    # a script's own paper as the source of shared defaults it states too: {"lr": "paper Tab. 1"}
    sources: ClassVar[dict[str, str]] = {}
    # defaults that replace the ones above when --data is a CSV (supervised SimCSE's)
    csv_defaults: ClassVar[dict[str, Any]] = {}
    # a script's flags that choose no paper row (another data file, say): select_rows
    row_free: ClassVar[tuple[str, ...]] = ()

    def check(self) -> None:
        """The flags on their own, before any file is read: ranges, the default --output_dir,
        then rules() between flags. common.start then checks the files and the encoder."""
        check_ranges(self)
        if not self.output_dir:
            self.output_dir = default_output_dir(self)
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise UserError(f"--output_dir {self.output_dir}: is a file; it must be a folder (the run "
                            f"folder). Pass a new folder's path, or that of a run to --resume.")
        if self.epochs == 0 and self.max_steps == 0:
            raise UserError("--epochs 0: train at least one epoch, or give --max_steps N to train "
                            "N steps whatever the epochs.")
        self.rules()

    def rules(self) -> None:
        """A script's own rules between flags (its Args overrides this); each error names the
        flag and what to pass instead."""

    def settle(self, data_rows: int) -> None:
        """Flags that depend on the data, settled before args.json is written (RCL's
        --eval_every 0: every 10% of an epoch); a script's Args overrides this."""


# =====================================================================================
# Data: the training file, tokenised once into an integer array; batches
# =====================================================================================

def read_once(read: Callable) -> Callable:
    """Decorator for a reader read(path, flag): the checks and then training read a file, which is
    read once while unchanged (size and mtime); callers must not change what it returns."""
    @functools.lru_cache(maxsize=2)
    def cached(path: str, flag: str, stamp: tuple | None):
        return read(path, flag)

    @functools.wraps(read)
    def wrapped(path: str | Path, flag: str = "--data"):
        stat = Path(path).stat() if Path(path).is_file() else None
        return cached(str(path), flag, stat and (stat.st_mtime_ns, stat.st_size))
    return wrapped


@read_once
def read_sentences(path: str | Path, flag: str = "--data") -> list[str]:
    """One sentence per line, UTF-8; blank lines are skipped and counted."""
    sents = [s.strip() for s in _read_text(Path(path), flag, "a text file with one sentence per line",
                                           "SimCSE's wiki1m").splitlines()]
    kept = [s for s in sents if s]
    if not kept:
        raise UserError(f"{flag} {path}: the file has no sentences (it is empty or blank).")
    if len(kept) < len(sents):
        print(f"note: {path}: skipped {len(sents) - len(kept)} blank lines of {len(sents)}", file=sys.stderr)
    return kept


@read_once
def read_csv_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """SimCSE's supervised CSV: a header sent0,sent1[,hard_neg]; incomplete rows skipped, counted."""
    rows = list(csv.reader(io.StringIO(_read_text(Path(path), flag, "a CSV with columns sent0,sent1"
                                                  "[,hard_neg]", "SimCSE's NLI triplets"))))
    header = [h.strip() for h in rows[0]] if rows else []
    if header[:2] != ["sent0", "sent1"] or header[2:] not in ([], ["hard_neg"]):
        raise UserError(f"{flag} {path}: the header is {','.join(header)!r}; expected "
                        f"'sent0,sent1' or 'sent0,sent1,hard_neg' (SimCSE's NLI format).")
    kept = [cells for cells in ([c.strip() for c in r] for r in rows[1:])
            if len(cells) == len(header) and all(cells)]
    if not kept:
        raise UserError(f"{flag} {path}: no complete rows under the header.")
    if len(kept) < len(rows) - 1:
        print(f"note: {path}: skipped {len(rows) - 1 - len(kept)} incomplete rows", file=sys.stderr)
    return {h: [cells[j] for cells in kept] for j, h in enumerate(header)}


def load_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """{'text': [...]} for a text file, {'sent0','sent1'[,'hard_neg']} for a CSV."""
    if str(path).lower().endswith(".csv"):
        return dict(read_csv_columns(path, flag))
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


def tokenize(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None = None,
             desc: str = "tokenizing", out: str | Path | None = None) -> Tokens:
    """Tokenise once, before training, into a (n, max_len) array, cached in `cache_dir`; `out`: the
    run folder, for the message if the cache cannot be written."""
    cache = token_cache(tokenizer, texts, max_len, cache_dir)
    if cache is not None and cache.is_file():
        z = np.load(cache)
        return Tokens(z["ids"], z["lengths"], int(z["pad_id"]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((len(texts), max_len), pad_id, dtype=np.uint16 if len(tokenizer) < 65536 else np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    # the Rust tokenizer directly (a copy, so the caller's settings stay as they are): both
    # cores, and no offsets or Python-side dicts, which cost a third of the time at 1M lines
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_len)
    backend.no_padding()
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    bar = progress(total=len(texts), desc=desc, unit="sent", disable=len(texts) < 50000)
    for s in range(0, len(texts), 20000):
        for j, e in enumerate(encode_batch(texts[s:s + 20000]), start=s):
            ids[j, :len(e.ids)], lengths[j] = e.ids, len(e.ids)
        bar.update(min(20000, len(texts) - s))
    bar.close()
    if cache is not None:
        kept = checkpoint_kept(out) if out is not None else "no run folder was changed"
        with writing(f"the token cache {cache}", kept):
            cache.parent.mkdir(parents=True, exist_ok=True)
            # a name of this process's own: under torchrun every rank tokenises and writes
            tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.tmp.npz")
            np.savez(tmp, ids=ids, lengths=lengths, pad_id=pad_id)
            os.replace(tmp, cache)
    return Tokens(ids, lengths, pad_id)


def tokenize_columns(args: Any, tokenizer, columns: dict[str, list[str]],
                     max_len: int | None = None) -> dict[str, Tokens]:
    """Tokenise every column of load_columns() with the encoder's tokenizer (cached)."""
    cache = default_cache_dir(args.data, args.cache_dir)
    return {k: tokenize(tokenizer, v, max_len or args.max_len, cache, desc=f"tokenizing {k}",
                        out=args.output_dir)
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


def load_encoder(name: str, dropout: float | None = None, flag: str = "--model"):
    """(tokenizer, encoder) of a hub name or a folder: SDPA attention, fp32 (bf16 comes from
    autocast on a GPU); `dropout` overrides hidden and attention dropout."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the run's own progress bar is the one that matters
    config = encoder_config(name, flag)
    for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
        if dropout is not None and hasattr(config, k):
            setattr(config, k, dropout)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=True)
        encoder = AutoModel.from_pretrained(name, config=config, attn_implementation="sdpa",
                                            dtype=torch.float32)
    except OSError as e:
        raise not_loaded(flag, name, e)
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{flag} {name}: no fast tokenizer (tokenizer.json) was found; this project "
                        f"needs one.")
    # BERT's NSP pooler is in no loss (SimCSE's MLP is a module of its own, saved into it for
    # the `cls` pooler): frozen, so that neither AdamW nor DDP waits for its gradient
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler.requires_grad_(False)
    return tokenizer, encoder


class MLP(nn.Module):
    """SimCSE's MLP over [CLS]: Linear(d, d) + Tanh, the shape of BERT's own pooler."""

    def __init__(self, d: int):
        super().__init__()
        self.dense = nn.Linear(d, d)
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
                batch_size: int = 128) -> Callable[[list[str]], np.ndarray]:
    """encode(sentences) -> (n, d) float32 numpy for evaluation: eval mode, no grad, batches of
    similar length, truncated only to the model's positions (not the training max_len). fp32 on
    every device, as SimCSE's evaluation.py: under bf16 a run's STS-B dev and the same weights
    evaluated again (best/, `python common.py eval`) differed by up to 0.7 on a GPU."""
    hidden = pooler in ("avg_first_last", "avg_top2")

    @torch.no_grad()
    def encode(sentences: list[str]) -> np.ndarray:
        modules = [m for m in (encoder, mlp) if m is not None]
        was_training = encoder.training
        for m in modules:
            m.eval()
        device = next(encoder.parameters()).device
        ids = tokenizer(list(sentences), truncation=True, max_length=max_positions(encoder.config, tokenizer),
                        return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(sentences), encoder.config.hidden_size), np.float32)   # (n, d)
        for s in range(0, len(order), batch_size):
            rows = order[s:s + batch_size]
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt").to(device)
            with torch.autocast(device.type, enabled=False):      # fp32, inside a bf16 step's autocast too
                o = encoder(**batch, output_hidden_states=hidden)
                out[rows] = pool(o, batch["attention_mask"], pooler, mlp).float().cpu().numpy()  # (B, d)
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
    # sentence is neither lowercased nor cut to the training max_len
    return " ".join(s.split())


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


def cosine_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Row-wise cosine; a zero vector gives 0, never NaN (SentEval's NaN -> 0)."""
    u, v = u.astype(np.float64), v.astype(np.float64)
    den = np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1)
    return np.where(den > 0, (u * v).sum(1) / np.where(den > 0, den, 1), 0.0)


def _spearman(sims: np.ndarray, gold: np.ndarray) -> float:
    r = spearmanr(sims, gold)[0]
    return 0.0 if np.isnan(r) else float(r) * 100


def evaluate_sts(encode: Callable[[list[str]], np.ndarray], data_dir: str | Path,
                 tasks: list[str] | None = None, split: str = "test") -> dict:
    """Spearman x100 of cosine similarity, as SimCSE's SentEval computes it. split="test": the 7
    tasks, STS12-16 reporting "all" (one Spearman over a task's pairs concatenated; per subset,
    their mean and weighted mean beside); "dev": STS-B dev and SICK-R trial. res["avg"]: the
    mean of the reported figures. A task's distinct sentences are encoded once, apart from the
    other tasks: its figure is the same whichever tasks are evaluated with it."""
    check_sts_dir(data_dir)
    if tasks is None:
        tasks = STS_TASKS if split == "test" else ["STSBenchmark", "SICKRelatedness"]
    loaded = {t: load_sts_pairs(data_dir, t, split) for t in tasks}
    res: dict[str, Any] = {}
    for t, subs in loaded.items():
        uniq = sorted({s for a, b, _ in subs.values() for s in a + b})
        emb = encode(uniq)                                                  # (U, d)
        row = {s: i for i, s in enumerate(uniq)}
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
    res["avg"] = float(np.mean([res[t]["spearman"] for t in tasks]))
    return res


def alignment_uniformity(encode: Callable[[list[str]], np.ndarray], data_dir: str | Path,
                         split: str = "test") -> dict[str, float]:
    """Wang & Isola (2020), as SimCSE reports them, on STS-B (lower is better for both): alignment
    = mean ||f(x)-f(x+)||^2 over pairs with gold > 4; uniformity = log mean exp(-2||f(x)-f(y)||^2)
    over all distinct pairs of sentences; f normalised. NOTE(ours): the test split, Focal-InfoNCE
    Tab. 3's (its SpCorr column is Tab. 2's STS-B test figure); SimCSE names no split."""
    a, b, gold = load_sts_pairs(data_dir, "STSBenchmark", split)[split]
    sents = sorted(set(a) | set(b))
    f = F.normalize(torch.from_numpy(encode(sents)).double(), dim=-1)      # (U, d)
    row = {s: i for i, s in enumerate(sents)}
    fa = f[[row[s] for s, g in zip(a, gold) if g > 4]]                      # (P, d)
    fb = f[[row[s] for s, g in zip(b, gold) if g > 4]]                      # (P, d)
    align = (fa - fb).norm(dim=1).pow(2).mean()                             # ()
    unif = torch.pdist(f).pow(2).mul(-2).exp().mean().log()                 # () over U(U-1)/2 pairs
    return {"alignment": float(align), "uniformity": float(unif)}


def saved_encoder(model: str | Path, pooler: str, batch_size: int = 128) -> Callable[[list[str]], np.ndarray]:
    """make_encode() of an encoder as saved (a hub name or a folder), read off with `pooler`."""
    tokenizer, encoder = load_encoder(str(model))
    encoder.to("cuda" if torch.cuda.is_available() else "cpu")
    mlp = mlp_from_pooler(encoder, model) if pooler == "cls" else None
    return make_encode(encoder, tokenizer, pooler, mlp, batch_size)


def evaluate_encoder(model: str, pooler: str, sts_dir: str | Path, tasks: list[str] | None = None,
                     split: str = "test", batch_size: int = 128) -> dict:
    """evaluate_sts of an encoder as saved (hub name or folder), read off with `pooler`."""
    return evaluate_sts(saved_encoder(model, pooler, batch_size), sts_dir, tasks=tasks, split=split)


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


# =====================================================================================
# The paper's rows: the published figures a run's flags reproduce, printed beside its own
# =====================================================================================

# Flags no row depends on: the budget and the data, so that a short run, or one on other
# sentences, still shows its rows (a row that needs a CSV names it: PaperRow.data)
ROW_FREE = ("data", "seed", "max_steps", "epochs", "eval_every")
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


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def select_rows(args: TrainArgs, rows: list[PaperRow]) -> tuple[list[tuple[str, PaperRow]], str]:
    """The rows `args` reproduces, each with its label, and a note ("" if none is needed). A row
    matches when its model and data are the run's and every flag that changes training (all but
    NOT_TRAINING, ROW_FREE and the script's row_free) has the row's value, or the default where
    the row names none. A model the paper did not train (a testbed encoder, a local folder) is
    compared as the script's default model, its rows so labelled. No match: the note says so."""
    defaults = defaults_of(args)
    free = {*NOT_TRAINING, *ROW_FREE, *type(args).row_free, "model"}

    def name_of(model: str) -> str:   # FacebookAI/roberta-base and roberta-base are one model
        return Path(model.rstrip("/")).name.lower()

    stand_in = name_of(args.model) not in {name_of(r.model or defaults.model) for r in rows}
    model = name_of(defaults.model if stand_in else args.model)
    csv_name = Path(args.data).name if str(args.data).lower().endswith(".csv") else ""
    picked = []
    for r in rows:
        same_flags = all(_same(getattr(args, f.name), r.flags.get(f.name, getattr(defaults, f.name)))
                         for f in dataclasses.fields(args) if f.name not in free)
        if name_of(r.model or defaults.model) == model and r.data == csv_name and same_flags:
            picked.append((r.label + (f" [paper: {r.model or defaults.model}]" if stand_in else ""), r))
    if picked:
        note = ""
        if stand_in:
            note = (f"{args.model} is not a model the paper trained: the rows below are the paper's "
                    f"{defaults.model}, a reference rather than a target")
        return picked, note
    named = [flag_text(k, v) for k, v in changed_flags(args, tuple(free)).items()]
    if model != name_of(defaults.model):
        named.insert(0, f"--model {args.model}")
    kinds = {r.data for r in rows}                   # "": text files; else the CSVs the rows need
    if csv_name not in kinds or (csv_name and "" in kinds):   # data no row has, or a script's other form
        named.insert(0, f"--data {Path(args.data).name}")
    return [], f"the paper reports no row for {' '.join(named) or 'these flags'}"


def paper_report(res: dict, picked: list[tuple[str, PaperRow]], note: str, dev_best: float | None) -> str:
    """The end of a run: the note; the 7 STS tasks beside the rows on test sets; alignment and
    uniformity (STS-B test) and STS-B dev (best), each beside the rows that give them."""
    lines = [f"note: {note}"] if note else []
    sts_rows = [(label, r.figures) for label, r in picked if r.split == "test"
                and set(r.figures) - {"alignment", "uniformity"}]
    lines.append(format_sts_table(res, sts_rows))
    if "alignment" in res:
        beside = [f"; {label}: {r.figures['alignment']:.3f} / {r.figures['uniformity']:.3f}"
                  for label, r in picked if r.split == "test" and "alignment" in r.figures]
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

def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def barrier() -> None:
    """Wait for every rank under torchrun; nothing in one process."""
    if world()[1] > 1:
        dist.barrier()


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


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP over `model`. Every trainable parameter gets a gradient every step (load_encoder freezes
    BERT's NSP pooler), so DDP need not search for unused ones; the torchrun tests run each script."""
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


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
    terms since the last log line, loss since should_stop's last call, any NaN or inf."""

    def __init__(self, device: torch.device, since_check: list | None = None):
        self.zero = torch.zeros((), device=device)
        self.bad = self.zero.bool()
        self.loss = self.zero
        self.steps = 0
        self.stats = {}
        self.t0 = time.perf_counter()
        # as last/ kept it: a resume between two calls gives the next call an uninterrupted run's mean
        self.since_check = self.zero + (since_check or [0.0, 0])[0]
        self.steps_since_check = (since_check or [0.0, 0])[1]

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        self.bad |= ~torch.isfinite(loss)
        self.loss = self.loss + loss
        self.since_check = self.since_check + loss
        self.steps += 1
        self.steps_since_check += 1
        self.stats = {k: self.stats.get(k, 0) + v for k, v in stats.items()}

    def record(self, step: int, lr: float, epoch: int, batch_size: int) -> dict:
        """The training record of metrics.jsonl: means since the last one; then starts again."""
        seconds = time.perf_counter() - self.t0
        record = {"step": step, "loss": float(self.loss) / self.steps, "lr": lr, "epoch": epoch,
                  "sent_per_s": batch_size * self.steps / seconds if seconds > 0 else 0.0,
                  **{k: float(v) / self.steps for k, v in self.stats.items()}}
        self.loss, self.steps, self.stats, self.t0 = self.zero, 0, {}, time.perf_counter()
        return record

    def loss_since_check(self) -> float:
        mean = float(self.since_check) / self.steps_since_check
        self.since_check, self.steps_since_check = self.zero, 0
        return mean


def dev_figures(encode: Callable[[list[str]], np.ndarray], sts_dir: str | Path) -> dict[str, float]:
    """What the log records at an evaluation: STS-B dev (which chooses best/), SICK-R trial, their
    mean, and alignment and uniformity on STS-B test (Focal Tab. 3; against each other, SimCSE's
    Fig. 2: tools/compare.py --plot)."""
    dev = evaluate_sts(encode, sts_dir, split="dev")
    return {"stsb_dev": dev["STSBenchmark"]["spearman"], "sickr_dev": dev["SICKRelatedness"]["spearman"],
            "avg_dev": dev["avg"], **alignment_uniformity(encode, sts_dir)}


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
          paper_rows: list[PaperRow] = (), should_stop: Callable[[int, float], bool] | None = None,
          final_eval: bool = True) -> dict:
    """Train `model` into --output_dir, keeping the best model.encoder (+ model.mlp for the `cls`
    pooler) by STS-B dev; at the end the 7 tasks, beside the `paper_rows` that the flags select.
    model(batch) -> loss or (loss, {name: 0-dim tensor} to log), with batch = {column:
    {"input_ids", "attention_mask"}}. should_stop(step, mean loss since its last call), called
    every should_stop.every steps (default: at evaluations), ends training when it returns
    True; the run is evaluated and checkpointed at that step."""
    out = Path(args.output_dir)
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
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(params, args.lr, args.weight_decay, total, device)
    net = wrap_ddp(model, device) if world_size > 1 else model
    compiled = args.compile and device.type == "cuda"
    forward = CompiledModel(net, device, world_size) if compiled else net
    # on a GPU every batch has the compiled step's static shape, compiled or not: --compile, which
    # --resume may change, then changes no number; the CPU pads to the batch's longest sentence
    pad_to = args.max_len if device.type == "cuda" else None
    run = RunFolder(args, out, {"model": model, "opt": opt, "sched": sched, "should_stop": should_stop},
                    (model.encoder, tokenizer, pooler, mlp))
    resumed = run.resume() if args.resume else {}
    step = resumed.get("step", 0)
    stopped = "early" if resumed.get("stopped_early") else None
    meter = Meter(device, resumed.get("since_check"))
    bar = progress(total, script_name(args), "step", disable=rank != 0, initial=step)
    check_every = getattr(should_stop, "every", args.eval_every)
    while step < total and stopped is None:
        epoch, b = divmod(step, steps_per_epoch)
        idx = batch_plan(n, args.batch_size, args.seed, epoch)[b]      # the global batch's rows
        batch = device_batch(data, local_rows(idx), pad_to, device)   # this rank's share of them
        loss, stats = train_step(forward, batch, opt, sched, args.max_grad_norm, device, world_size)
        step += 1
        meter.add(loss, stats)
        bar.update(1)
        at_check = step % check_every == 0 or step == total
        if should_stop is not None and at_check and should_stop(step, meter.loss_since_check()):
            stopped = "early"
        evaluate_now = step % args.eval_every == 0 or step == total or stopped == "early"
        if step % args.log_every == 0 or evaluate_now:
            if bool(meter.bad):
                stopped = "nan"
                break
            record = meter.record(step, float(sched.get_last_lr()[0]), epoch, args.batch_size)
            run.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                            sent_s=f"{record['sent_per_s']:.0f}")
        if evaluate_now and rank == 0:
            figures = dev_figures(encode, args.sts_dir)
            loop = {"stopped_early": stopped == "early",
                    "since_check": [float(meter.since_check), meter.steps_since_check]}
            run.checkpoint(step, figures, loop)                       # last/, and best/ if the best
            tqdm.write(f"step {step}: STS-B dev {figures['stsb_dev']:.2f}  SICK-R dev "
                       f"{figures['sickr_dev']:.2f}  (best {run.best:.2f} at step {run.best_step})",
                       file=sys.stderr)
        if evaluate_now:
            barrier()
    bar.close()
    if stopped == "nan":
        kept = f"is kept in {out / 'best'}" if run.best_step else "was not saved yet"
        raise UserError(f"the loss became NaN or infinite by step {step}. Training stopped; the best "
                        f"checkpoint so far {kept}. Try a lower --lr, or check the data for degenerate "
                        f"lines.")
    result = {"best_dev": run.best, "best_step": run.best_step, "steps": step, "total": total,
              "stopped_early": stopped == "early" and step < total,
              "last_dev": (run.last or {}).get("stsb_dev"), "test": None}
    if final_eval and rank == 0:
        result["test"] = final_report(out / "best", args, pooler, paper_rows)
    barrier()
    return result


def final_report(best_dir: Path, args: TrainArgs, pooler: str, paper_rows: list[PaperRow]) -> dict:
    """Reload the best checkpoint as a user would, evaluate the 7 STS tasks and alignment and
    uniformity, print them beside the paper's rows that the flags select, and keep all of it
    (with the pooler: tools/compare.py labels the run with it) in best/test_metrics.json."""
    encode = saved_encoder(best_dir, pooler)
    res = evaluate_sts(encode, args.sts_dir)
    res.update(alignment_uniformity(encode, args.sts_dir))
    picked, note = select_rows(args, list(paper_rows))
    dev = json.loads((best_dir / "dev_metrics.json").read_text()).get("stsb_dev")
    print(paper_report(res, picked, note, dev))
    rows = [{"label": label, **dataclasses.asdict(r)} for label, r in picked]
    kept = {**res, "pooler": pooler, "paper_rows": rows, "paper_note": note}
    with writing(str(best_dir / "test_metrics.json"), checkpoint_kept(best_dir.parent)):
        write_text_atomic(best_dir / "test_metrics.json", json.dumps(kept, indent=2))
    return res


# #####################################################################################
# Infrastructure: what keeps runs safe and fast. A reader of the papers may stop here.
#   downloads and their checks; input checks; the run folder (lock, atomic writes, the run's
#   record, checkpoint and resume, failed writes); the sentence-transformers export; the
#   compiled step; the command line.
# #####################################################################################

# -------------------------------------------------------------------------------------
# Downloads: SimCSE's files into data/ (on first use, or `python common.py download`), each
# proven whole by its content before it is kept
# -------------------------------------------------------------------------------------

DATA_DIR = Path("data")
UPSTREAM = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"
WIKI1M, NLI, SENTEVAL = "wiki1m_for_simcse.txt", "nli_for_simcse.csv", "senteval.tar"
WIKI1M_LINES = 1_000_000  # SimCSE's wiki1m: the papers' "10^6 sentences"
RETRY = "Run `python common.py download` again."
STS_PAIR_COUNTS = {  # kept pairs a subset (STS12-16) or a split (train, dev, test), asserted by check_sts
    "STS12": [750, 750, 459, 750, 399], "STS13": [189, 750, 561], "STS14": [450, 300, 750, 750, 750, 750],
    "STS15": [375, 750, 375, 750, 750], "STS16": [254, 249, 230, 244, 209],
    "STSBenchmark": [5749, 1500, 1379], "SICKRelatedness": [4500, 500, 4927]}


def fetch(url: str, dest: Path) -> None:
    """Stream `url` into `dest` with a progress bar."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
            bar = progress(total=int(r.headers.get("Content-Length") or 0) or None,
                           desc=dest.name.split(".part")[0], unit="B")
            while chunk := r.read(1 << 20):
                bar.update(f.write(chunk))
            bar.close()
    except OSError as e:
        raise UserError(f"could not download {url}: {e}. Check the network; or fetch the data once with "
                        f"`python common.py download` (--base_url names a mirror).")


def check_download(path: Path, name: str, wiki1m_lines: int | None = None) -> None:
    """No checksum of SimCSE's files could be verified, so each is proven whole by its content:
    wiki1m by its 1,000,000 lines; the NLI file by its header and three cells a row."""
    if name == WIKI1M:
        lines = count_lines(path)
        expected = wiki1m_lines or WIKI1M_LINES
        if lines != expected:
            raise UserError(f"{name}: {lines} lines where {expected} were expected: the download "
                            f"is incomplete or corrupted. {RETRY}")
        return
    try:
        with open(path, encoding="utf-8", errors="strict", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            if ",".join(header) != "sent0,sent1,hard_neg":
                raise UserError(f"{name}: header {','.join(header)!r}, expected 'sent0,sent1,hard_neg': "
                                f"the download is corrupted. {RETRY}")
            for i, row in enumerate(rows, start=2):
                if len(row) != 3:
                    raise UserError(f"{name}: row {i} has {len(row)} cells, expected 3: the download "
                                    f"is incomplete. {RETRY}")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 ({e.reason}): the download is corrupted. {RETRY}")


def download_file(dest: Path, name: str, base_url: str = UPSTREAM, wiki1m_lines: int | None = None) -> Path:
    """wiki1m or the NLI triplets into `dest`, unless already there: written under a temporary
    name and renamed only after its content check passes."""
    final = dest / name
    part = dest / f"{name}.part"
    if final.exists():
        print(f"{final}: present, not fetched again", file=sys.stderr)
        return final
    dest.mkdir(parents=True, exist_ok=True)
    fetch(f"{base_url.rstrip('/')}/{name}", part)
    try:
        check_download(part, name, wiki1m_lines)
    except UserError:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, final)
    return final


def check_sts(folder: Path) -> None:
    """The STS data are whole when every task parses to SentEval's kept pair counts."""
    for task in STS_TASKS:
        splits = ["test"] if task in STS_SUBSETS else ["train", "dev", "test"]
        try:
            got = [len(g) for split in splits for _, _, g in load_sts_pairs(folder, task, split).values()]
        except (OSError, ValueError, IndexError, UserError) as e:
            raise UserError(f"STS data in {folder}: {task} cannot be read ({e}): the download is "
                            f"incomplete or corrupted. {RETRY}")
        if got != STS_PAIR_COUNTS[task]:
            raise UserError(f"STS data in {folder}: {task} has {got} pairs, expected "
                            f"{STS_PAIR_COUNTS[task]}: the download is incomplete or corrupted.")


def download_sts(dest: Path, base_url: str = UPSTREAM) -> Path:
    """SentEval's STS data into dest/sts, unless already there: unpacked and checked
    (check_sts) in a temporary folder, moved into place only once whole."""
    final = dest / "sts"
    if is_sts_dir(final):
        print(f"{final}: present, not fetched again", file=sys.stderr)
        return final
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".sts-") as tmp:
        tmp = Path(tmp)
        fetch(f"{base_url.rstrip('/')}/{SENTEVAL}", tmp / SENTEVAL)
        try:
            with tarfile.open(tmp / SENTEVAL) as tf:
                tf.extractall(tmp / "x", filter="data")
        except (tarfile.TarError, EOFError) as e:
            raise UserError(f"{SENTEVAL}: not a readable tar archive ({e}): the download is corrupted. "
                            f"{RETRY}")
        # the archive holds SentEval's downstream/ folder: find STS/ beside SICK/
        roots = [p.parent for p in (tmp / "x").rglob("STS12-en-test")]
        if not roots or not (roots[0].parent / "SICK").is_dir():
            raise UserError(f"{SENTEVAL}: no STS/ and SICK/ folders inside: the download is "
                            f"corrupted or not SentEval's archive.")
        stage = tmp / "sts"
        stage.mkdir()
        shutil.move(str(roots[0]), stage / "STS")
        shutil.move(str(roots[0].parent / "SICK"), stage / "SICK")
        check_sts(stage)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
    return final


def download(dest: str | Path = DATA_DIR, base_url: str = UPSTREAM, what: list[str] | None = None,
             wiki1m_lines: int | None = None) -> dict[str, Path]:
    """Fetch wiki1m, the NLI triplets and the STS data under `dest`, skipping what is there."""
    names = {"wiki1m": WIKI1M, "nli": NLI}
    what = what or ["wiki1m", "nli", "sts"]
    for item in what:
        if item not in (*names, "sts"):
            raise UserError(f"--what {item}: unknown; choose from wiki1m, nli, sts.")
    return {item: download_sts(Path(dest), base_url) if item == "sts"
            else download_file(Path(dest), names[item], base_url, wiki1m_lines) for item in what}


# -------------------------------------------------------------------------------------
# Input checks: a file read with an error that names it; the encoder's positions
# -------------------------------------------------------------------------------------

def _read_text(path: Path, flag: str, what: str, download: str) -> str:
    """A training file's text, or a UserError that names the flag, the file and what to do."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file. Pass {what}.")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Pass {what}, or run `python common.py download` "
                        f"for {download}.")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{flag} {path}: line {line} is not UTF-8 ({e.reason} at byte {e.start}). "
                        f"Convert the file, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`.")


def token_cache(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None) -> Path | None:
    """The .npz that caches `texts` tokenised to max_len, keyed by the tokenizer and the texts."""
    if cache_dir is None:
        return None
    h, vocab = hashlib.sha256(), tokenizer.get_vocab()
    for part in (type(tokenizer).__name__, json.dumps(sorted(vocab.items())[:2000]), len(vocab),
                 getattr(tokenizer, "do_lower_case", ""), max_len, *texts):
        h.update(f"{part}\n".encode())
    return Path(cache_dir) / f"tok-{h.hexdigest()[:24]}.npz"


def count_lines(path: str | Path) -> int:
    """Lines of a file, read as bytes (any encoding, any size)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def default_cache_dir(data_path: str | Path, cache_dir: str | None) -> Path:
    """--cache_dir when given, else a .cache folder beside the data when that is writable."""
    if cache_dir:
        return Path(cache_dir)
    folder = Path(data_path).resolve().parent
    return folder / ".cache" if os.access(folder, os.W_OK) else Path(tempfile.gettempdir()) / "cl-sent-cache"


def check_batch(n: int, batch_size: int, data: str, world_size: int = 1) -> None:
    if batch_size > n:
        raise UserError(f"--batch_size {batch_size} is larger than the data ({n} examples in "
                        f"--data {data}). Lower --batch_size to at most {n} or give more data.")
    if batch_size % world_size:
        raise UserError(f"--batch_size {batch_size} must divide evenly over {world_size} GPUs.")


def not_loaded(flag: str, name: str, e: Exception) -> UserError:
    return UserError(f"{flag} {name}: could not load it ({str(e).splitlines()[0]}). Give a local folder "
                     f"with config.json, weights and tokenizer, or a hub name with the hub reachable.")


def encoder_config(name: str, flag: str = "--model"):
    """The config of a hub name or a local folder, no weights loaded."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise not_loaded(flag, name, e)


def max_positions(config, tokenizer=None) -> int:
    """Tokens a sentence may have in this encoder (and its tokenizer, when given)."""
    n = getattr(config, "max_position_embeddings", 512)
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        n -= 2  # RoBERTa's positions start after the padding index
    tm = getattr(tokenizer, "model_max_length", n)
    return int(min(n, tm)) if tm and tm < 10**8 else int(n)


@functools.lru_cache(maxsize=4)
def encoder_positions(name: str, flag: str = "--model") -> int:
    """max_positions of encoder `name` from its config alone, read once (start's check, ConIsI's)."""
    return max_positions(encoder_config(name, flag))


def is_sts_dir(folder: str | Path) -> bool:
    """Whether `folder` holds SentEval's STS/ and SICK/ folders."""
    return (Path(folder) / "STS").is_dir() and (Path(folder) / "SICK").is_dir()


def check_sts_dir(sts_dir: str | Path) -> None:
    """--sts_dir holds SentEval's layout: checked by start and before every evaluation."""
    if not is_sts_dir(sts_dir):
        raise UserError(f"--sts_dir {sts_dir}: expected STS/ and SICK/ inside (SentEval's layout). "
                        f"Run `python common.py download` and pass --sts_dir data/sts.")


# -------------------------------------------------------------------------------------
# The run folder: one process holds it; args.json and the data's fingerprint are written
# once and --resume is held to them; writes are atomic; last/ is the one commit point
# -------------------------------------------------------------------------------------

class WriteFailed(Exception):
    """A write that failed (disk full, quota, read-only, permission): one line, exit status 4."""


# The libraries' own exceptions for a write the system refused, beside OSError: torch.save raises
# RuntimeError ("[enforce fail at inline_container.cc:672] . unexpected pos N vs M", chained on
# "basic_ios::clear: iostream error"), safetensors its SafetensorError and the tokenizers a bare
# Exception, both ending in "(os error 28)". Any other exception is a bug: its traceback stays.
TORCH_IO = ("inline_container.cc", "iostream error")
OS_ERROR = re.compile(r"\(os error (\d+)\)")
# what to make possible again, by the system's reason
REMEDY = {errno.ENOSPC: "free space", errno.EDQUOT: "free space, or a larger quota",
          errno.EFBIG: "a larger file size limit: ulimit -f", errno.EROFS: "the disk writable again",
          errno.EIO: "a disk that works again: the system's log says what failed"}


def refused_write(e: BaseException) -> tuple[int | None, str] | None:
    """(errno, the system's words) for an exception that says the system refused a write: an
    OSError, or a library's error above (the errno found in it or in what it was raised from).
    None for any other exception."""
    if not (isinstance(e, OSError) or OS_ERROR.search(str(e))
            or isinstance(e, RuntimeError) and any(s in str(e) for s in TORCH_IO)):
        return None
    seen = []
    while e is not None and e not in seen and len(seen) < 8:
        seen.append(e)
        if isinstance(e, OSError):
            return e.errno, e.strerror or str(e)
        if m := OS_ERROR.search(str(e)):
            return int(m[1]), os.strerror(int(m[1]))
        e = e.__cause__ or e.__context__
    return None, "an I/O error (the library did not say which)"


@contextlib.contextmanager
def writing(what: str, checkpoint: str, then: str = "the same command plus --resume continues"):
    """A write the system refuses inside (refused_write) becomes WriteFailed: what, why, what is
    intact (`checkpoint`), what next."""
    try:
        yield
    except Exception as e:
        refused = refused_write(e)
        if refused is None:
            raise
        code, reason = refused
        remedy = REMEDY.get(code, "free space, a writable place")
        raise WriteFailed(f"could not write {what}: {reason}. {checkpoint}; once it can be written again "
                          f"({remedy}), {then}.") from e


NO_CHECKPOINT = "no checkpoint was written yet"
CHECKSUM = "state.pt.sha256"    # beside last/state.pt: the SHA-256 of its bytes, checked by --resume


def intact(step: int, last: Path) -> str:
    return f"the last complete checkpoint, step {step}, is intact in {last}"


def checkpoint_kept(out: str | Path) -> str:
    """What a failed write outside train() leaves intact in run folder `out`: last/'s step (read
    without its tensors), or that no checkpoint was written yet."""
    last = Path(out) / "last" / "state.pt"
    if not last.is_file():
        return NO_CHECKPOINT
    try:
        step = torch.load(last, map_location="cpu", mmap=True, weights_only=True)["step"]
    except Exception:
        return f"{last.parent} is as it was"
    return intact(step, last.parent)


def _fsync(path: Path) -> None:
    """Make `path` (a file, or a folder's list of names) reach the disk now: a full disk is told
    at the write, not later (a network disk, say, reports it only when its data are sent), and a
    crash of the machine cannot leave a committed checkpoint empty."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_dir(final: Path) -> tuple[Path, Callable[[], None]]:
    """A temporary folder beside `final` and a commit() that swaps it into place: a run
    killed at any moment leaves either the old folder or the new one, never half of one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))

    def commit():
        for p in [*sorted(tmp.rglob("*")), tmp]:
            _fsync(p)
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists():
                os.replace(old, final)
            raise
        _fsync(final.parent)
        if old.exists():
            shutil.rmtree(old)

    return tmp, commit


@contextlib.contextmanager
def atomic_dir(final: Path):
    """_atomic_dir as a block: the temporary folder is filled inside and swapped in at its end; a
    write that fails removes it (a partial copy would hold the space a full disk needs back)."""
    tmp, commit = _atomic_dir(final)
    try:
        yield tmp
        commit()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small file through a temporary name: a kill leaves the old file or the new one; a
    failed write leaves no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def recover_dir(final: Path) -> Path:
    """What a kill during _atomic_dir leaves: between the two renames the old folder is still
    whole (put back); a temporary folder never swapped in is dropped (it holds a full copy)."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# the run folders this process holds: resolved path -> the open lock file (its flock lives with it)
held_locks: dict[str, Any] = {}
LOCK = "run.lock"
# the run folder whose record (args.json) start() wrote for this command: what a Ctrl-C's line offers
recorded_run: Path | None = None


def hold_run_folder(folder: str | Path, mid_run: bool = False) -> None:
    """Take `folder` for this process: a flock on <folder>/run.lock, which the system drops when the
    process ends however it ends (kill -9 too), so a dead run blocks no --resume. A second process
    stops here, told which process holds it. A folder that cannot be written refuses the command;
    `mid_run` (a folder a run takes as it goes, rcl's entropy models): the OSError is left to the
    caller's writing(), a failed write. NOTE(ours): no fcntl (Windows), no lock."""
    key = str(Path(folder).resolve())
    if key in held_locks or fcntl is None:
        return
    unwritable = f"--output_dir {folder}: cannot be written ({{}}). Choose a folder you can write to."
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        f = open(Path(folder) / LOCK, "a+")  # "a+": a process that loses must not erase the holder's line
    except OSError as e:
        if mid_run:
            raise
        raise UserError(unwritable.format(e.strerror or e))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"--output_dir {folder} is in use by {holder}. One process at a time trains "
                        f"in a run folder: wait for that one to end (or stop it), then continue the "
                        f"run with --resume; or choose another --output_dir.")
    try:
        f.truncate(0)
        f.write(f"process {os.getpid()} ({shlex.join([Path(sys.executable).name] + sys.argv)})\n")
        f.flush()
    except OSError as e:                # a full disk: the lock's line is the run's first write
        with contextlib.suppress(OSError):
            f.close()
        if mid_run:
            raise
        raise UserError(unwritable.format(e.strerror or e))
    held_locks[key] = f


def release_run_folders(*folders: str | Path) -> None:
    """Let go of the given run folders (all, with none given): a process training several runs."""
    for k in [str(Path(f).resolve()) for f in folders] if folders else list(held_locks):
        if k in held_locks:
            held_locks.pop(k).close()           # closing the file drops its flock


def prepare_output_dir(output_dir: str | Path, resume: bool) -> Path:
    """Hold the run folder (a second process stops here); refuse an earlier run's folder unless
    --resume, and a folder that cannot be written."""
    out = Path(output_dir)
    new = not out.exists()
    hold_run_folder(out)
    started = (out / "args.json").exists() or (out / "metrics.jsonl").exists()
    if not resume and ((out / "metrics.jsonl").exists() or (out / "best").exists()):
        error = UserError(f"--output_dir {out} already holds a run. Add --resume to continue it, or "
                          f"choose another --output_dir (or delete the folder) to start afresh.")
    # a run stopped before its first checkpoint resumes from step 0 (train() empties its log)
    elif resume and not (out / "last" / "state.pt").exists() and not (out / ".last.old").exists() \
            and not started:
        error = UserError(f"--resume: no checkpoint to resume in {out / 'last'}. Run without "
                          f"--resume to start, or point --output_dir at the earlier run.")
    elif not os.access(out, os.W_OK):
        error = UserError(f"--output_dir {out}: cannot be written. Choose a folder you can write to.")
    else:
        return out
    if new:                                         # the folder this call made for its lock
        release_run_folders(out)
        shutil.rmtree(out, ignore_errors=True)
    raise error


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks (any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def record_run(out: Path, args: TrainArgs) -> None:
    """args.json (the flags) and run.json (the script, and a fingerprint of --data's content)
    are written once, when the run starts. On --resume the command is held to them first:
    any flag but those of NOT_TRAINING, or other data, stops it before anything is written."""
    flags = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    run = {"script": f"{script_name(args)}.py", "data_sha256": sha256_file(args.data)}
    if args.resume and (out / "args.json").is_file():
        then = json.loads((out / "args.json").read_text())
        then_run = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
        diffs = [f"  --{k}: the run has {then.get(k)!r}, this command {v!r}" for k, v in flags.items()
                 if k not in NOT_TRAINING and then.get(k) != v]
        if then_run.get("data_sha256", run["data_sha256"]) != run["data_sha256"]:
            diffs.append(f"  --data {args.data}: its content is not the data the run started with")
        if diffs:
            raise UserError(f"--resume: this command would train another run than the one in {out}, "
                            f"which is left as it is:\n" + "\n".join(diffs) + "\nTo train with these "
                            "flags, start a new run: leave out --resume and --output_dir (the default "
                            "folder is named after the flags) or give another --output_dir.")
        if then_run:
            return
        # a folder from before run.json: its data cannot be checked; from now on it is held to these
        print(f"note: {out} has no run.json (written by an earlier version): --data {args.data} cannot be "
              f"checked against the data the run started with; its fingerprint is recorded now",
              file=sys.stderr)
        with writing(str(out / "run.json"), checkpoint_kept(out)):
            write_text_atomic(out / "run.json", json.dumps(run, indent=2))
        return
    # run.json first, and no args.json of an earlier start left beside it: a folder whose args.json
    # --resume accepts always holds the fingerprint of the data that run trained on
    (out / "args.json").unlink(missing_ok=True)
    for name, record in (("run.json", run), ("args.json", flags)):
        with writing(str(out / name), NO_CHECKPOINT, "the same command starts the run"):
            write_text_atomic(out / name, json.dumps(record, indent=2))


def start(args: TrainArgs) -> torch.device:
    """Before a script loads a model: torchrun's process group; every flag, then every file checked
    before anything is written (the default data downloaded on first use); the flags that depend
    on the data settled; the seed; the run folder, held, with its record (record_run)."""
    device = init_distributed()
    args.check()                                    # the flags on their own
    if world()[0] == 0:                             # the default data, into data/ on first use
        if not Path(args.sts_dir).exists() and Path(args.sts_dir) == DATA_DIR / "sts":
            download_sts(DATA_DIR)
        if not Path(args.data).exists() and Path(args.data) in (DATA_DIR / WIKI1M, DATA_DIR / NLI):
            download_file(DATA_DIR, Path(args.data).name)
    barrier()
    # a missing, empty or non-UTF-8 --data stops here (with the line), then too small a one
    rows = data_rows(args.data)
    check_batch(rows, args.batch_size, args.data, world()[1])
    check_sts_dir(args.sts_dir)
    positions = encoder_positions(args.model)
    if args.max_len > positions:
        raise UserError(f"--max_len {args.max_len}: {args.model} has {positions} positions. "
                        f"Pass --max_len {positions} or less.")
    args.settle(rows)
    seed_everything(args.seed)
    if world()[0] == 0:
        out = prepare_output_dir(args.output_dir, args.resume)
        record_run(out, args)
        recover_dir(out / "best")
        recover_dir(out / "last")
    barrier()
    global recorded_run
    recorded_run = Path(args.output_dir)
    return device


class RunFolder:
    """What train() keeps in --output_dir: metrics.jsonl (appended to only), last/ (all --resume
    needs: the one commit point) and best/ (the best STS-B dev's encoder). `state`: last/'s modules
    ({"model", "opt", "sched", "should_stop"}); `saved`: (encoder, tokenizer, pooler, mlp) for best/."""

    def __init__(self, args: TrainArgs, out: Path, state: dict, saved: tuple):
        self.args = args
        self.out = out
        self.state = state
        self.saved = saved
        self.log = out / "metrics.jsonl"
        self.main = world()[0] == 0
        self.best = -float("inf")
        self.best_step = 0
        self.last = None           # the last evaluation's figures
        self.kept = NO_CHECKPOINT

    def write(self, record: dict) -> None:
        if self.main:
            with writing(str(self.log), self.kept), open(self.log, "a") as f:
                f.write(json.dumps(record) + "\n")

    def save_best(self, record: dict) -> None:
        extra = {"args.json": dataclasses.asdict(self.args), "dev_metrics.json": record}
        with writing(str(self.out / "best"), self.kept):
            save_pretrained_dir(self.out / "best", *self.saved, extra=extra)

    def checkpoint(self, step: int, figures: dict, loop: dict) -> None:
        """In the order a kill may interrupt: the evaluation's record, last/ with the log's length
        (a resume cuts the log back to it) and the loop's state, best/ if the best so far."""
        self.last = {"step": step, **figures}
        if self.last["stsb_dev"] > self.best:
            self.best, self.best_step = self.last["stsb_dev"], step
        record = dict(self.last, best_stsb_dev=self.best)
        self.write(record)
        with writing(str(self.log), self.kept):
            _fsync(self.log)      # on the disk up to the length last/ records: a resume cuts it back there
        stop = self.state["should_stop"]
        state = {k: self.state[k].state_dict() for k in ("model", "opt", "sched")}
        state.update(loop)
        state.update({"dev": record, "step": step, "best": self.best, "best_step": self.best_step,
                      "log_bytes": self.log.stat().st_size,
                      "should_stop": getattr(stop, "state_dict", lambda: None)(),
                      "rng_cpu": torch.get_rng_state(),
                      "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None})
        with writing(str(self.out / "last"), self.kept), atomic_dir(self.out / "last") as tmp:
            with open(tmp / "state.pt", "wb") as f:
                torch.save(state, f)    # a file, not a path: the system's error (ENOSPC, ...) reaches here
            # its fingerprint, swapped in with it (`sha256sum -c state.pt.sha256` in last/ checks it too)
            (tmp / CHECKSUM).write_text(f"{sha256_file(tmp / 'state.pt')}  state.pt\n")
        self.kept = intact(step, self.out / "last")
        if self.best_step == step:
            self.save_best(record)

    def resume(self) -> dict:
        """--resume: bring back what checkpoint() kept (data only: weights_only), cut metrics.jsonl
        back to last/'s length (records of steps trained again, a line cut short), and re-save
        best/ if it fell one evaluation behind. {} for a run stopped before its first checkpoint."""
        last = self.out / "last" / "state.pt"
        if not last.exists():
            if self.main and self.log.exists():
                os.truncate(self.log, 0)
            if self.main:
                print(f"no checkpoint in {last.parent} yet: training starts from step 0", file=sys.stderr)
            return {}
        try:
            # onto the CPU: the RNG states must stay CPU byte tensors (set_rng_state refuses
            # others), and load_state_dict copies weights and AdamW's moments to the model's device
            state = torch.load(last, map_location="cpu", weights_only=True)
        except Exception as e:      # no checkpoint: UnpicklingError, EOFError, IndexError, struct.error
            raise UserError(self.damaged(last, e))
        # bytes damaged on the disk (tensor data load without a word) or another file put in its place;
        # a checkpoint of an earlier version of this code has no checksum beside it
        recorded = last.with_name(CHECKSUM)
        if recorded.is_file() and (recorded.read_text().split() or [""])[0] != sha256_file(last):
            raise UserError(self.damaged(last, f"its SHA-256 is not the one in {recorded.name}, written with "
                                               f"it: damaged on the disk, or replaced"))
        try:
            for k in ("model", "opt", "sched"):
                self.state[k].load_state_dict(state[k])
            if state.get("should_stop") is not None and hasattr(self.state["should_stop"], "load_state_dict"):
                self.state["should_stop"].load_state_dict(state["should_stop"])
            self.best, self.best_step, self.last = state["best"], state["best_step"], state["dev"]
            size = state["log_bytes"]
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, KeyError, ValueError,
                TypeError) as e:
            raise UserError(self.damaged(last, e))
        if self.main and self.log.exists() and self.log.stat().st_size >= size:
            os.truncate(self.log, size)
        elif self.main:
            print(f"note: {self.log} is shorter than when {last.parent} was written (edited or "
                  f"replaced?); it is kept as it is", file=sys.stderr)
        best_dev = self.out / "best" / "dev_metrics.json"
        saved = json.loads(best_dev.read_text()) if best_dev.is_file() else {}
        if self.main and state["best_step"] == state["step"] and saved.get("step") != state["step"]:
            self.save_best(state["dev"])
        torch.set_rng_state(state["rng_cpu"])
        if torch.cuda.is_available() and state.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rng_cuda"])
        self.kept = intact(state["step"], last.parent)
        if self.main:
            print(f"resuming {self.out} at step {state['step']} (best STS-B dev {state['best']:.2f} at step "
                  f"{state['best_step']})", file=sys.stderr)
        return state

    def damaged(self, last: Path, e: Exception | str) -> str:
        """The one line for a last/state.pt that cannot be this run's checkpoint (`e`: why)."""
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        if "Weights only load failed" in str(e):
            reason = "it holds objects other than tensors and numbers, which loading would run as code"
        best = self.out / "best" / "dev_metrics.json"
        good = f"{best.parent} (the model of step {json.loads(best.read_text()).get('step')}) and " \
            if best.is_file() else ""
        return (f"{last}: not a checkpoint of this run ({reason}). Still good, and left as they are: "
                f"{good}{self.log}. This run cannot continue from it: train it again in another "
                f"--output_dir (or move {self.out} away first).")


# -------------------------------------------------------------------------------------
# The export: a folder both Hugging Face and sentence-transformers load
# -------------------------------------------------------------------------------------

ST_POOLING = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}


def save_pretrained_dir(path: str | Path, encoder: nn.Module, tokenizer, pooler: str,
                        mlp: nn.Module | None = None, extra: dict[str, Any] | None = None) -> None:
    """Save an encoder atomically for AutoModel and SentenceTransformer alike. The `cls` pooler's MLP
    goes into BERT's own pooler (tanh(W h_cls + b) is the MLP) and into a Dense module with Tanh.
    `extra` = {filename: json-able}."""
    with atomic_dir(Path(path)) as tmp:    # swapped in whole at the end, or removed
        def dump(name: str, obj) -> None:
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_text(json.dumps(obj, indent=2, default=str))

        if pooler == "cls":
            if mlp is None:
                raise ValueError("pooler 'cls' is saved with its MLP")
            if hasattr(getattr(encoder, "pooler", None), "dense"):
                encoder.pooler.dense.load_state_dict(mlp.dense.state_dict())
        encoder.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        d = encoder.config.hidden_size
        st_pooling = ST_POOLING.get(pooler)
        if st_pooling is None:
            print(f"note: sentence-transformers has no '{pooler}' pooling; {path} loads with AutoModel only",
                  file=sys.stderr)
        else:
            modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
            off = ("max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
            dump("1_Pooling/config.json", {"word_embedding_dimension": d, "include_prompt": True,
                                           "pooling_mode_cls_token": st_pooling == "cls",
                                           "pooling_mode_mean_tokens": st_pooling == "mean",
                                           **{f"pooling_mode_{k}": False for k in off}})
            if pooler == "cls":
                from safetensors.torch import save_file
                modules.append(("2_Dense", "Dense"))
                dump("2_Dense/config.json", {"in_features": d, "out_features": d, "bias": True,
                                             "activation_function": "torch.nn.modules.activation.Tanh"})
                weights = {f"linear.{k}": v.detach().float().cpu().contiguous()
                           for k, v in mlp.dense.state_dict().items()}
                save_file(weights, str(tmp / "2_Dense" / "model.safetensors"))
            dump("modules.json", [{"idx": i, "name": str(i), "path": folder,
                                   "type": f"sentence_transformers.models.{kind}"}
                                  for i, (folder, kind) in enumerate(modules)])
            dump("sentence_bert_config.json", {"max_seq_length": max_positions(encoder.config, tokenizer),
                                               "do_lower_case": False})
        for name, obj in (extra or {}).items():
            dump(name, obj)



# -------------------------------------------------------------------------------------
# The compiled step on a GPU: train_step calls a CompiledModel as it calls the model
# -------------------------------------------------------------------------------------

def attention_kernels():
    """Every attention kernel but cuDNN's, which PyTorch picks for 32-token batches on an H100 and
    the memory-efficient one beats there (docs/speed.md); nothing changes on a CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def stacked(model: Callable) -> Callable:
    """model(batch) with the logged figures leaving as ONE vector: (loss, names, (k,) tensor).
    Inductor may hand back one buffer for the loss and a figure it proves equal to it (`l + 0`
    folds to `l`, a detach is free); AOTAutograd then marks that figure non-differentiable, and
    with it the loss, which loses its gradient (pytorch/pytorch#100348). A stacked vector is a
    buffer of its own."""
    def forward(batch: dict):
        out = model(batch)
        loss, stats = out if isinstance(out, tuple) else (out, {})
        return loss, tuple(stats), torch.stack(list(stats.values())) if stats else None
    return forward


class CompiledModel:
    """model(batch) through torch.compile: forward and backward fused and, in one process, replayed
    from CUDA graphs (a few launches instead of hundreds); under DDP, whose hooks run inside the
    backward, no graphs. If compiling fails: one note, then the model itself from there on.
    `backend`: inductor on CUDA, aot_eager on the CPU (tests name inductor there)."""

    def __init__(self, model: nn.Module, device: torch.device, world_size: int = 1,
                 backend: str | None = None):
        self.model = model
        self.graphs = device.type == "cuda" and world_size == 1
        backend = backend or ("inductor" if device.type == "cuda" else "aot_eager")
        self.compiled = torch.compile(stacked(model), mode="reduce-overhead" if self.graphs else None,
                                      backend=backend)

    def __call__(self, batch: dict):
        if self.compiled is None:
            return self.model(batch)
        try:
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()     # the last step's outputs are consumed
            with attention_kernels():
                loss, names, figures = self.compiled(batch)
            return loss, dict(zip(names, figures.unbind() if names else ()))
        except (torch.cuda.OutOfMemoryError, KeyboardInterrupt):
            raise
        except Exception as e:
            print(f"note: the compiled step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                  f"running eager from here on (pass --no-compile to skip compiling)", file=sys.stderr)
            self.compiled = None
            self.model.zero_grad(set_to_none=True)             # what the failed attempt left behind
            return self.model(batch)


# -------------------------------------------------------------------------------------
# The command line: flags from a dataclass, every script's main under run_main, and
# python common.py eval | download
# -------------------------------------------------------------------------------------

def field_default(f: dataclasses.Field) -> Any:
    """The default of a field that arg() made (a list default comes from a factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


RANGE_WORDS = {"ge": (">=", lambda x, b: x >= b), "gt": (">", lambda x, b: x > b),
               "le": ("<=", lambda x, b: x <= b), "lt": ("<", lambda x, b: x < b)}


def check_ranges(args: Any) -> None:
    """Every field in the range its arg() declares, else a UserError: flag, value, rule, note, default."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        for x in value if isinstance(value, list) else [value]:
            for k, bound in f.metadata.get("range", {}).items():
                word, ok = RANGE_WORDS[k]
                if ok(x, bound):
                    continue
                default = field_default(f)
                default = " ".join(map(str, default)) if isinstance(default, list) else default
                note = f" {f.metadata['note']}" if f.metadata.get("note") else ""
                raise UserError(f"--{f.name} {x}: must be {word} {bound:g}.{note} Pass a value in "
                                f"range, e.g. the default --{f.name} {default}.")


def flag_text(name: str, value: Any) -> str:
    """A flag as a user types it: --tau 0.05, --no_mlp, --no-modulate, --phi 0.01 0.02."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    if isinstance(value, list):
        return " ".join([f"--{name}", *(f"{v:g}" if isinstance(v, float) else str(v) for v in value)])
    return f"--{name} {value:g}" if isinstance(value, float) else f"--{name} {value}"


def defaults_of(args: TrainArgs) -> TrainArgs:
    """The defaults of `args`' script on its kind of --data (with csv_defaults for a CSV)."""
    defaults = type(args)()
    if str(args.data).lower().endswith(".csv"):
        for k, v in type(args).csv_defaults.items():
            setattr(defaults, k, v)
    return defaults


def changed_flags(args: TrainArgs, leave_out: tuple[str, ...] = NOT_TRAINING) -> dict[str, Any]:
    """The flags whose values differ from the defaults (defaults_of), in the order of Args."""
    defaults = defaults_of(args)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.name not in leave_out and getattr(args, f.name) != getattr(defaults, f.name)}


def script_name(args: Any) -> str:
    """The script whose Args `args` is: simcse, focal_infonce, ... (its module's file name)."""
    module = sys.modules.get(type(args).__module__)
    return Path(getattr(module, "__file__", None) or type(args).__module__).stem


def default_output_dir(args: TrainArgs) -> str:
    """runs/<script>/<each flag that differs from its default>: runs/focal_infonce/m0.2,
    runs/ifcl/no_fraternal_no_queue, runs/simcse/default. A path is named by its last part."""
    parts = [f"{name}-{Path(value).name or value}" if isinstance(value, str)
             else flag_text(name, value)[2:].replace(" ", "", 1).replace(" ", "-")
             for name, value in changed_flags(args).items()]
    name = "".join(c if c.isalnum() or c in "-_.+" else "-" for c in "_".join(parts))
    return str(Path("runs") / script_name(args) / (name or "default"))


def build_parser(cls: type, description: str | None = None, prog: str | None = None):
    """argparse flags from a dataclass of arg() fields, each help line ending in [source]."""
    parser = argparse.ArgumentParser(description=description, prog=prog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        is_list = typing.get_origin(hints[f.name]) is list
        typ = typing.get_args(hints[f.name])[0] if is_list else hints[f.name]
        default = field_default(f)
        source = getattr(cls, "sources", {}).get(f.name, f.metadata.get("source", "ours"))
        shown = "" if default == "" else f" (default: {default})"
        # the real default in --help; SUPPRESS tells parse_args which flags were given
        kw: dict[str, Any] = {"default": argparse.SUPPRESS,
                              "help": f"{f.metadata.get('help', '')} [{source}]{shown}"}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.metadata.get("positional"):
            parser.add_argument(f.name, nargs="*", metavar=f.name.upper().rstrip("S"), **kw)
        elif typ is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(f"--{f.name}", action=action, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=typ, nargs="*" if is_list else None, **kw)
    return parser


def parse_args(cls: type, argv: list[str] | None = None, csv_defaults: dict | None = None,
               description: str | None = None, prog: str | None = None) -> Any:
    """The one way every command reads its flags: argparse from `cls`, each range checked. When
    --data is a CSV, csv_defaults (default: cls.csv_defaults) replace defaults the user did not give.
    A training script's files and rules are checked by common.start (TrainArgs.check)."""
    given = vars(build_parser(cls, description, prog).parse_args(argv))
    args = cls(**given)
    csv_defaults = getattr(cls, "csv_defaults", {}) if csv_defaults is None else csv_defaults
    if csv_defaults and str(getattr(args, "data", "")).lower().endswith(".csv"):
        for k, v in csv_defaults.items():
            if k not in given:
                setattr(args, k, v)
    check_ranges(args)
    return args


class Terminated(KeyboardInterrupt):
    """SIGTERM, which `timeout` and job schedulers send before a kill: handled as Ctrl-C is."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def after_a_stop() -> str:
    """What run_main's line after Ctrl-C or SIGTERM says to run: --resume once start() has recorded
    the run (args.json: --resume accepts it), else the same command (--resume would be refused)."""
    if recorded_run is not None and (recorded_run / "args.json").is_file():
        return (f"What was already written in {recorded_run} is kept; the same command plus --resume "
                f"continues the run (from its last checkpoint, if one was written).")
    return "The run was not recorded yet: there is nothing for --resume to continue. Run the same command " \
        "again."


def close_bars() -> None:
    """Close the progress bars still drawn (a bar ends in no newline): run_main's line then starts
    a line of its own instead of being glued to the bar's end."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Call `main(argv)`, and end in one line: a UserError (exit 2), a failed write (4), the GPU out
    of memory (3), Ctrl-C (130) or SIGTERM (143), each with what to do next; held folders let go."""
    global recorded_run
    recorded_run = None                                           # start() records this command's run
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:   # Ctrl-C back from interrupts.py
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        close_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except WriteFailed as e:
        close_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(4)
    except KeyboardInterrupt as e:
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
        print(f"\n{what}. {after_a_stop()}", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except torch.cuda.OutOfMemoryError:
        print("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the "
              "batch over more GPUs with `torchrun --nproc_per_node K ...` (the contrastive "
              "loss still sees the whole batch).", file=sys.stderr)
        sys.exit(3)
    finally:
        release_run_folders()


@dataclass
class EvalArgs:
    model: str = arg("bert-base-uncased", "hub name or local folder of any Hugging Face encoder")
    pooler: str = arg("cls_before_pooler", "how a sentence vector is read off the encoder",
                      "SimCSE official code", choices=POOLERS)
    sts_dir: str = arg("data/sts", "folder with STS/ and SICK/ in SentEval's layout")
    split: str = arg("test", "test = the 7 tasks; dev = STS-B dev and SICK-R trial", choices=["test", "dev"])
    tasks: list[str] = arg([], "a subset of tasks (default: all of the split's)")
    batch_size: int = arg(128, "sentences per forward pass", ge=1)
    output: str = arg("", "also write the full result as JSON here")


@dataclass
class DownloadArgs:
    dest: str = arg("data", "where to put wiki1m_for_simcse.txt, nli_for_simcse.csv and sts/")
    base_url: str = arg(UPSTREAM, "where the files are served (a mirror, or a local server in tests)",
                        "official code")
    what: list[str] = arg(["wiki1m", "nli", "sts"], "which of wiki1m, nli, sts to fetch")


def cli(argv: list[str]) -> None:
    """python common.py eval | download."""
    if argv[:1] == ["download"]:
        args = parse_args(DownloadArgs, argv[1:], prog="python common.py download")
        for name, path in download(args.dest, args.base_url, args.what).items():
            print(f"{name}: {path}")
        return
    if argv[:1] != ["eval"]:
        print(__doc__)
        raise UserError("choose a command: eval, download (e.g. `python common.py eval --help`)")
    args = parse_args(EvalArgs, argv[1:], prog="python common.py eval")
    t = time.perf_counter()
    res = evaluate_encoder(args.model, args.pooler, args.sts_dir, args.tasks or None, args.split,
                           args.batch_size)
    print(format_sts_table(res, name=f"{Path(args.model).name} [{args.pooler}]"))
    print(f"({args.model}, {args.split} split, {time.perf_counter() - t:.1f}s)", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    run_main(cli)
