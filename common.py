"""Shared plumbing for the method scripts: flags, data, models, the training loop, STS
evaluation, checkpoints, and the command-line tools.

A method script (simcse.py, focal_infonce.py, ifcl.py, conisi.py, rcl.py) holds its paper:
losses, augmentations, heads. What a reader of a paper does not need to see lives here, once.
The sections, in order (what the method scripts call comes first):

    Flags            arg(), TrainArgs (the 17 flags every script shares, each checked in
                     TrainArgs.check before anything is written), parse_args
    Data             load_columns (a text file or SimCSE's CSV), tokenize (once, cached as
                     integer arrays), Tokens.batch, concat_batches
    Models           load_encoder, MLP, pool (SimCSE's poolers), make_encode, autocast, fp32
    Distributed      world, gather (all-gather that keeps the local gradient), barrier
    Training loop    start (checks, output folder), make_step (the training step, written
                     out), train (the loop: batch, step, log, evaluate, save), RunFolder
                     (metrics.jsonl, last/ for --resume, best/)
    STS evaluation   evaluate_sts: the 7 tasks exactly as SimCSE's SentEval computes them
    Checkpoints      save_pretrained_dir: loads with AutoModel and SentenceTransformer
    Fast path        FastStep: the same step compiled and replayed from a CUDA graph; a
                     reader of the papers can skip it
    Command line     download, eval, compare (runs side by side), bench (used by
                     `python simcse.py bench`)

    python common.py eval --model <hub name or dir> --pooler avg
    python common.py download
    python common.py compare runs/simcse-s1 runs/simcse-s2 runs/focal --markdown table.md --plot dev.png
    python simcse.py bench --config bert-base-uncased --batch_size 64 --max_len 32
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import functools
import hashlib
import io
import json
import os
import random
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.request
import warnings
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
    import fcntl                       # POSIX: the run-folder lock (hold_run_folder)
except ImportError:                    # Windows
    fcntl = None


class UserError(Exception):
    """A problem with the user's input (a file, a flag): printed as one clear message."""


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Call `main(argv)`; turn UserError into `error: ...` on stderr and exit status 2, Ctrl-C
    and running out of GPU memory into a line that says what to do next."""
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted. What was already written is kept; a training run continues from its "
              "last checkpoint with the same command plus --resume.", file=sys.stderr)
        sys.exit(130)
    except torch.cuda.OutOfMemoryError:
        print("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the "
              "batch over more GPUs with `torchrun --nproc_per_node K ...` (the contrastive "
              "loss still sees the whole batch).", file=sys.stderr)
        sys.exit(3)
    finally:
        release_run_folders()


# =====================================================================================
# Flags: one @dataclass Args per script becomes argparse flags with help and source
# =====================================================================================

def arg(default: Any, help: str, source: str = "ours", choices: list | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, note: str = "") -> Any:
    """A dataclass field with its help text, where its default comes from (paper Tab. N /
    paper Sec. N / paper App. X / official code / ours), and the range its value must lie in
    (ge: >=, gt: >, le: <=, lt: <; for a list, every element), checked by check_ranges.
    `note` is added to a range error: why the range, and the values the paper used."""
    meta = {"help": help, "source": source, "choices": choices, "note": note,
            "range": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_default(f: dataclasses.Field) -> Any:
    """The default of a field that arg() made (a list default comes from a factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


RANGE_WORDS = {"ge": (">=", lambda x, b: x >= b), "gt": (">", lambda x, b: x > b),
               "le": ("<=", lambda x, b: x <= b), "lt": ("<", lambda x, b: x < b)}


def check_ranges(args: Any) -> None:
    """Every field against the range its arg() declares: a UserError that names the flag, the
    value, the rule and the default."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        for x in value if isinstance(value, list) else [value]:
            for k, bound in f.metadata.get("range", {}).items():
                word, ok = RANGE_WORDS[k]
                if not ok(x, bound):
                    default = field_default(f)
                    default = " ".join(map(str, default)) if isinstance(default, list) else default
                    note = f" {f.metadata['note']}" if f.metadata.get("note") else ""
                    raise UserError(f"--{f.name} {x}: must be {word} {bound:g}.{note} Pass a value in "
                                    f"range, e.g. the default --{f.name} {default}.")


@dataclass
class TrainArgs:
    """The flags every training script shares. A script's `Args(TrainArgs)` adds its own fields
    and re-declares a field whose default (or help) it changes. The defaults are unsupervised
    SimCSE's with BERT-base, the setup the other papers start from."""
    data: str = arg("data/wiki1m_for_simcse.txt", "one sentence a line (downloaded on first use)",
                    "SimCSE paper Sec. 3")
    model: str = arg("bert-base-uncased", "hub name or local folder of the encoder", "SimCSE paper Sec. 3")
    output_dir: str = arg("runs/run", "run folder: args.json, metrics.jsonl, best/, last/")
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

    def check(self) -> None:
        """Every flag, before anything is written or any weight loaded (common.start calls it),
        in this order: the ranges the fields declare, the rules between flags (the script's
        own: rules()), the files and folders (the defaults downloaded first, on first use),
        --max_len against the encoder's positions."""
        check_ranges(self)
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise UserError(f"--output_dir {self.output_dir}: is a file; it must be a folder (the run "
                            f"folder). Pass a new folder's path, or that of a run to --resume.")
        if self.epochs == 0 and self.max_steps == 0:
            raise UserError("--epochs 0: train at least one epoch, or give --max_steps N to train "
                            "N steps whatever the epochs.")
        self.rules()
        if world()[0] == 0:
            ensure_data(self)
        barrier()
        # a missing, empty or non-UTF-8 --data stops here (with the line), then too small a one
        check_batch(data_rows(self.data), self.batch_size, self.data, world()[1])
        check_sts_dir(self.sts_dir)
        positions = encoder_positions(self.model)
        if self.max_len > positions:
            raise UserError(f"--max_len {self.max_len}: {self.model} has {positions} positions. "
                            f"Pass --max_len {positions} or less.")

    def rules(self) -> None:
        """A script's own rules between flags (a form of --data it cannot train on, say): its
        Args overrides this. Each error names the flag and what to pass instead."""


def _flag_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(element type, is_list) for a dataclass field; annotations are strings here."""
    t = str(f.type).replace("typing.", "").replace(" ", "")
    is_list = t.startswith("list[")
    inner = t[5:-1] if is_list else t
    inner = inner.replace("|None", "").replace("None|", "")
    return {"int": int, "float": float, "str": str, "bool": bool}.get(inner, str), is_list


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, usage="%(prog)s [options]",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        typ, is_list = _flag_type(f)
        default = field_default(f)
        # the real default in --help; SUPPRESS tells parse_args which flags were given
        source = getattr(cls, "sources", {}).get(f.name, f.metadata.get("source", "ours"))
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"{f.metadata.get('help', '')} "
                              f"[{source}] (default: {default})"}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kw["type"] = typ
            if is_list:
                kw["nargs"] = "*"
        p.add_argument(f"--{f.name}", **kw)
    return p


def parse_args(cls: type, argv: list[str] | None = None, csv_defaults: dict | None = None,
               description: str | None = None) -> Any:
    """Parse flags into `cls` (a dataclass). Flags the user gave always win; `csv_defaults`
    replace the dataclass defaults when --data is a CSV (the supervised form). The values are
    checked by common.start (TrainArgs.check); other tools call check_ranges."""
    given = vars(build_parser(cls, description=description).parse_args(argv))
    args = cls(**given)
    if csv_defaults and str(getattr(args, "data", "")).lower().endswith(".csv"):
        for k, v in csv_defaults.items():
            if k not in given:
                setattr(args, k, v)
    return args


# =====================================================================================
# Data: read, check, tokenise once, cache as integer arrays
# =====================================================================================

DATA_DIR = Path("data")
UPSTREAM = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"
WIKI1M = "wiki1m_for_simcse.txt"
NLI = "nli_for_simcse.csv"
SENTEVAL = "senteval.tar"


def read_once(read: Callable) -> Callable:
    """Decorator for a reader read(path, flag): a file is read once. A later call for the same
    file, unchanged (same size and modification time), returns what the first call read: the
    checks read the training files (TrainArgs.check, a script's rules()), and the script reads
    them again to train. What it returns is shared between callers: do not change it."""
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
    """One sentence per line, UTF-8. Blank lines are skipped and counted; anything else that
    is wrong (missing, empty, not UTF-8) stops with the line number and what to do."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file. Pass a text file with one sentence "
                        f"per line.")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Pass a text file with one sentence per "
                        f"line, or run `python common.py download` for SimCSE's wiki1m.")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{flag} {path}: line {line} is not UTF-8 ({e.reason} at byte {e.start}). "
                        f"Convert the file, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`.")
    lines = text.splitlines()
    sents = [s.strip() for s in lines]
    kept = [s for s in sents if s]
    if not kept:
        raise UserError(f"{flag} {path}: the file has no sentences (it is empty or blank).")
    if len(kept) < len(sents):
        print(f"note: {path}: skipped {len(sents) - len(kept)} blank lines of {len(sents)}",
              file=sys.stderr)
    return kept


def count_lines(path: str | Path) -> int:
    """Lines of a file, read as bytes (any encoding, any size)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@read_once
def read_csv_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """SimCSE's supervised CSV: a header `sent0,sent1[,hard_neg]`, one triplet a row."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file. Pass a CSV with columns "
                        f"sent0,sent1[,hard_neg].")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Pass a CSV with columns sent0,sent1[,hard_neg], "
                        f"or run `python common.py download` for SimCSE's NLI triplets.")
    try:
        rows = list(csv.reader(io.StringIO(path.read_bytes().decode("utf-8"))))
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 ({e.reason} at byte {e.start}).")
    if not rows:
        raise UserError(f"{flag} {path}: the file is empty.")
    header = [h.strip() for h in rows[0]]
    if header[:2] != ["sent0", "sent1"] or header[2:] not in ([], ["hard_neg"]):
        raise UserError(f"{flag} {path}: the header is {','.join(header)!r}; expected "
                        f"'sent0,sent1' or 'sent0,sent1,hard_neg' (SimCSE's NLI format).")
    cols: dict[str, list[str]] = {h: [] for h in header}
    skipped = 0
    for row in rows[1:]:
        cells = [c.strip() for c in row]
        if len(cells) != len(header) or not all(cells):
            skipped += 1
            continue
        for h, c in zip(header, cells):
            cols[h].append(c)
    if not cols["sent0"]:
        raise UserError(f"{flag} {path}: no complete rows under the header.")
    if skipped:
        print(f"note: {path}: skipped {skipped} incomplete rows", file=sys.stderr)
    return cols


def load_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """{'text': [...]} for a text file, {'sent0','sent1'[,'hard_neg']} for a CSV, each file
    read once (read_once)."""
    if str(path).lower().endswith(".csv"):
        return dict(read_csv_columns(path, flag))
    return {"text": read_sentences(path, flag)}


def data_rows(path: str | Path) -> int:
    """Examples in --data: its sentences, or its CSV rows (the file read once: read_once)."""
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
        """input_ids and attention_mask for rows `idx`, padded to the longest row of the
        batch, or to `pad_to` (static shapes for compiled steps)."""
        width = pad_to or int(self.lengths[idx].max())
        ids = torch.from_numpy(self.ids[idx, :width].astype(np.int64))      # (B, L)
        mask = torch.arange(width)[None, :] < torch.from_numpy(self.lengths[idx].astype(np.int64))[:, None]
        return {"input_ids": ids, "attention_mask": mask.long()}           # (B, L), (B, L)


def _tokenizer_key(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(vocab.items())[:2000]).encode())
    h.update(str(len(vocab)).encode())
    h.update(str(getattr(tokenizer, "do_lower_case", "")).encode())
    return h.hexdigest()[:16]


def tokenize(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None = None,
             desc: str = "tokenizing") -> Tokens:
    """Tokenise with the fast tokenizer in large chunks (no tokenisation inside the training
    step) into a (n, max_len) array; cached as .npz keyed by tokenizer, max_len and content."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\n")
    key = f"tok-{_tokenizer_key(tokenizer)}-L{max_len}-{h.hexdigest()[:16]}.npz"
    cache = Path(cache_dir) / key if cache_dir is not None else None
    if cache is not None and cache.is_file():
        z = np.load(cache)
        return Tokens(z["ids"], z["lengths"], int(z["pad_id"]))
    n = len(texts)
    dtype = np.uint16 if len(tokenizer) < 65536 else np.int32
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((n, max_len), pad_id, dtype=dtype)
    lengths = np.zeros(n, dtype=np.int32)
    # the Rust tokenizer directly (a copy, so the caller's settings stay as they are): both
    # cores, and no offsets or Python-side dicts, which cost a third of the time at 1M lines
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_len)
    backend.no_padding()
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    chunk = 20000
    bar = progress(total=n, desc=desc, unit="sent", disable=n < 50000)
    for s in range(0, n, chunk):
        inputs = texts[s:s + chunk]
        for j, e in enumerate(encode_batch(inputs)):
            row = e.ids
            ids[s + j, :len(row)] = row
            lengths[s + j] = len(row)
        bar.update(len(inputs))
    bar.close()
    tok = Tokens(ids, lengths, pad_id)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp.npz")
            np.savez(tmp, ids=ids, lengths=lengths, pad_id=pad_id)
            os.replace(tmp, cache)
        except OSError as e:  # a read-only place only costs a re-tokenisation next time
            print(f"note: could not cache tokens in {cache.parent}: {e}", file=sys.stderr)
    return tok


def tokenize_columns(args: Any, tokenizer, columns: dict[str, list[str]],
                     max_len: int | None = None) -> dict[str, Tokens]:
    """Tokenise every column of load_columns() with the encoder's tokenizer (cached)."""
    cache = default_cache_dir(args.data, args.cache_dir)
    return {k: tokenize(tokenizer, v, max_len or args.max_len, cache, desc=f"tokenizing {k}")
            for k, v in columns.items()}


def pad_batch(b: dict[str, torch.Tensor], width: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a {"input_ids", "attention_mask"[, ...]} batch to `width` columns: input_ids
    with `pad_id`, every other field (the mask, token types) with 0."""
    return {k: F.pad(v, (0, width - v.shape[1]), value=pad_id if k == "input_ids" else 0)
            for k, v in b.items()}                                         # (N, width) each


def concat_batches(batches: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stack several {"input_ids", "attention_mask"} batches along rows, padding to the widest,
    so that they go through the encoder in ONE forward pass."""
    width = max(b["input_ids"].shape[1] for b in batches)
    padded = [pad_batch(b, width, pad_id) for b in batches]
    return {k: torch.cat([b[k] for b in padded]) for k in padded[0]}


def default_cache_dir(data_path: str | Path, cache_dir: str | None) -> Path:
    """--cache_dir when given, else a .cache folder beside the data when that is writable."""
    if cache_dir:
        return Path(cache_dir)
    folder = Path(data_path).resolve().parent
    if os.access(folder, os.W_OK):
        return folder / ".cache"
    return Path(tempfile.gettempdir()) / "cl-sent-cache"


# =====================================================================================
# Models: encoder loading, poolers
# =====================================================================================

POOLERS = ["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2"]


def encoder_config(name: str, flag: str = "--model"):
    """The config of a hub name or a local folder (no weights loaded): what TrainArgs.check
    reads the encoder's maximum positions from."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise _not_loaded(flag, name, e)


@functools.lru_cache(maxsize=4)
def encoder_positions(name: str, flag: str = "--model") -> int:
    """max_positions of encoder `name`, from its config alone; read once, however many checks
    ask (TrainArgs.check, and ConIsI's, whose pairs take twice --max_len)."""
    return max_positions(encoder_config(name, flag))


def _not_loaded(flag: str, name: str, e: Exception) -> UserError:
    return UserError(f"{flag} {name}: could not load it ({str(e).splitlines()[0]}). Give a local folder "
                     f"with config.json, weights and tokenizer, or a hub name with the hub reachable.")


def load_encoder(name: str, dropout: float | None = None, flag: str = "--model"):
    """(tokenizer, encoder) from a hub name or a local folder, with SDPA attention.
    `dropout` overrides hidden and attention dropout (IFCL's rho)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the run's own progress bar is the one that matters
    config = encoder_config(name, flag)
    if dropout is not None:
        for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
            if hasattr(config, k):
                setattr(config, k, dropout)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=True)
        encoder = AutoModel.from_pretrained(name, config=config, attn_implementation="sdpa",
                                            dtype=torch.float32)
    except OSError as e:
        raise _not_loaded(flag, name, e)
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{flag} {name}: no fast tokenizer (tokenizer.json) was found; this project "
                        f"needs one.")
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
    """SimCSE's poolers on a Hugging Face encoder output -> (N, d).

    cls = [CLS] through the MLP; cls_before_pooler = raw last-layer [CLS]; avg = masked mean
    of the last layer; avg_first_last / avg_top2 need output_hidden_states=True."""
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


def max_positions(config, tokenizer=None) -> int:
    """Tokens a sentence may have in this encoder (and its tokenizer, when given)."""
    n = getattr(config, "max_position_embeddings", 512)
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        n -= 2  # RoBERTa's positions start after the padding index
    tm = getattr(tokenizer, "model_max_length", n)
    return int(min(n, tm)) if tm and tm < 10**8 else int(n)


def make_encode(encoder: nn.Module, tokenizer, pooler: str, mlp: nn.Module | None = None,
                batch_size: int = 128) -> Callable[[list[str]], np.ndarray]:
    """encode(sentences) -> (n, d) float32 numpy, for evaluation: eval mode, no grad, bf16 on
    CUDA, sorted by length, padded to the longest of each batch, truncated only to the
    model's maximum positions (never to the training max_len)."""
    hidden = pooler in ("avg_first_last", "avg_top2")

    @torch.no_grad()
    def encode(sentences: list[str]) -> np.ndarray:
        was_training = encoder.training
        encoder.eval()
        if mlp is not None:
            mlp.eval()
        device = next(encoder.parameters()).device
        max_len = max_positions(encoder.config, tokenizer)
        enc = tokenizer(list(sentences), truncation=True, max_length=max_len, padding=False,
                        return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        order = np.argsort([len(x) for x in enc], kind="stable")
        out = np.zeros((len(sentences), encoder.config.hidden_size), np.float32)   # (n, d)
        pad = tokenizer.pad_token_id or 0
        for s in range(0, len(order), batch_size):
            rows = [enc[i] for i in order[s:s + batch_size]]
            lengths = np.array([len(r) for r in rows])
            mask = np.arange(lengths.max())[None, :] < lengths[:, None]           # (B, L)
            ids = np.full(mask.shape, pad, dtype=np.int64)
            ids[mask] = np.concatenate(rows)                                    # (B, L)
            ids, mask = torch.from_numpy(ids).to(device), torch.from_numpy(mask).long().to(device)
            with autocast(device):
                o = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=hidden)
                z = pool(o, mask, pooler, mlp)                              # (B, d)
            out[order[s:s + batch_size]] = z.float().cpu().numpy()             # one copy a batch
        encoder.train(was_training)
        if mlp is not None:
            mlp.train(was_training)
        return out

    return encode


def autocast(device: torch.device | str):
    """bf16 autocast on CUDA, nothing (fp32) elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fp32(fn: Callable) -> Callable:
    """Decorator for the losses (and the log's figures from embeddings): run fn in fp32 under
    any autocast. Under bf16 autocast the cosine matrix would come out of the matmul in bf16,
    and a .float() after it cannot restore what was rounded (about 0.04 in a logit at tau
    0.05); the official SimCSE and Focal code compute the similarities in fp32. So autocast is
    off inside fn, and every floating tensor argument (in a list too) below fp32 is cast up to
    fp32 (fp64 stays fp64). Gradients go back to the inputs in their own dtype."""
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


# =====================================================================================
# Distributed (torchrun): the contrastive loss sees the global batch
# =====================================================================================

def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed() -> torch.device:
    """Start the process group under torchrun (NCCL on CUDA, gloo on CPU) and pick the device."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


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
        rank, n = dist.get_rank(), dist.get_world_size()
        return grad.chunk(n, 0)[rank].contiguous()


def barrier() -> None:
    """Wait for every rank under torchrun; nothing in one process."""
    if world()[1] > 1:
        dist.barrier()


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP over `model`. Every trainable parameter must get a gradient every step: a weight no
    loss uses would leave its gradient bucket unreduced. train() freezes the one such weight
    the encoders carry (BERT's NSP pooler), so DDP is not asked to search the autograd graph
    for unused parameters every step; the torchrun tests run every script and its ablations."""
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)


def gather(x: torch.Tensor) -> torch.Tensor:
    """(n_local, ...) -> (n_local * world, ...): every rank's rows, in rank order, with the
    gradient kept for this rank's rows. Identity in one process. Gather every tensor a loss
    uses, so that each rank computes the same global loss."""
    if world()[1] == 1:
        return x
    return _GatherWithGrad.apply(x)


# =====================================================================================
# The training loop
# =====================================================================================

def make_step(model: nn.Module, params: list, opt, sched, device: torch.device,
              max_grad_norm: float = 1.0, world_size: int = 1, amp: bool = True):
    """The training step, as every script trains: step(batch) -> (loss, {name: figure}).
    FastStep (the Fast path section) runs the same step faster on CUDA, and the tests hold it
    to this definition."""
    def step(batch):
        with autocast(device) if amp else contextlib.nullcontext():
            out = model(batch)                       # loss, or (loss, {name: 0-dim tensor})
        loss, stats = out if isinstance(out, tuple) else (out, {})
        # under DDP each rank computes the same global loss (gather keeps only its own rows'
        # gradient) and DDP averages the gradients: times world_size gives the one-process one
        (loss * world_size).backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        opt.step()                                   # AdamW
        sched.step()                                 # linear decay
        opt.zero_grad(set_to_none=True)
        return loss.detach().float(), {k: v.detach().float() for k, v in stats.items()}
    return step


def train(args: TrainArgs, model: nn.Module, data: dict[str, Tokens], tokenizer, encoder: nn.Module,
          pooler: str, mlp: nn.Module | None = None, output_dir: str | Path | None = None,
          paper: dict | None = None, paper_name: str = "paper", log_extra: Callable[[], dict] | None = None,
          should_stop: Callable[[int, float], bool] | None = None, final_eval: bool = True,
          stop_every: int | None = None) -> dict:
    """Train `model` on `data`; keep the best checkpoint of `encoder` (+ `mlp` for the `cls`
    pooler) by STS-B dev. model(batch) -> loss or (loss, {name: 0-dim tensor} to log), batch =
    {column: {"input_ids": (B, L), "attention_mask": (B, L)}}, rows aligned across columns.
    log_extra() adds figures to each evaluation; should_stop(step, mean loss since its last
    call), called every `stop_every` steps (default: at each evaluation) and at the last step,
    ends training when True: the run is then evaluated and checkpointed at that step, so that
    last/ and the last dev figure are of the weights it stopped with (its state_dict() goes
    into last/).
    Returns {"best_dev", "best_step", "steps", "stopped_early", "last_dev", "test"}."""
    out, (rank, world_size) = Path(output_dir or args.output_dir), world()
    device = next(model.parameters()).device
    n = len(next(iter(data.values())))
    steps_per_epoch, local_bs = n // args.batch_size, args.batch_size // world_size
    # the epochs, or --max_steps if it is given and shorter (or if --epochs is 0)
    total = min(s for s in (steps_per_epoch * args.epochs, args.max_steps) if s > 0)
    opt, sched, step_fn = make_training(model, encoder, args, total, device, world_size)
    if rank == 0:
        hold_run_folder(out)  # start() holds --output_dir already; this is for RCL's entropy models
    run = RunFolder(out, args, model, opt, sched, should_stop, encoder, tokenizer, pooler, mlp)
    st = run.resume() if args.resume else {}
    step, best, best_step = st.get("step", 0), st.get("best", -float("inf")), st.get("best_step", 0)
    last = st.get("dev")      # the record of the last evaluation
    meter, bar = Meter(device), progress(total, Path(sys.argv[0]).stem or "train", "step", rank != 0, step)
    encode = make_encode(_unwrap(encoder), tokenizer, pooler, mlp)
    pad_to = args.max_len if device.type == "cuda" else None  # static shapes for the CUDA graph
    stopped, plan_epoch = "early" if st.get("stopped_early") else None, -1
    meter.load_check_state(st.get("since_check"))
    check_every = stop_every or args.eval_every
    while step < total and stopped is None:
        epoch, b = divmod(step, steps_per_epoch)
        if epoch != plan_epoch:
            plan, plan_epoch = batch_plan(n, args.batch_size, args.seed, epoch), epoch
        idx = plan[b, rank * local_bs:(rank + 1) * local_bs]          # this rank's share of the batch
        loss, stats = step_fn(device_batch(data, idx, pad_to, device))
        step += 1
        meter.add(loss, stats, args.batch_size)
        bar.update(1)
        if should_stop is not None and (step % check_every == 0 or step == total) \
                and should_stop(step, meter.loss_since_check()):
            stopped = "early"
        evaluate_now = step % args.eval_every == 0 or step == total or stopped == "early"
        if step % args.log_every == 0 or evaluate_now:
            if bool(meter.bad):
                stopped = "nan"
                break
            rec = meter.log_record(step, float(sched.get_last_lr()[0]), epoch)
            run.log.write(rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", sent_s=f"{rec['sent_per_s']:.0f}")
        if evaluate_now:
            if rank == 0:
                last = {"step": step, **evaluate_dev(encode, args.sts_dir)}
                last.update(log_extra() if log_extra else {})
                improved = last["stsb_dev"] > best
                best, best_step = (last["stsb_dev"], step) if improved else (best, best_step)
                run.save(dict(last, best_stsb_dev=best), best_step, improved, stopped == "early",
                         meter.check_state())
                bar.write(f"step {step}: STS-B dev {last['stsb_dev']:.2f}  SICK-R dev {last['sickr_dev']:.2f}"
                          f"  (best {best:.2f} at step {best_step})")
            barrier()
    bar.close()
    if stopped == "nan":
        kept = f"is kept in {out / 'best'}" if best_step else "was not saved yet"
        raise UserError(f"the loss became NaN or infinite by step {step}. Training stopped; the best "
                        f"checkpoint so far {kept}. Try a lower --lr, or check the data for degenerate lines.")
    result = {"best_dev": best, "best_step": best_step, "steps": step, "test": None,
              "stopped_early": stopped == "early" and step < total, "last_dev": (last or {}).get("stsb_dev")}
    if final_eval and rank == 0:
        result["test"] = final_report(out / "best", args.sts_dir, pooler, paper, paper_name)
    barrier()
    return result


def make_training(model: nn.Module, encoder: nn.Module, args: TrainArgs, total: int,
                  device: torch.device, world_size: int):
    """(AdamW, its schedule, the step) for `model`, as train() runs them."""
    frozen = getattr(_unwrap(encoder), "pooler", None)  # BERT's NSP pooler: in no loss (the `cls`
    if frozen is not None:                                # MLP is saved into it)
        frozen.requires_grad_(False)
    model.train()  # from_pretrained() hands the encoder back in eval mode: dropout would be off
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, args.lr, args.weight_decay, device)
    sched = linear_decay(opt, total)
    train_model = wrap_ddp(model, device) if world_size > 1 else model
    return opt, sched, pick_step(train_model, params, opt, sched, device, args.max_grad_norm, world_size,
                                 args.compile)


def pick_step(model: nn.Module, params: list, opt, sched, device: torch.device, max_grad_norm: float,
              world_size: int, compile_: bool):
    """The step train() runs: make_step's on a CPU; on CUDA the same step compiled and replayed
    from a CUDA graph (FastStep)."""
    if device.type == "cuda":
        return FastStep(model, params, opt, sched, device, max_grad_norm, world_size, compile_)
    return make_step(model, params, opt, sched, device, max_grad_norm, world_size)


def linear_decay(opt, total: int):
    """The learning rate from its peak down to 0 over `total` steps, in a straight line, no
    warm-up (SimCSE's HF Trainer default); stepped once a step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))


def make_optimizer(params: list, lr: float, weight_decay: float, device: torch.device):
    """AdamW as every script trains with it. On CUDA: the fused kernel (one pass over weights,
    gradients and moments), built capturable with the learning rate in a GPU tensor, so that
    the step can be replayed from a CUDA graph and still see the scheduler's lr (the scheduler
    writes into that tensor). Elsewhere: the plain AdamW with a float lr."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=torch.tensor(lr, device=device), weight_decay=weight_decay,
                                 fused=True, capturable=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def start(args: TrainArgs) -> torch.device:
    """What every script does before it loads a model: torchrun's process group, every flag
    checked (args.check(), which downloads the default data on first use), the seed, and an
    output folder that loses nothing already written, with the resolved Args and the script's
    name in it."""
    device = init_distributed()
    args.check()                     # nothing is written before this passes
    seed_everything(args.seed)
    if world()[0] == 0:
        out = prepare_output_dir(args.output_dir, args.resume)
        write_text_atomic(out / "args.json", json.dumps(dataclasses.asdict(args), indent=2, default=str))
        # NOTE(ours): beside args.json, not in it, so that args.json stays exactly the Args;
        # `compare` labels the run's row with it
        write_text_atomic(out / "run.json", json.dumps({"script": _script_name(args)}, indent=2))
    barrier()
    return device


def ensure_data(args: TrainArgs) -> None:
    """Download wiki1m, the NLI triplets or the STS data into data/ on first use, when the
    flag still points at the default place and the file is not there yet."""
    if not Path(args.sts_dir).exists() and Path(args.sts_dir) == DATA_DIR / "sts":
        download(DATA_DIR, what=["sts"])
    data = Path(args.data)
    if not data.exists() and data in (DATA_DIR / WIKI1M, DATA_DIR / NLI):
        download(DATA_DIR, what=["wiki1m" if data.name == WIKI1M else "nli"])


def prepare_output_dir(output_dir: str | Path, resume: bool) -> Path:
    """Take the run folder for this process (hold_run_folder: a second process stops here), and
    refuse to run over an earlier run's folder unless --resume: nothing written is lost."""
    out = Path(output_dir)
    new = not out.exists()
    hold_run_folder(out)
    try:
        return _check_run_folder(out, resume)
    except UserError:
        if new:                            # the folder this call made for its lock, and nothing else
            release_run_folders(out)
            shutil.rmtree(out, ignore_errors=True)
        raise


def _check_run_folder(out: Path, resume: bool) -> Path:
    recover_dir(out / "best")
    recover_dir(out / "last")
    if not resume and ((out / "metrics.jsonl").exists() or (out / "best").exists()):
        raise UserError(f"--output_dir {out} already holds a run. Add --resume to continue it, or "
                        f"choose another --output_dir (or delete the folder) to start afresh.")
    started = (out / "args.json").exists() or (out / "metrics.jsonl").exists()
    # a run stopped before its first checkpoint resumes from step 0 (train() empties its log)
    if resume and not (out / "last" / "state.pt").exists() and not started:
        raise UserError(f"--resume: no checkpoint to resume in {out / 'last'}. Run without "
                        f"--resume to start, or point --output_dir at the earlier run.")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _script_name(args: Any) -> str:
    """The file that defines this Args (simcse.py, ...), run as a program or imported."""
    module = type(args).__module__
    path = getattr(sys.modules.get(module), "__file__", None)
    return Path(path).name if path else module


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def batch_plan(n: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """(steps, batch_size) indices for one epoch: a seeded shuffle, last partial batch dropped
    (NOTE(ours): every step has the full batch of negatives; at most batch_size-1 sentences
    of an epoch go unused)."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n)
    steps = n // batch_size
    return perm[: steps * batch_size].reshape(steps, batch_size)


def device_batch(data: dict[str, Tokens], idx: np.ndarray, pad_to: int | None,
                 device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """The rows `idx` of every column, as tensors on the device (pinned for an async copy)."""
    pin = device.type == "cuda"
    return {k: {kk: (vv.pin_memory() if pin else vv).to(device, non_blocking=True)
                for kk, vv in col.batch(idx, pad_to).items()}
            for k, col in data.items()}


def check_batch(n: int, batch_size: int, data: str, world_size: int = 1) -> None:
    if batch_size > n:
        raise UserError(f"--batch_size {batch_size} is larger than the data ({n} examples in "
                        f"--data {data}). Lower --batch_size to at most {n} or give more data.")
    if batch_size % world_size:
        raise UserError(f"--batch_size {batch_size} must divide evenly over {world_size} GPUs.")


def progress(total: int | None, desc: str, unit: str = "it", disable: bool = False, initial: int = 0):
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable,
                dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


def _unwrap(m: nn.Module) -> nn.Module:
    m = getattr(m, "module", m)          # DDP
    return getattr(m, "_orig_mod", m)    # torch.compile


class Meter:
    """The log's running figures: mean loss and extra terms between two log lines, sentences/s,
    the mean loss since should_stop's last call, and whether any loss was NaN or
    infinite. The sums stay on the device: reading them, once a log line, is the only wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.since_check, self.steps_since_check = torch.zeros((), device=device), 0
        self._restart()

    def _restart(self) -> None:
        self.loss, self.steps, self.stats, self.sentences = torch.zeros((), device=self.device), 0, {}, 0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], sentences: int) -> None:
        self.bad |= ~torch.isfinite(loss)
        self.loss += loss
        self.since_check += loss
        self.steps += 1
        self.steps_since_check += 1
        self.sentences += sentences
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0) + v

    def log_record(self, step: int, lr: float, epoch: int) -> dict:
        dt = time.perf_counter() - self.t0
        rec = {"step": step, "loss": float(self.loss) / self.steps, "lr": lr,
               "sent_per_s": self.sentences / dt if dt > 0 else 0.0, "epoch": epoch,
               **{k: float(v) / self.steps for k, v in self.stats.items()}}
        self._restart()
        return rec

    def loss_since_check(self) -> float:
        mean = float(self.since_check) / self.steps_since_check
        self.since_check, self.steps_since_check = torch.zeros((), device=self.device), 0
        return mean

    def check_state(self) -> list:
        """The loss sum and step count since should_stop's last call, for last/: a resume
        between two calls gives the next call the same mean as an uninterrupted run."""
        return [float(self.since_check), self.steps_since_check]

    def load_check_state(self, state: list | None) -> None:
        if state is not None:
            self.since_check = torch.tensor(state[0], device=self.device)
            self.steps_since_check = state[1]


class MetricsLog:
    """metrics.jsonl: one JSON object a line ({"step": ..., "loss": ..., ...}), easy to plot.
    Only ever appended to; every checkpoint keeps the log's length in bytes (size()), and a
    resume cuts the log back to it (truncate()): whatever a kill left after the checkpoint
    (records of steps trained again, a line cut short) goes, whatever came before stays."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def size(self) -> int:
        return self.path.stat().st_size if self.enabled and self.path.exists() else 0

    def truncate(self, size: int) -> None:
        """On --resume: back to `size` bytes, the length last/ recorded. One system call, so a
        kill leaves the log cut or not, and the next resume cuts it to the same length."""
        if not self.enabled or not self.path.exists():
            return
        if self.path.stat().st_size < size:
            print(f"note: {self.path} is shorter than when {self.path.parent / 'last'} was written "
                  f"(edited or replaced?); it is kept as it is", file=sys.stderr)
            return
        os.truncate(self.path, size)


class RunFolder:
    """What train() writes into --output_dir: metrics.jsonl, last/ (everything --resume needs:
    the run's one commit point) and best/ (the best encoder by STS-B dev, loadable anywhere)."""

    def __init__(self, out: Path, args: TrainArgs, model: nn.Module, opt, sched, should_stop,
                 encoder: nn.Module, tokenizer, pooler: str, mlp: nn.Module | None):
        self.out, self.args, self.model, self.opt, self.sched = out, args, model, opt, sched
        self.should_stop, self.encoder, self.tokenizer = should_stop, encoder, tokenizer
        self.pooler, self.mlp = pooler, mlp
        self.log = MetricsLog(out / "metrics.jsonl", enabled=world()[0] == 0)

    def save_best(self, rec: dict) -> None:
        save_pretrained_dir(self.out / "best", self.encoder, self.tokenizer, self.pooler, self.mlp,
                            extra={"args.json": dataclasses.asdict(self.args), "dev_metrics.json": rec})

    def save(self, rec: dict, best_step: int, improved: bool, stopped_early: bool = False,
             since_check: list | None = None) -> None:
        """One evaluation, in the order a kill may interrupt: the record, then last/ with the
        log's length (a resume cuts the log back to it) and whether should_stop ended training
        here, then best/ (re-saved on resume if a kill left it behind last/)."""
        self.log.write(rec)
        tmp, commit = _atomic_dir(self.out / "last")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "step": rec["step"], "best": rec["best_stsb_dev"],
                    "best_step": best_step, "dev": rec, "log_bytes": self.log.size(),
                    "stopped_early": stopped_early, "since_check": since_check,
                    "should_stop": getattr(self.should_stop, "state_dict", lambda: None)(),
                    "rng_cpu": torch.get_rng_state(),
                    "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   tmp / "state.pt")
        commit()
        if improved:
            self.save_best(rec)

    def resume(self) -> dict:
        """--resume: bring back what save() kept, cut metrics.jsonl back to the length last/
        recorded, re-save best/ if it fell one evaluation behind. {} for a run stopped before
        its first checkpoint (it starts from step 0, its log emptied)."""
        main_proc, last = world()[0] == 0, self.out / "last"
        if not (last / "state.pt").exists():
            self.log.truncate(0)
            if main_proc:
                print(f"no checkpoint in {last} yet: training starts from step 0", file=sys.stderr)
            return {}
        device = next(self.model.parameters()).device
        st = torch.load(last / "state.pt", map_location=device, weights_only=False)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.log.truncate(st["log_bytes"])
        if main_proc and st["best_step"] == st["step"] and _saved_step(self.out / "best") != st["step"]:
            self.save_best(st["dev"])
        if st.get("should_stop") is not None and hasattr(self.should_stop, "load_state_dict"):
            self.should_stop.load_state_dict(st["should_stop"])
        torch.set_rng_state(st["rng_cpu"])
        if device.type == "cuda" and st.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(st["rng_cuda"])
        if main_proc:
            print(f"resuming {self.out} at step {st['step']} (best STS-B dev {st['best']:.2f} at step "
                  f"{st['best_step']})", file=sys.stderr)
        return st


def _saved_step(folder: Path) -> int | None:
    """The step a checkpoint folder was saved at (its dev_metrics.json), None if it has none."""
    try:
        return json.loads((folder / "dev_metrics.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def evaluate_dev(encode: Callable[[list[str]], np.ndarray], sts_dir: str | Path) -> dict:
    """STS-B dev and SICK-R trial, the figures the run is steered by."""
    dev = evaluate_sts(encode, sts_dir, split="dev")
    return {"stsb_dev": dev["STSBenchmark"]["spearman"], "sickr_dev": dev["SICKRelatedness"]["spearman"],
            "avg_dev": dev["avg"]}


def final_report(best_dir: Path, sts_dir: str | Path, pooler: str, paper: dict | None,
                 paper_name: str) -> dict:
    """Reload the best checkpoint as a user would, evaluate the 7 STS tasks, print the table
    beside the paper's numbers and store the results (and the pooler: `compare` labels the
    run with it) in the checkpoint folder."""
    res = evaluate_encoder(str(best_dir), pooler, sts_dir)
    print(format_sts_table(res, paper, paper_name))
    write_text_atomic(best_dir / "test_metrics.json", json.dumps({**res, "pooler": pooler}, indent=2))
    return res


# =====================================================================================
# STS evaluation (../shared/specs/sts_protocol.md), as SimCSE's fork of SentEval does it
# =====================================================================================

STS_TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
STS_PAIR_COUNTS = {  # kept pairs, asserted by tests and by `download`
    "STS12": [750, 750, 459, 750, 399], "STS13": [189, 750, 561],
    "STS14": [450, 300, 750, 750, 750, 750], "STS15": [375, 750, 375, 750, 750],
    "STS16": [254, 249, 230, 244, 209],
    "STSBenchmark": {"train": 5749, "dev": 1500, "test": 1379},
    "SICKRelatedness": {"train": 4500, "dev": 500, "test": 4927},
}
TASK_SHORT = {"STS12": "STS12", "STS13": "STS13", "STS14": "STS14", "STS15": "STS15",
              "STS16": "STS16", "STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}


def _norm(s: str) -> str:
    # Step 4: whitespace-split and re-join (the files are already tokenised)
    return " ".join(s.split())


def load_sts_pairs(data_dir: str | Path, task: str, split: str = "test") -> dict[str, tuple]:
    """{subset: (sent1 list, sent2 list, gold array)} for one task, parsed per the spec."""
    d = Path(data_dir)
    if task in STS_SUBSETS:
        year = task[3:]
        out = {}
        for sub in STS_SUBSETS[task]:
            folder = d / "STS" / f"STS{year}-en-test"
            inp, gs = folder / f"STS.input.{sub}.txt", folder / f"STS.gs.{sub}.txt"
            pairs = [l.split("\t") for l in inp.read_text(encoding="utf-8").splitlines()]
            gold = gs.read_text(encoding="utf-8").splitlines()
            if len(pairs) != len(gold) or any(len(p) != 2 for p in pairs):
                raise UserError(f"{inp}: expected one tab-separated pair per gold line of {gs}")
            # Step 1: drop the pairs whose gold line is empty
            keep = [i for i, g in enumerate(gold) if g != ""]
            out[sub] = ([_norm(pairs[i][0]) for i in keep], [_norm(pairs[i][1]) for i in keep],
                        np.array([float(gold[i]) for i in keep]))
        return out
    if task == "STSBenchmark":
        path = d / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        rows = [l.strip().split("\t") for l in path.read_text(encoding="utf-8").splitlines()]
        # Step 2: gold = column 4, sentences = columns 5 and 6
        return {split: ([_norm(r[5]) for r in rows], [_norm(r[6]) for r in rows],
                        np.array([float(r[4]) for r in rows]))}
    if task == "SICKRelatedness":
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        rows = [l.strip().split("\t") for l in (d / "SICK" / name).read_text(encoding="utf-8").splitlines()[1:]]
        # Step 3: skip the header; sentences = columns 1 and 2, gold = column 3
        return {split: ([_norm(r[1]) for r in rows], [_norm(r[2]) for r in rows],
                        np.array([float(r[3]) for r in rows]))}
    raise ValueError(f"unknown STS task {task!r}; one of {STS_TASKS}")


def cosine_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Row-wise cosine; a zero vector gives 0, never NaN (step 5)."""
    u, v = u.astype(np.float64), v.astype(np.float64)
    nu, nv = np.linalg.norm(u, axis=1), np.linalg.norm(v, axis=1)
    den = nu * nv
    return np.where(den > 0, (u * v).sum(1) / np.where(den > 0, den, 1), 0.0)


def _spearman(sims: np.ndarray, gold: np.ndarray) -> float:
    r = spearmanr(sims, gold)[0]
    return 0.0 if np.isnan(r) else float(r) * 100


def is_sts_dir(folder: str | Path) -> bool:
    """Whether `folder` holds SentEval's STS/ and SICK/ folders."""
    return (Path(folder) / "STS").is_dir() and (Path(folder) / "SICK").is_dir()


def check_sts_dir(sts_dir: str | Path) -> None:
    """--sts_dir must hold SentEval's STS/ and SICK/ folders: checked before training starts
    (TrainArgs.check) and before every evaluation."""
    if not is_sts_dir(sts_dir):
        raise UserError(f"--sts_dir {sts_dir}: expected STS/ and SICK/ inside (SentEval's layout). "
                        f"Run `python common.py download` and pass --sts_dir data/sts.")


def evaluate_sts(encode: Callable[[list[str]], np.ndarray], data_dir: str | Path,
                 tasks: list[str] | None = None, split: str = "test") -> dict:
    """Spearman x100 of cosine similarity on the STS tasks, per ../shared/specs/sts_protocol.md.

    split="test": the 7 tasks (STS12-16 report "all": one Spearman over the task's pairs
    concatenated); split="dev": STS-B dev and SICK-R trial. res["avg"] = mean of the reported
    figures. Every distinct sentence is encoded once."""
    data_dir = Path(data_dir)
    check_sts_dir(data_dir)
    if tasks is None:
        tasks = STS_TASKS if split == "test" else ["STSBenchmark", "SICKRelatedness"]
    loaded = {t: load_sts_pairs(data_dir, t, split) for t in tasks}
    uniq = sorted({s for subs in loaded.values() for a, b, _ in subs.values() for s in a + b})
    emb = encode(uniq)                                                      # (U, d)
    row = {s: i for i, s in enumerate(uniq)}
    res: dict[str, Any] = {}
    for t, subs in loaded.items():
        sims_all, gold_all, per = [], [], {}
        for name, (a, b, gold) in subs.items():
            sims = cosine_rows(emb[[row[s] for s in a]], emb[[row[s] for s in b]])
            per[name] = {"spearman": _spearman(sims, gold), "n": len(gold)}
            sims_all.append(sims)
            gold_all.append(gold)
        n = sum(p["n"] for p in per.values())
        r = {"spearman": _spearman(np.concatenate(sims_all), np.concatenate(gold_all)), "n": n}
        if t in STS_SUBSETS:
            r["subsets"] = per
            r["mean"] = float(np.mean([p["spearman"] for p in per.values()]))
            r["wmean"] = float(sum(p["spearman"] * p["n"] for p in per.values()) / n)
        res[t] = r
    res["avg"] = float(np.mean([res[t]["spearman"] for t in tasks]))
    return res


def alignment_uniformity(encode: Callable[[list[str]], np.ndarray], data_dir: str | Path,
                         split: str = "dev") -> dict[str, float]:
    """Wang & Isola (2020) as SimCSE reports them, on STS-B (step 11): alignment = mean
    ||f(x)-f(x+)||^2 over pairs with gold > 4; uniformity = log mean exp(-2||f(x)-f(y)||^2)
    over all distinct pairs of the split's sentences; f L2-normalised.
    NOTE(ours): the dev split by default (the split SimCSE tunes on), test by flag."""
    a, b, gold = load_sts_pairs(data_dir, "STSBenchmark", split)[split]
    pos = gold > 4
    sents = sorted(set(a) | set(b))
    emb = torch.from_numpy(encode(sents)).double()
    f = F.normalize(emb, dim=-1)                                            # (U, d)
    row = {s: i for i, s in enumerate(sents)}
    fa = f[[row[s] for s, p in zip(a, pos) if p]]                           # (P, d)
    fb = f[[row[s] for s, p in zip(b, pos) if p]]                           # (P, d)
    align = (fa - fb).norm(dim=1).pow(2).mean()
    sq = torch.pdist(f).pow(2)                                              # (U(U-1)/2,)
    unif = sq.mul(-2).exp().mean().log()
    return {"alignment": float(align), "uniformity": float(unif)}


def evaluate_encoder(model: str, pooler: str, sts_dir: str | Path, tasks: list[str] | None = None,
                     split: str = "test", batch_size: int = 128) -> dict:
    """evaluate_sts of an encoder as saved (hub name or folder), read off with `pooler`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok, enc = load_encoder(model)
    enc.to(device)
    mlp = mlp_from_pooler(enc, model) if pooler == "cls" else None
    return evaluate_sts(make_encode(enc, tok, pooler, mlp, batch_size), sts_dir, tasks=tasks, split=split)


def format_sts_table(res: dict, paper: dict | None = None, paper_name: str = "paper") -> str:
    """The 7-task table, with a row of the paper's numbers beside ours when given."""
    tasks = [t for t in STS_TASKS if t in res]
    head = f"{'':14s}" + "".join(f"{TASK_SHORT[t]:>8s}" for t in tasks) + f"{'Avg.':>8s}"
    lines = [head, f"{'this run':14s}" + "".join(f"{res[t]['spearman']:8.2f}" for t in tasks)
             + f"{res['avg']:8.2f}"]
    if paper:
        lines.append(f"{paper_name[:14]:14s}" + "".join(
            f"{paper[t]:8.2f}" if t in paper else f"{'-':>8s}" for t in tasks)
            + (f"{paper['avg']:8.2f}" if "avg" in paper else f"{'-':>8s}"))
    lines.append("Spearman x100 of cosine similarity; STS12-16 report 'all' (one correlation over "
                 "each task's pairs); STS-B and SICK-R on their test sets.")
    return "\n".join(lines)


# =====================================================================================
# Checkpoints: Hugging Face + sentence-transformers in one folder, written atomically
# =====================================================================================

ST_POOLING = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}


def _atomic_dir(final: Path) -> tuple[Path, Callable[[], None]]:
    """A temporary folder beside `final` and a commit() that swaps it into place: a run
    killed at any moment leaves either the old folder or the new one, never half of one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))

    def commit():
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old)

    return tmp, commit


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small file through a temporary name: a kill leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# run folders this process holds: resolved path -> the open lock file (its flock lives with it)
_HELD: dict[str, Any] = {}
LOCK = "run.lock"


def hold_run_folder(folder: str | Path) -> None:
    """Take `folder` for this process: an OS lock (flock) on <folder>/run.lock, which the system
    drops when the process ends, however it ends (kill -9 and a crash included), so a dead
    run leaves nothing that blocks its --resume. A second process stops here with a UserError
    that names the folder and the process holding it, before it writes anything else. Taking a
    folder this process already holds is a no-op. NOTE(ours): where there is no fcntl
    (Windows), folders are not locked."""
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _HELD or fcntl is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK, "a+")          # "a+": a process that loses must not erase the holder's line
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"--output_dir {folder} is in use by {holder}. One process at a time trains "
                        f"in a run folder: wait for that one to end (or stop it), then continue the "
                        f"run with --resume; or choose another --output_dir.")
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} ({shlex.join([Path(sys.executable).name] + sys.argv)})\n")
    f.flush()
    _HELD[key] = f


def release_run_folders(*folders: str | Path) -> None:
    """Let go of the given run folders (all, with none given) before the process ends: for a
    process that trains several runs one after the other (the tests)."""
    keys = [str(Path(f).resolve()) for f in folders] if folders else list(_HELD)
    for k in keys:
        f = _HELD.pop(k, None)
        if f is not None:
            f.close()                      # closing the file drops its flock


def recover_dir(final: Path) -> Path:
    """What a kill during _atomic_dir leaves: between the two renames the old folder is still
    whole (put back); a temporary folder never swapped in is dropped (it holds a full copy)."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_pretrained_dir(path: str | Path, encoder: nn.Module, tokenizer, pooler: str,
                        mlp: nn.Module | None = None, extra: dict[str, Any] | None = None) -> None:
    """Save an encoder so that both AutoModel.from_pretrained(path) and SentenceTransformer(path)
    load it with no conversion. With the `cls` pooler the MLP goes into BERT's own pooler
    weights (pooler_output = tanh(W h_cls + b) is exactly the MLP) and into a
    sentence-transformers Dense module with Tanh. `extra` = {filename: json-able}."""
    path = Path(path)
    tmp, commit = _atomic_dir(path)
    model = _unwrap(encoder)
    if pooler == "cls":
        if mlp is None:
            raise ValueError("pooler 'cls' is saved with its MLP")
        pooler_mod = getattr(model, "pooler", None)
        if pooler_mod is not None and hasattr(pooler_mod, "dense"):
            pooler_mod.dense.load_state_dict(_unwrap(mlp).dense.state_dict())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if pooler not in ST_POOLING:
        print(f"note: sentence-transformers has no '{pooler}' pooling; {path} loads with "
              f"AutoModel only", file=sys.stderr)
    else:
        d = model.config.hidden_size
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": d,
            "pooling_mode_cls_token": ST_POOLING[pooler] == "cls",
            "pooling_mode_mean_tokens": ST_POOLING[pooler] == "mean",
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
            "include_prompt": True}, indent=2))
        if pooler == "cls":
            from safetensors.torch import save_file
            dense = _unwrap(mlp).dense
            (tmp / "2_Dense").mkdir()
            (tmp / "2_Dense" / "config.json").write_text(json.dumps({
                "in_features": d, "out_features": d, "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh"}, indent=2))
            save_file({"linear.weight": dense.weight.detach().float().cpu().contiguous(),
                       "linear.bias": dense.bias.detach().float().cpu().contiguous()},
                      str(tmp / "2_Dense" / "model.safetensors"))
            modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                            "type": "sentence_transformers.models.Dense"})
        (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
        (tmp / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_positions(model.config, tokenizer),
             "do_lower_case": False}, indent=2))
    for name, obj in (extra or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=2, default=str))
    commit()


# =====================================================================================
# Fast path: make_step's step compiled and replayed from a CUDA graph. A reader of the papers can
# skip this section: it changes how fast a step runs, not what it computes.
#
# What it does, on CUDA: torch.compile fuses the forward and backward (inductor); AdamW runs
# as one fused kernel that also applies the gradient clipping; after GRAPH_WARMUP ordinary
# steps the whole step (forward, backward, clip, update) is captured once in a CUDA graph
# and then replayed as a single launch per batch, instead of about 850 kernel launches from
# Python, which at batch 64 take longer than the GPU's own work.
# What it buys (bert-base, batch 64, max_len 32, one H100; `python simcse.py bench`, README
# "Speed"): 9.98 ms a step against 66.23 ms for the plain fp32 eager step, 6.6x. Against
# torch.compile(mode="reduce-overhead") with the same clipping, the one graph for the whole
# step measured 10.81 against 10.88 ms (one run each, on different H100s).
# The private hooks it needs, and why: opt.grad_scale (fused AdamW divides each gradient by
# it as it reads it: GradScaler's unscale hook, used here to clip without another pass over
# the gradients); torch._foreach_norm (the global gradient norm in one kernel).
# =====================================================================================

GRAPH_WARMUP = 2  # steps run normally before the capture: the first compiles, the second settles

# warm-up steps run outside a graph, which capturable=True warns about once: expected here
warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")


def clip_divisor(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """max(1, (||g|| + 1e-6) / max_norm) over all gradients together: dividing by it is
    clip_grad_norm_'s multiplication by min(1, max_norm / (||g|| + 1e-6)). 0-dim tensor."""
    norms = torch._foreach_norm(grads)                                        # one () per tensor
    total = torch.linalg.vector_norm(torch.stack(norms))                      # ()
    return torch.clamp((total + 1e-6) / max_norm, min=1.0)                    # ()


def _attention_backends():
    """The attention kernels a training step may use: every one PyTorch has but cuDNN's.
    NOTE(ours): at 32 tokens PyTorch picks cuDNN's attention on an H100, and it took 1.9 ms of
    a 10.5 ms bert-base step; the memory-efficient kernel that comes next takes 1.2 ms (`bench
    --profile`). Nothing changes on a CPU, which has no cuDNN attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _brief(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


class FastStep:
    """make_step's step, fast: step(batch) -> (loss, {name: figure}), the same numbers.

    compile_ compiles the forward and backward with torch.compile (inductor on CUDA;
    compile_="cpu" compiles on the CPU too, with the aot_eager backend, for the tests); if
    compilation fails, the step says so once and runs eager. With `graph` (by default: CUDA,
    compiled, one process, an optimizer from make_optimizer) the step is captured in a CUDA
    graph on call GRAPH_WARMUP + 1 and replayed from then on. The replay reads the batch from
    fixed buffers (train() pads every batch to --max_len on CUDA; a batch of another shape runs
    uncaptured) and draws fresh dropout each time (CUDA graphs advance the RNG offset per
    replay). If the capture fails, the step says so once and goes on uncaptured.
    NOTE(ours): no CUDA graph under DDP, whose all-reduce hooks run between the pieces of the
    backward; a multi-GPU step is compiled but launched kernel by kernel."""

    def __init__(self, model: nn.Module, params: list, opt, sched, device: torch.device,
                 max_grad_norm: float = 1.0, world_size: int = 1, compile_: bool | str = True,
                 graph: bool | None = None):
        cuda = device.type == "cuda"
        self.model, self.params, self.opt, self.sched, self.device = model, params, opt, sched, device
        self.max_grad_norm, self.world_size = max_grad_norm, world_size
        self.compiled = bool(compile_) and (cuda or compile_ == "cpu")
        self.fwd = torch.compile(model, backend="inductor" if cuda else "aot_eager") if self.compiled else model
        self.fused_clip = all(g.get("fused") for g in opt.param_groups)   # clip inside fused AdamW
        if graph is None:
            graph = cuda and bool(compile_) and world_size == 1 and all(
                g.get("capturable") and torch.is_tensor(g["lr"]) for g in opt.param_groups)
        self.warming_up = graph      # steps before the one capture attempt, on a side stream
        self.calls = 0
        self.graph = None            # the captured step, once captured
        self.static = None           # the batch buffers the graph reads
        self.graph_out = None        # the loss and figures the graph writes
        self.side = None             # the side stream of the warm-up steps

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict]:
        self.calls += 1
        if self.warming_up and self.calls > GRAPH_WARMUP:
            self.warming_up = False
            self._capture(batch)              # once; on failure the step stays uncaptured
        if self.graph is not None and self._same_shapes(batch):
            out = self._replay(batch)
        elif self.warming_up:                 # as CUDA graph capture asks: lazy handles and
            if self.side is None:             # allocations made on a side stream
                self.side = torch.cuda.Stream()
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                out = self._uncaptured(batch)
            torch.cuda.current_stream().wait_stream(self.side)
        else:
            out = self._uncaptured(batch)
        self.sched.step()
        return out

    def _forward_backward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        with autocast(self.device), _attention_backends():
            out = self.fwd(batch)
        loss, stats = out if isinstance(out, tuple) else (out, {})
        (loss * self.world_size).backward()
        return loss, stats

    def _clip_and_update(self) -> None:
        if self.max_grad_norm > 0 and self.fused_clip:
            # fused AdamW divides each gradient by opt.grad_scale as it reads it
            self.opt.grad_scale = clip_divisor([p.grad for p in self.params if p.grad is not None],
                                               self.max_grad_norm)
        elif self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.opt.step()
        self.opt.__dict__.pop("grad_scale", None)

    @staticmethod
    def _kept(loss: torch.Tensor, stats: dict) -> tuple[torch.Tensor, dict]:
        """Copies that outlive the step (a replay overwrites the graph's outputs)."""
        return loss.detach().float().clone(), {k: v.detach().float().clone() for k, v in stats.items()}

    def _uncaptured(self, batch: dict) -> tuple[torch.Tensor, dict]:
        self.opt.zero_grad(set_to_none=True)  # after a replay .grad is the graph's memory
        try:
            loss, stats = self._forward_backward(batch)
        except (torch.cuda.OutOfMemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # a platform where the compiler cannot run: fall back to eager
            if not self.compiled:
                raise
            print(f"note: the compiled step failed ({_brief(e)}); running eager from here on "
                  f"(pass --no-compile to skip compiling)", file=sys.stderr)
            self.fwd, self.compiled = self.model, False
            self.opt.zero_grad(set_to_none=True)
            loss, stats = self._forward_backward(batch)
        self._clip_and_update()
        out = self._kept(loss, stats)
        self.opt.zero_grad(set_to_none=True)
        return out

    def _capture(self, batch: dict) -> None:
        static = {k: {kk: vv.clone() for kk, vv in col.items()} for k, col in batch.items()}
        self.opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                loss, stats = self._forward_backward(static)
                self._clip_and_update()
        except (torch.cuda.OutOfMemoryError, KeyboardInterrupt):
            raise
        except Exception as e:
            print(f"note: capturing the step in a CUDA graph failed ({_brief(e)}); running it "
                  f"uncaptured (slower)", file=sys.stderr)
            self.opt.__dict__.pop("grad_scale", None)
            self.opt.zero_grad(set_to_none=True)
            return
        self.graph, self.static, self.graph_out = graph, static, (loss, stats)

    def _same_shapes(self, batch: dict) -> bool:
        st = self.static
        return batch.keys() == st.keys() and all(
            col.keys() == st[k].keys() and all(v.shape == st[k][kk].shape for kk, v in col.items())
            for k, col in batch.items())

    def _replay(self, batch: dict) -> tuple[torch.Tensor, dict]:
        for k, col in batch.items():
            for kk, v in col.items():
                self.static[k][kk].copy_(v, non_blocking=True)
        self.graph.replay()
        return self._kept(*self.graph_out)


# =====================================================================================
# Command line: download, eval, compare, bench
# =====================================================================================

# -------------------------------------------------------------------------------------
# download: the real data from upstream, proven whole by content before it is kept
# -------------------------------------------------------------------------------------

WIKI1M_LINES = 1_000_000  # SimCSE's wiki1m: the papers' "10^6 sentences"
NLI_HEADER = "sent0,sent1,hard_neg"


def _fetch(url: str, dest: Path) -> None:
    """Stream `url` into `dest` with a progress bar."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0)
            bar = progress(total=size or None, desc=dest.name.split(".part")[0], unit="B")
            while chunk := r.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
            bar.close()
    except OSError as e:
        raise UserError(f"could not download {url}: {e}. Check the network, or pass --base_url "
                        f"to a mirror.")


def check_wiki1m(path: Path, expected_lines: int | None = None) -> None:
    """wiki1m is whole when it has exactly 1,000,000 lines (no checksum could be verified here)."""
    expected, name = expected_lines or WIKI1M_LINES, path.name.removesuffix(".part")
    lines = count_lines(path)
    if lines != expected:
        raise UserError(f"{name}: {lines} lines where {expected} were expected: the download "
                        f"is incomplete or corrupted. Run `python common.py download` again.")


def check_nli(path: Path) -> None:
    """nli_for_simcse.csv is whole when its header is sent0,sent1,hard_neg and every row parses
    into three cells."""
    name = path.name.removesuffix(".part")
    try:
        with open(path, encoding="utf-8", errors="strict", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            if ",".join(header) != NLI_HEADER:
                raise UserError(f"{name}: header {','.join(header)!r}, expected {NLI_HEADER!r}: the "
                                f"download is corrupted. Run `python common.py download` again.")
            for i, row in enumerate(reader, start=2):
                if len(row) != 3:
                    raise UserError(f"{name}: row {i} has {len(row)} cells, expected 3: the "
                                    f"download is incomplete. Run `python common.py download` again.")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 ({e.reason}): the download is corrupted. Run "
                        f"`python common.py download` again.")


def check_sts(folder: Path) -> None:
    """The STS data are whole when every task parses to the spec's kept pair counts."""
    for task in STS_TASKS:
        try:
            if task in STS_SUBSETS:
                got = [len(g) for _, _, g in load_sts_pairs(folder, task).values()]
                want = STS_PAIR_COUNTS[task]
            else:
                got = [len(load_sts_pairs(folder, task, s)[s][2]) for s in ("train", "dev", "test")]
                want = [STS_PAIR_COUNTS[task][s] for s in ("train", "dev", "test")]
        except (OSError, ValueError, IndexError, UserError) as e:
            raise UserError(f"STS data in {folder}: {task} cannot be read ({e}): the download is "
                            f"incomplete or corrupted. Run `python common.py download` again.")
        if got != want:
            raise UserError(f"STS data in {folder}: {task} has {got} pairs, expected {want}: the "
                            f"download is incomplete or corrupted.")


def download(dest: str | Path = DATA_DIR, base_url: str = UPSTREAM, what: list[str] | None = None,
             wiki1m_lines: int | None = None) -> dict[str, Path]:
    """Fetch wiki1m, the NLI triplets and the STS data under `dest`, skipping what is there.
    Each file is written to a temporary name and renamed only after its content check passes."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    what = what or ["wiki1m", "nli", "sts"]
    base = base_url.rstrip("/")
    got: dict[str, Path] = {}
    for item in what:
        if item == "wiki1m" or item == "nli":
            name, check = (WIKI1M, lambda p: check_wiki1m(p, wiki1m_lines)) if item == "wiki1m" \
                else (NLI, check_nli)
            final = dest / name
            if final.exists():
                print(f"{final}: present, not fetched again", file=sys.stderr)
            else:
                part = dest / f"{name}.part"
                _fetch(f"{base}/{name}", part)
                try:
                    check(part)
                except UserError:
                    part.unlink(missing_ok=True)
                    raise
                os.replace(part, final)
            got[item] = final
        elif item == "sts":
            final = dest / "sts"
            if is_sts_dir(final):
                print(f"{final}: present, not fetched again", file=sys.stderr)
            else:
                with tempfile.TemporaryDirectory(dir=dest, prefix=".sts-") as tmp:
                    tmp = Path(tmp)
                    tar = tmp / SENTEVAL
                    _fetch(f"{base}/{SENTEVAL}", tar)
                    try:
                        with tarfile.open(tar) as tf:
                            tf.extractall(tmp / "x", filter="data")
                    except (tarfile.TarError, EOFError) as e:
                        raise UserError(f"{SENTEVAL}: not a readable tar archive ({e}): the "
                                        f"download is corrupted. Run `python common.py download` again.")
                    # the archive holds SentEval's downstream/ folder: find STS/ beside SICK/
                    roots = [p.parent for p in (tmp / "x").rglob("STS12-en-test")]
                    if not roots or not (roots[0].parent / "SICK").is_dir():
                        raise UserError(f"{SENTEVAL}: no STS/ and SICK/ folders inside: the download "
                                        f"is corrupted or not SentEval's archive.")
                    stage = tmp / "sts"
                    stage.mkdir()
                    shutil.move(str(roots[0]), stage / "STS")
                    shutil.move(str(roots[0].parent / "SICK"), stage / "SICK")
                    check_sts(stage)
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(stage, final)
            got[item] = final
        else:
            raise UserError(f"--what {item}: unknown; choose from wiki1m, nli, sts.")
    return got

# -------------------------------------------------------------------------------------
# eval: the 7 STS tasks of any encoder
# -------------------------------------------------------------------------------------

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
    cmds = {"eval": cmd_eval, "download": cmd_download, "compare": cmd_compare}
    if argv[:1] == ["bench"]:
        raise UserError("bench times a script's real step: `python simcse.py bench --help`.")
    if not argv or argv[0] not in cmds:
        print(__doc__)
        raise UserError(f"choose a command: {', '.join(cmds)} (e.g. `python common.py eval --help`)")
    cmds[argv[0]](argv[1:])


def cmd_eval(argv: list[str]) -> None:
    a = parse_args(EvalArgs, argv)
    check_ranges(a)
    t = time.perf_counter()
    res = evaluate_encoder(a.model, a.pooler, a.sts_dir, a.tasks or None, a.split, a.batch_size)
    if a.split == "test" and not a.tasks:
        print(format_sts_table(res))
    else:
        for k, v in res.items():
            if k != "avg":
                print(f"{k:16s} {v['spearman']:.2f}  (n={v['n']})")
        print(f"{'avg':16s} {res['avg']:.2f}")
    print(f"({a.model}, pooler {a.pooler}, {time.perf_counter() - t:.1f}s)", file=sys.stderr)
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=2))


def cmd_download(argv: list[str]) -> None:
    a = parse_args(DownloadArgs, argv)
    for k, p in download(a.dest, a.base_url, a.what).items():
        print(f"{k}: {p}")


# -------------------------------------------------------------------------------------
# compare: finished runs side by side (mean +- std over seeds), and their STS-B dev curves
# -------------------------------------------------------------------------------------

# NOTE(ours): fields that cannot change a run's numbers; runs that differ only in these (and
# in seed, output_dir) are seeds of one configuration
COMPARE_IGNORED = ("seed", "output_dir", "resume", "cache_dir", "log_every")


@dataclass
class CompareArgs:
    baseline: str = arg("", "also evaluate this untrained encoder (hub name or folder), as the first row")
    pooler: str = arg("cls_before_pooler", "pooler of the --baseline row", "SimCSE official code",
                      choices=POOLERS)
    sts_dir: str = arg("data/sts", "STS/ and SICK/ for the --baseline row (SentEval's layout)")
    batch_size: int = arg(128, "sentences per forward pass of the --baseline evaluation", ge=1)
    markdown: str = arg("", "also write the table as Markdown to this file (for the README)")
    plot: str = arg("", "draw each run's STS-B dev curve over the steps into this image (.png, .pdf "
                    "or .svg; needs matplotlib). Folders with metrics.jsonl but no final result "
                    "(an unfinished run, RCL's entropy_phi*/) are drawn, not tabled")


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not readable JSON ({e}). Was the file cut short or edited by hand?")
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object.")
    return obj


def read_run(folder: str | Path, plot: bool = False) -> dict:
    """One folder given to `compare`: {"path", "args" (args.json or None), "script", "test" (the
    7-task result or None: drawn only), "pooler"}. Anything else is a UserError that names it."""
    p = Path(folder)
    if not p.is_dir():
        raise UserError(f"{p}: no such folder. Pass the --output_dir of a training run.")
    args_f, test_f, log_f = p / "args.json", p / "best" / "test_metrics.json", p / "metrics.jsonl"
    if p.name == "best" and (p.parent / "args.json").is_file():
        raise UserError(f"{p}: this is a run's checkpoint folder; pass the run folder {p.parent} instead.")
    if not args_f.is_file() and not log_f.is_file():
        raise UserError(f"{p}: not a run folder (no args.json, no metrics.jsonl in it). Pass the "
                        f"--output_dir of a training run.")
    finished = args_f.is_file() and test_f.is_file()
    if not finished and not plot:
        if not args_f.is_file():
            raise UserError(f"{p}: no args.json, so not the --output_dir of a run (RCL's entropy_phi*/ "
                            f"folders are part of one). Its STS-B dev curve can be drawn with --plot FILE.png.")
        raise UserError(f"{p}: unfinished run: no best/test_metrics.json, which a run writes when it "
                        f"ends (this one is still going, was interrupted, or stopped on a NaN loss). "
                        f"Finish it with its command plus --resume, or leave it out (--plot still draws it).")
    if not finished and not log_f.is_file():
        raise UserError(f"{p}: unfinished run with no metrics.jsonl yet: nothing to table or draw. "
                        f"Leave it out.")
    run = {"path": p, "args": _read_json(args_f) if args_f.is_file() else None, "test": None}
    run["script"] = _read_json(p / "run.json").get("script") if (p / "run.json").is_file() else None
    if finished:
        run["test"] = _read_json(test_f)
        if not _result_tasks(run["test"]) or not isinstance(run["test"].get("avg"), (int, float)):
            raise UserError(f"{test_f}: no STS task results and average in it. Is it the file a run wrote?")
    # NOTE(ours): runs from before the pooler was recorded: every script that has a --pooler
    # flag evaluates with it; the others (ifcl.py, conisi.py) stay unknown
    run["pooler"] = (run["test"] or {}).get("pooler") or (run["args"] or {}).get("pooler")
    return run


def _result_tasks(res: dict) -> list[str]:
    """The tasks of an evaluate_sts result, the 7 STS tasks first, in their order."""
    got = [k for k, v in res.items() if isinstance(v, dict) and "spearman" in v]
    return [t for t in STS_TASKS if t in got] + sorted(t for t in got if t not in STS_TASKS)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ",".join(_fmt_value(x) for x in v)
    return str(v)


def _short_paths(values: list[str]) -> dict[str, str]:
    """The fewest trailing path parts that still tell the values apart (model and data paths)."""
    uniq = sorted(set(values))
    for n in range(1, max(len(Path(v).parts) for v in uniq) + 1):
        short = {v: "/".join(Path(v).parts[-n:]) for v in uniq}
        if len(set(short.values())) == len(uniq):
            return short
    return {v: v for v in uniq}


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs whose args.json agree on everything but COMPARE_IGNORED, with the same script and
    pooler, form one group: {"runs", "label", "finished"}, in the order first given. A label
    names the script (or, for a run from before scripts were recorded, its folder), the
    flags whose values differ between groups, and the pooler of the final evaluation."""
    groups: dict[Any, dict] = {}
    for r in runs:
        if r["args"] is None:   # drawn only (an RCL entropy model): a group of its own
            key: Any = ("folder", str(r["path"]))
        else:
            kept = {k: v for k, v in r["args"].items() if k not in COMPARE_IGNORED}
            key = (r["test"] is not None, r["script"], r["pooler"],
                   json.dumps(kept, sort_keys=True, default=str))
        groups.setdefault(key, {"runs": [], "finished": r["test"] is not None})["runs"].append(r)
    out = list(groups.values())
    # the flags that tell groups apart: a field whose value is not the same in every group that has it
    with_args = [g for g in out if g["runs"][0]["args"] is not None]
    keys = sorted({k for g in with_args for k in g["runs"][0]["args"]} - set(COMPARE_IGNORED) - {"pooler"})
    differing = {}
    for k in keys:
        vals = [g["runs"][0]["args"][k] for g in with_args if k in g["runs"][0]["args"]]
        if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1:
            strs = [_fmt_value(v) for v in vals]
            short = _short_paths(strs) if any("/" in s for s in strs) else {s: s for s in strs}
            differing[k] = short
    for g in out:
        first = g["runs"][0]
        if first["args"] is None:
            parent = first["path"].parent
            script = (_read_json(parent / "run.json").get("script")
                      if (parent / "run.json").is_file() else None)
            g["label"] = f"{script or parent.name} {first['path'].name}"
            continue
        names = [str(r["path"]) for r in g["runs"]]
        head = first["script"] or (os.path.commonprefix(names).rstrip("-_./") or names[0])
        flags = [f"{k}={differing[k][_fmt_value(first['args'][k])]}" for k in differing if k in first["args"]]
        pooler = first["pooler"] or "pooler not recorded"
        g["label"] = " ".join([head, *flags, f"[{pooler}]"]) + ("" if g["finished"] else " (unfinished)")
    return out


def compare_table(groups: list[dict], baseline: tuple[str, dict] | None = None) -> dict:
    """{"tasks", "rows": [{"label", "n", "mean": {task: x}, "std": {task: x or None}}]}: the
    mean over a group's seeds of each task and of the average, with the sample std (ddof=1)
    when there are two seeds or more. Every run must hold the same tasks."""
    finished = [g for g in groups if g["finished"]]
    tasks: list[str] | None = None
    for g in finished:
        for r in g["runs"]:
            t = _result_tasks(r["test"])
            if tasks is None:
                tasks, first = t, r["path"]
            elif t != tasks:
                raise UserError(f"{r['path']}: its best/test_metrics.json holds {', '.join(t)}, but "
                                f"{first}'s holds {', '.join(tasks)}. Compare runs evaluated on the "
                                f"same tasks (in separate commands), or re-evaluate one with "
                                f"`python common.py eval --model {r['path']}/best --output ...`.")
    tasks = tasks or (_result_tasks(baseline[1]) if baseline else list(STS_TASKS))
    rows = []
    if baseline:
        label, res = baseline
        rows.append({"label": label, "n": None, "runs": [],
                     "mean": {**{t: res[t]["spearman"] for t in tasks}, "avg": res["avg"]},
                     "std": {t: None for t in tasks + ["avg"]}})
    for g in finished:
        per_run = np.array([[r["test"][t]["spearman"] for t in tasks] + [r["test"]["avg"]]
                            for r in g["runs"]], dtype=np.float64)            # (n, tasks + 1)
        n = len(g["runs"])
        mean = per_run.mean(0)
        std = per_run.std(0, ddof=1) if n >= 2 else [None] * len(mean)
        rows.append({"label": g["label"], "n": n, "runs": [r["path"] for r in g["runs"]],
                     "mean": dict(zip(tasks + ["avg"], map(float, mean))),
                     "std": dict(zip(tasks + ["avg"], [None if s is None else float(s) for s in std]))})
    return {"tasks": tasks, "rows": rows}


def _cell(row: dict, t: str) -> str:
    m, s = row["mean"][t], row["std"][t]
    return f"{m:.2f}" if s is None else f"{m:.2f} ± {s:.2f}"


COMPARE_NOTE = ("Spearman x100 of cosine similarity on the test sets; [..] = the pooler of the final "
                "evaluation; n seeds: mean ± sample std (ddof=1).")


def format_compare(table: dict) -> str:
    """The table as plain text, one row a group."""
    cols = [TASK_SHORT.get(t, t) for t in table["tasks"]] + ["Avg."]
    cells = [[_cell(r, t) for t in table["tasks"] + ["avg"]] for r in table["rows"]]
    lw = max([3] + [len(r["label"]) for r in table["rows"]])
    cw = max([len(c) for c in cols] + [len(c) for row in cells for c in row]) + 2
    lines = [f"{'run':{lw}s}{'n':>4s}" + "".join(f"{c:>{cw}s}" for c in cols)]
    for r, row in zip(table["rows"], cells):
        n = "-" if r["n"] is None else r["n"]
        lines.append(f"{r['label']:{lw}s}{n:>4}" + "".join(f"{c:>{cw}s}" for c in row))
    lines.append(COMPARE_NOTE)
    return "\n".join(lines)


def format_compare_markdown(table: dict, command: str) -> str:
    """The table as Markdown, with the command that made it."""
    cols = ["run", "n"] + [TASK_SHORT.get(t, t) for t in table["tasks"]] + ["Avg."]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table["rows"]:
        cells = [r["label"].replace("|", "\\|"), "-" if r["n"] is None else str(r["n"])]
        lines.append("| " + " | ".join(cells + [_cell(r, t) for t in table["tasks"] + ["avg"]]) + " |")
    return "\n".join(lines) + f"\n\n{COMPARE_NOTE} Made with `{command}`.\n"


def dev_curve(folder: Path) -> tuple[list[int], list[float]]:
    """(steps, STS-B dev) from a run's metrics.jsonl: the records that have "stsb_dev"."""
    by_step = {}
    path = folder / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                if "stsb_dev" in rec:
                    by_step[int(rec["step"])] = float(rec["stsb_dev"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _pyplot():
    """matplotlib's pyplot (no display needed), or a UserError that says how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed: `pip install matplotlib` "
                        "(nothing else in this project needs it), or leave out --plot.")
    return plt


def plot_dev_curves(groups: list[dict], path: str | Path) -> None:
    """Each run's STS-B dev curve over the steps, one colour a group (every seed drawn: the
    spread shows), labelled as the table labels its rows."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, g in enumerate(groups):
        color = f"C{i % 10}"
        n = len(g["runs"])
        for j, r in enumerate(g["runs"]):
            steps, dev = dev_curve(r["path"])
            ax.plot(steps, dev, marker="o", markersize=3, color=color, alpha=1.0 if n == 1 else 0.7,
                    label=f"{g['label']}, n={n}" if j == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("STS-B dev (Spearman x100)")
    ax.set_title("STS-B dev over training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_compare(argv: list[str]) -> None:
    """python common.py compare RUN [RUN ...] [--baseline MODEL --pooler P] [--markdown F] [--plot F]"""
    parser = build_parser(CompareArgs, description="The 7 STS tasks of finished runs side by side: "
                          "runs that differ only in --seed (and --output_dir) form one row, mean ± std.")
    parser.usage = "%(prog)s RUN [RUN ...] [options]"
    parser.prog = "python common.py compare"
    parser.add_argument("runs", nargs="*", metavar="RUN", help="run folders (a script's --output_dir)")
    given = vars(parser.parse_args(argv))
    folders = given.pop("runs")
    a = CompareArgs(**given)
    check_ranges(a)
    if not folders:
        raise UserError("compare: give at least one run folder, e.g. `python common.py compare "
                        "runs/simcse runs/focal_infonce` (to score an encoder alone: `python common.py eval`).")
    if "pooler" in given and not a.baseline:
        raise UserError("--pooler applies to the --baseline row only: add --baseline MODEL, or drop --pooler.")
    if a.plot and Path(a.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UserError(f"--plot {a.plot}: give a file name ending in .png, .pdf or .svg.")
    seen = set()
    for f in folders:
        if Path(f).resolve() in seen:
            raise UserError(f"{f}: given twice. Give each run folder once.")
        seen.add(Path(f).resolve())
    # everything is read and checked before anything is written or printed
    runs = [read_run(f, plot=bool(a.plot)) for f in folders]
    groups = group_runs(runs)
    table = compare_table(groups) if any(g["finished"] for g in groups) else None
    if a.markdown and table is None:
        raise UserError(f"--markdown {a.markdown}: none of the runs has finished: there is no table to write.")
    if a.plot:
        _pyplot()   # a missing matplotlib is said now, not after the table is out
        for r in runs:
            if r["test"] is None:
                print(f"note: {r['path']}: no final result; its curve is drawn, it is not in the table",
                      file=sys.stderr)
            if not dev_curve(r["path"])[0]:
                print(f"note: {r['path']}: no STS-B dev evaluation in metrics.jsonl: no curve",
                      file=sys.stderr)
    if a.baseline:
        tasks = table["tasks"] if table else None
        res = evaluate_encoder(a.baseline, a.pooler, a.sts_dir, tasks, "test", a.batch_size)
        name = Path(a.baseline).name or a.baseline
        table = compare_table(groups, (f"{name} untrained [{a.pooler}]", res))
    if table is not None:
        print(format_compare(table))
        for g in groups:   # which folders (and seeds) each row is made of
            if not g["finished"]:
                continue
            seeds = [r["args"].get("seed") for r in g["runs"]]
            print(f"  {g['label']}: " + ", ".join(f"{r['path']} (seed {sd})" for r, sd in zip(g["runs"], seeds))
                  + ("  NOTE: the same seed twice" if len(set(seeds)) < len(seeds) else ""), file=sys.stderr)
        if a.markdown:
            Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
            cmd = " ".join(["python common.py compare"] + [shlex.quote(x) for x in argv])
            Path(a.markdown).write_text(format_compare_markdown(table, cmd), encoding="utf-8")
            print(f"Markdown table: {a.markdown}", file=sys.stderr)
    if a.plot:
        plot_dev_curves(groups, a.plot)
        print(f"STS-B dev curves: {a.plot}", file=sys.stderr)

# -------------------------------------------------------------------------------------
# bench: a script's real training step, timed, against the plain fp32 eager step
# -------------------------------------------------------------------------------------

ARCHS = {  # standard architectures, so that no hub access is needed to build a random model
    "bert-base-uncased": dict(model_type="bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072),
    "bert-large-uncased": dict(model_type="bert", vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096),
    "roberta-base": dict(model_type="roberta", vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514,
                         pad_token_id=1, type_vocab_size=1),
    "roberta-large": dict(model_type="roberta", vocab_size=50265, hidden_size=1024, num_hidden_layers=24,
                          num_attention_heads=16, intermediate_size=4096, max_position_embeddings=514,
                          pad_token_id=1, type_vocab_size=1),
    "tiny": dict(model_type="bert", vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=128),
}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM: the denominator of the MFU column


def config_from(name: str):
    from transformers import AutoConfig
    if name in ARCHS:
        kw = dict(ARCHS[name])
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    if Path(name).is_file() or Path(name, "config.json").is_file():
        return AutoConfig.from_pretrained(name)
    raise UserError(f"--config {name}: not a known architecture ({', '.join(ARCHS)}) nor a "
                    f"config.json path.")


def forward_flops_per_token(config, seq_len: int) -> float:
    """2 x non-embedding weights + 4 x layers x seq_len x hidden: the usual estimate of a
    transformer's forward FLOPs per token (a backward costs twice a forward)."""
    from transformers import AutoModel
    with torch.device("meta"):
        m = AutoModel.from_config(config)
    # the pooler reads one token a sentence, so it is left out with the embeddings
    non_emb = sum(p.numel() for n, p in m.named_parameters() if "embeddings" not in n and "pooler" not in n)
    return 2 * non_emb + 4 * config.num_hidden_layers * seq_len * config.hidden_size


@dataclass
class BenchArgs:
    config: str = arg("bert-base-uncased", f"architecture ({', '.join(ARCHS)}) or a config.json path; "
                      "weights are random (same cost as real ones)")
    batch_size: int = arg(64, "sentences per step (each encoded twice: SimCSE's step)", "SimCSE paper App. A",
                          ge=1)
    max_len: int = arg(32, "tokens per sentence (every sentence padded to it)", "SimCSE paper App. A", ge=1)
    steps: int = arg(50, "timed steps per variant", ge=1)
    warmup: int = arg(15, "untimed steps first (compilation, CUDA-graph capture)", ge=0)
    baseline: bool = arg(True, "also time the plain fp32 eager step (official SimCSE without --fp16)")
    compile: bool = arg(True, "compile the project's step (CUDA only)")
    sts_dir: str = arg("", "if given, also time one evaluation of the 7 STS tasks")
    tokenizer: str = arg("", "tokenizer folder for the STS timing (bert-base-uncased's vocabulary: "
                         "any uncased BERT tokenizer)")
    seed: int = arg(0, "seed", ge=0)
    profile: str = arg("", "if given, profile 5 more project steps with torch.profiler: print the "
                       "top kernels, the GPU's busy time per step, and write a Chrome trace to this path")


def _profile_steps(step: Callable, batches: list, device: torch.device, trace: str, wall_ms: float) -> None:
    """Where a step's time goes: the top kernels (or CPU ops), and on CUDA how much of the
    measured wall time per step the GPU is busy (far below it: the step waits on Python)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for b in batches:
            step(b)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15))
    if cuda:
        busy_us = sum(e.self_device_time_total for e in events   # kernels and copies, not the
                      if e.device_type == torch.autograd.DeviceType.CUDA  # ranges around them
                      and not e.is_user_annotation)
        print(f"GPU busy {busy_us / 1e3 / len(batches):.2f} ms per step of {wall_ms:.2f} ms wall")
    Path(trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(trace)
    print(f"Chrome trace (open in chrome://tracing or ui.perfetto.dev): {trace}")


def time_step(step: Callable, batches: Callable[[int], dict], steps: int, warmup: int,
              device: torch.device) -> tuple[float, float, float]:
    """(ms a step, seconds of warm-up, last loss) of `steps` timed calls after `warmup` untimed
    ones; batches(i) makes batch i, its copy to the device inside the timed step."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = warm = time.perf_counter()
    for i in range(steps + warmup):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            warm, t0 = time.perf_counter() - t0, time.perf_counter()
        loss, _ = step(batches(i))
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, warm, float(loss)


def bench(argv: list[str], make_model: Callable[[nn.Module], nn.Module], prog: str) -> None:
    """Time a script's training step (`make_model(encoder)` is its model, random weights) as
    train() runs it, and the plain fp32 eager step, in one run: `python simcse.py bench`."""
    from transformers import AutoModel
    parser = build_parser(BenchArgs, description=bench.__doc__)
    parser.prog = prog
    a = BenchArgs(**vars(parser.parse_args(argv)))
    check_ranges(a)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config_from(a.config)
    n = a.batch_size * (a.steps + a.warmup)
    ids = np.random.default_rng(a.seed).integers(1000 if cfg.vocab_size > 2000 else 5, cfg.vocab_size,
                                                 size=(n, a.max_len))
    data = {"text": Tokens(ids.astype(np.int32), np.full(n, a.max_len, np.int32), 0)}
    plan = batch_plan(n, a.batch_size, a.seed, 0)
    flops = 3 * forward_flops_per_token(cfg, a.max_len) * 2 * a.batch_size * a.max_len  # encoded twice
    print(f"{a.config}: batch {a.batch_size} x2, max_len {a.max_len}, {flops / 1e12:.2f} TFLOP/step "
          f"(3 x forward), device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")

    def run(name: str, fast: bool) -> float:
        torch.manual_seed(a.seed)
        encoder = AutoModel.from_config(cfg, attn_implementation="sdpa" if fast else "eager")
        model = make_model(encoder).to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        total = a.steps + a.warmup
        opt = make_optimizer(params, 3e-5, 0.0, device) if fast else torch.optim.AdamW(params, lr=3e-5)
        sched = linear_decay(opt, total)
        step = (pick_step(model, params, opt, sched, device, 1.0, 1, a.compile) if fast
                else make_step(model, params, opt, sched, device, 1.0, 1, amp=False))
        ms, warm, loss = time_step(step, lambda i: device_batch(data, plan[i], a.max_len, device),
                                   a.steps, a.warmup, device)
        mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(f"{name:28s} {ms:8.2f} ms/step  {a.batch_size / ms * 1e3:9.0f} sent/s  "
              f"MFU {flops / (ms / 1e3) / H100_BF16_PEAK * 100:5.1f}%  peak {mem:5.2f} GiB  "
              f"(warm-up {warm:.1f}s, last loss {loss:.3f})")
        if fast and a.profile:
            _profile_steps(step, [device_batch(data, plan[i % len(plan)], a.max_len, device) for i in range(5)],
                           device, a.profile, ms)
        if device.type == "cuda":
            del model, opt, step
            torch.cuda.empty_cache()
        return ms

    fast_ms = run("project step" + (" (bf16, compiled)" if device.type == "cuda" else ""), True)
    if a.baseline:
        print(f"speed-up over the plain fp32 eager step: {run('plain fp32 eager step', False) / fast_ms:.2f}x")
    print(f"one epoch of 1M sentences at this speed: {1e6 / a.batch_size * fast_ms / 1e3 / 60:.1f} min "
          f"of training time")
    if a.sts_dir:
        name = a.tokenizer or (a.config if Path(a.config).is_dir() else "")
        if not name:
            print("(STS timing needs a tokenizer: pass --tokenizer)")
            return
        from transformers import AutoTokenizer
        enc = AutoModel.from_config(cfg, attn_implementation="sdpa").to(device)
        t = time.perf_counter()
        evaluate_sts(make_encode(enc, AutoTokenizer.from_pretrained(name), "cls_before_pooler"), a.sts_dir)
        print(f"7 STS tasks evaluated in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    run_main(cli)
