"""What a run is given, read and checked before anything is written: the training file (one
sentence a line, or SimCSE's CSV), each error naming the flag and the file; the token cache
beside the data; the encoder's config and positions; the STS folder's layout."""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from plumbing.process import UserError, writing


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
    sents = [s.strip() for s in read_text(Path(path), flag, "a text file with one sentence per line",
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
    rows = list(csv.reader(io.StringIO(read_text(Path(path), flag, "a CSV with columns sent0,sent1"
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


def read_text(path: Path, flag: str, what: str, download: str) -> str:
    """A training file's text, or a UserError that names the flag, the file and what to do."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file. Pass {what}.")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Pass {what}, or run `python tools/download.py` "
                        f"for {download}.")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{flag} {path}: line {line} is not UTF-8 ({e.reason} at byte {e.start}). "
                        f"Convert the file, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`.")


def count_lines(path: str | Path) -> int:
    """Lines of a file, read as bytes (any encoding, any size)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def token_cache(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None) -> Path | None:
    """The .npz that caches `texts` tokenised to max_len, keyed by the tokenizer and the texts."""
    if cache_dir is None:
        return None
    h, vocab = hashlib.sha256(), tokenizer.get_vocab()
    for part in (type(tokenizer).__name__, json.dumps(sorted(vocab.items())[:2000]), len(vocab),
                 getattr(tokenizer, "do_lower_case", ""), max_len, *texts):
        h.update(f"{part}\n".encode())
    return Path(cache_dir) / f"tok-{h.hexdigest()[:24]}.npz"

def load_tokens(cache: Path | None) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(ids, lengths, pad_id) kept in `cache` by an earlier tokenisation, or None."""
    if cache is None or not cache.is_file():
        return None
    z = np.load(cache)
    return z["ids"], z["lengths"], int(z["pad_id"])


def save_tokens(cache: Path | None, ids: np.ndarray, lengths: np.ndarray, pad_id: int) -> None:
    """Keep a tokenisation in `cache`, through a temporary name of this process's own (under
    torchrun every rank tokenises and writes) renamed into place."""
    if cache is None:
        return
    with writing(f"the token cache {cache}"):
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, ids=ids, lengths=lengths, pad_id=pad_id)
        os.replace(tmp, cache)



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
                        f"Run `python tools/download.py --what sts` and pass --sts_dir data/sts.")
