"""What a run is given, checked before anything is written, each error naming the flag and the file: the
training file, the token cache beside it, a model (a folder, the Hugging Face cache, the hub), its
config and files, the STS folder.

The rules, and the function that keeps each:
1. A bad input is one line that names the flag, the file and what to do (read_text, read_csv_columns,
   check_batch, check_model_folder, check_sts_dir): a missing, empty or non-UTF-8 --data, a batch
   larger than the data, a model folder cut short by an interrupted download.
2. Offline, a model is looked for in the local cache at once (hub_offline, model_missing): the hub is
   asked once a process and, silent, left alone, not retried for each missing file.
3. The token cache is only a cache (token_cache, load_tokens): named by all that decides the ids, read
   only when whole, never unpickled, and tokenised again otherwise.
4. A file is read once while unchanged (read_once): the checks and training read the same bytes.
"""

from __future__ import annotations

import codecs
import csv
import difflib
import functools
import hashlib
import io
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from plumbing.atomic_writes import write_atomic
from plumbing.errors import UserError, writing


def read_once(read: Callable) -> Callable:
    """Rule 4 for a reader read(path, flag), by size and mtime; callers must not change what it returns."""
    cached = functools.lru_cache(maxsize=2)(lambda path, flag, stamp: read(path, flag))

    @functools.wraps(read)
    def wrapped(path: str | Path, flag: str = "--data"):
        st = Path(path).stat() if Path(path).is_file() else None
        return cached(str(path), flag, st and (st.st_mtime_ns, st.st_size))
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


def read_columns(path: str | Path, flag: str = "--data") -> dict[str, list[str]]:
    """What --data holds: {'text': [...]} for a text file (read_sentences), or SimCSE's CSV's columns
    (read_csv_columns), by its suffix."""
    if str(path).lower().endswith(".csv"):
        return dict(read_csv_columns(path, flag))
    return {"text": read_sentences(path, flag)}


def read_text(path: Path, flag: str, what: str, download: str) -> str:
    """A training file's text, or a UserError that names the flag, the file and what to do."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file. Pass {what}.")
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path}: not a regular file (a pipe, a device or a socket). Pass {what}.")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file. Pass {what}, or run `python tools/download.py` "
                        f"for {download}.")
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)      # as spreadsheets save
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{flag} {path}: line {line} is not UTF-8 ({e.reason} at byte {e.start}). "
                        f"Convert the file, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`.")


def read_json_object(path: str | Path, any_json: bool = False):
    """The JSON object in `path` (any JSON with any_json), or a ValueError saying in a few words why not."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    except ValueError as e:             # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(str(e).splitlines()[0][:100] if str(e) else type(e).__name__) from None
    if not any_json and not isinstance(obj, dict):      # a run's record, a model's config
        raise ValueError("not a JSON object")
    return obj


def count_lines(path: str | Path) -> int:
    """Lines of a file, read as bytes (any encoding, any size)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def token_cache(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None) -> Path | None:
    """The .npz that caches `texts` tokenised to max_len, named by a SHA-256 of all that decides the
    ids: the tokenizer's whole JSON (a part of it missed two swapped ids), its size, max_len, each text."""
    if cache_dir is None:
        return None
    spec = json.loads(tokenizer.backend_tokenizer.to_str())    # less the last call's (tokenize sets its own):
    spec = {k: v for k, v in spec.items() if k not in ("truncation", "padding")}
    h = hashlib.sha256()
    for part in ("tokens 2", type(tokenizer).__name__, json.dumps(spec, sort_keys=True), len(tokenizer),
                 tokenizer.pad_token_id, max_len, len(texts)):
        h.update(f"{part}\n".encode())
    for text in texts:              # each with its length: no two lists of texts hash alike
        b = text.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return Path(cache_dir) / f"tok-{h.hexdigest()[:32]}.npz"


def load_tokens(cache: Path | None) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(ids, lengths, pad_id) kept in `cache`, or None, with a note if it is not whole (a copy cut short);
    never unpickled (allow_pickle=False)."""
    if cache is None or not os.path.lexists(cache):
        return None
    try:
        with open(cache, "rb") as f, np.load(f, allow_pickle=False) as z:
            ids, lengths, pad_id = z["ids"], z["lengths"], z["pad_id"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        print(f"note: the token cache {cache} is not whole ({why}): tokenising again", file=sys.stderr)
        return None
    return ids, lengths, int(pad_id)


def save_tokens(cache: Path | None, ids: np.ndarray, lengths: np.ndarray, pad_id: int) -> None:
    """Keep a tokenisation in `cache` with its key (write_atomic: all ranks write)."""
    if cache is None:
        return
    with writing(f"the token cache {cache} (or choose another place: --cache_dir)"):
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, lambda f: np.savez(f, ids=ids, lengths=lengths, pad_id=pad_id))


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


# -------------------------------------------------------------------------------------
# Where a model comes from: a folder here, or a hub name in the local cache or on the hub
# -------------------------------------------------------------------------------------

HUB_WAIT_S = 3.0    # how long the hub may take to answer before this process goes offline
MODEL = "the folder of a saved model (config.json, its weights and tokenizer), or a hub name"


@functools.cache
def hub_offline() -> str | None:
    """Why this process does not ask the hub, or None. HF_ENDPOINT is asked once: no answer in HUB_WAIT_S
    turns offline mode on, so the libraries read their cache at once (not retry each missing file 23 s)."""
    from huggingface_hub import constants, get_session
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1 keeps the hub from being asked"
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_WAIT_S)
    except Exception as e:          # the client's own errors (httpx's), raised from an OSError
        constants.HF_HUB_OFFLINE = True
        return f"the hub cannot be reached ({constants.ENDPOINT}: {str(e)[:100] or type(e).__name__})"
    return None


def _folders_like(path: Path) -> str:
    """Said of a folder not there: the folders beside it named like it, or its first parent not there."""
    if not path.parent.is_dir():
        missing = next(p for p in path.parents if p.parent.is_dir())
        return f" (there is no folder {missing} either)"
    beside = [p.name for p in path.parent.iterdir() if p.is_dir()]
    near = difflib.get_close_matches(path.name, beside, n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(str(path.parent / n) for n in near)}?)" if near else ""


def model_missing(name: str, flag: str = "--model", instead: str = "") -> str | None:
    """Why model `name` cannot be had (no folder here, no hub name in the local cache or on a hub
    that answers), in one line that says what to do, or None; `instead`: one more way out."""
    path = Path(name)
    if path.is_dir():
        return None
    if path.exists():
        return f"{flag} {name}: is a file. Pass {MODEL}.{instead}"
    from huggingface_hub import try_to_load_from_cache, utils
    try:
        utils.validate_repo_id(name)    # owner/model or model: a hub name
    except utils.HFValidationError:     # ./x, ../x, /x, x/, a/b/c: only a folder
        return f"{flag} {name}: no such folder{_folders_like(path)}. Pass {MODEL}.{instead}"
    if (why := hub_offline()) is None or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None     # the hub answers (transformers asks it), or the local cache holds the model
    near = _folders_like(path) if path.parent.is_dir() and path.parent != Path(".") else ""  # models/x typo
    local, offline = f"models/{path.name}", why.startswith("HF_HUB_OFFLINE")
    return (f"{flag} {name}: neither a folder here{near} nor in the local Hugging Face cache, and {why}. "
            f"{'Unset HF_HUB_OFFLINE' if offline else 'Connect'} to download it, or pass a local folder made "
            f"where the hub is reachable: `hf download {name} --local-dir {local}`, then {flag} {local}."
            f"{'' if offline else ' With HF_HUB_OFFLINE=1 the hub is not asked.'}{instead}")


def where_from(name: str, flag: str = "--model", instead: str = "") -> None:
    """model_missing as a UserError, asked first by every path that loads a model by name."""
    if why := model_missing(name, flag, instead):
        raise UserError(why)


def not_loaded(flag: str, name: str, e: BaseException) -> UserError:
    return UserError(f"{flag} {name}: could not load it ({str(e).splitlines()[0]}). Give a local folder "
                     f"with config.json, weights and tokenizer, or a hub name with the hub reachable.")


def encoder_config(name: str, flag: str = "--model"):
    """The config of a hub name or a local folder, no weights loaded (where_from asked first)."""
    from transformers import AutoConfig
    where_from(name, flag)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise not_loaded(flag, name, e)


def model_folder_problem(folder: Path) -> str | None:
    """What is wrong with a saved model's files (--model, a run's best/, end/), or None; no tensor loaded."""
    if not folder.is_dir():
        return f"{folder} is missing"
    for p in sorted([*folder.glob("*.json"), *folder.glob("*/*.json")]):
        try:
            read_json_object(p, any_json=True)
        except ValueError as e:
            return f"{p} is cut short or damaged (not JSON: {str(e)[:80]})"
    index = folder / "model.safetensors.index.json"
    shards = sorted({folder / f for f in read_json_object(index)["weight_map"].values()}) \
        if index.is_file() else [folder / "model.safetensors"]
    if not all(p.is_file() for p in shards):
        shards = [folder / "pytorch_model.bin"]
        if not shards[0].is_file():
            return f"{folder} holds no weights (model.safetensors or pytorch_model.bin)"
    import torch
    from safetensors import safe_open
    for p in shards:
        try:
            if p.suffix == ".bin":      # a pickle: weights_only refuses one that would run code
                torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            else:
                with safe_open(str(p), "np"):     # the header, and that the file holds all it lists
                    pass
        except Exception as e:          # SafetensorError, UnpicklingError, RuntimeError (a cut zip), EOFError
            return f"{p} is cut short or damaged ({str(e).splitlines()[0][:120]})"
    return None


def check_model_folder(name: str, flag: str = "--model") -> None:
    """A local model folder's files, checked before anything is written (the hub checks its own)."""
    if Path(name).is_dir() and (problem := model_folder_problem(Path(name))):
        raise UserError(f"{flag} {name}: {problem}. Save or download the model again, or give another "
                        f"folder.")


def max_positions(config, tokenizer=None) -> int:
    """Tokens a sentence may have in this encoder (and its tokenizer, when given)."""
    n = getattr(config, "max_position_embeddings", 512)
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        n -= 2  # RoBERTa's positions start after the padding index
    return int(min(n, getattr(tokenizer, "model_max_length", None) or n))   # unknown to a tokenizer: 1e30


@functools.lru_cache(maxsize=4)
def encoder_positions(name: str, flag: str = "--model") -> int:
    """max_positions of encoder `name` from its config alone, read once (start's check, ConIsI's)."""
    return max_positions(encoder_config(name, flag))


def check_sts_dir(sts_dir: str | Path) -> None:
    """--sts_dir holds SentEval's STS/ and SICK/ folders: checked by start and before every evaluation."""
    if not ((Path(sts_dir) / "STS").is_dir() and (Path(sts_dir) / "SICK").is_dir()):
        raise UserError(f"--sts_dir {sts_dir}: expected STS/ and SICK/ inside (SentEval's layout). "
                        f"Run `python tools/download.py --what sts` and pass --sts_dir data/sts.")
