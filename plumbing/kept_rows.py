"""The untrained encoder's row (--eval_untrained), evaluated once and read back by every later run of it
(untrained): its figures never change, so evaluating it again would only cost a run its time.

- Keyed by what made the figures, never by a name (key): the SHA-256 of each of the model's files, the
  pooler, the STS pairs as read, the evaluation code as this process read it (common.py and
  plumbing's inputs.py, sts_data.py, tokens.py), torch, transformers and the device. Any of them
  changed: another file, evaluated again.
- Where: untrained-<hash of the key>.json in the token cache's folder beside --sts_dir (data/.cache for
  data/sts), or --cache_dir.
- Written whole or not at all (write); believed only whole and of its key (read): a damaged file (a
  copy cut short) is said so and evaluated again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

from plumbing import code_record
from plumbing.atomic_writes import sha256_file, write_text_atomic
from plumbing.inputs import default_cache_dir
from plumbing.sts_data import STS_TASKS, load_sts_pairs

# the evaluation code: the bytes this process runs (code_record), not the files as they are now
EVAL_CODE = hashlib.sha256(b"".join(code_record.ran(code_record.HERE / f) for f in (
    "common.py", "plumbing/inputs.py", "plumbing/sts_data.py", "plumbing/tokens.py"))).hexdigest()
MODEL_FILES = (".json", ".safetensors", ".bin", ".txt", ".model")    # weights, config, tokenizer


def digest(x: Any) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()


def model_files(model: str) -> list[Path]:
    """The files a model loads from, in its folder or the Hugging Face cache; [] where none is at hand."""
    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(model, "config.json")
        if not isinstance(found, str):
            return []
        folder = Path(found).parent
    return sorted(p for p in folder.iterdir() if p.suffix in MODEL_FILES and p.is_file())


def key(model: str, pooler: str, pairs: Any) -> dict | None:
    import torch
    import transformers
    files = model_files(model)
    if not files:
        return None
    return {"model_files": {p.name: sha256_file(p) for p in files}, "pooler": pooler, "sts": digest(pairs),
            "eval_code": EVAL_CODE, "torch": torch.__version__, "transformers": transformers.__version__,
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def read(path: Path, made_of: dict) -> dict | None:
    """The figures kept at `path` if whole and made of `made_of`; None where none are (said if damaged)."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        kept = None
    if isinstance(kept, dict) and kept.get("key") == made_of:    # the file's name is its key's hash
        return kept["figures"]
    print(f"note: {path}: damaged; the untrained row is evaluated again", file=sys.stderr)
    return None


def write(path: Path, made_of: dict, figures: dict) -> bool:
    """Keep `figures` at `path`; False where it cannot be written (a cache: evaluated again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": made_of, "figures": figures},
                                           sort_keys=True) + "\n")
    except OSError:
        return False
    return True


def untrained(args: Any, pooler: str, evaluate: Callable[[str, str, str, str], dict]) -> dict:
    """The untrained --model's row, read off with the run's pooler: "kept_in" says where it is kept,
    "reused" whether it was read back. `evaluate`: common.saved_figures."""
    # NOTE(ours): `cls` reads [CLS] through the encoder's own pretrained pooler layer (BERT's NSP
    # dense + tanh), as tools/eval.py and compare.py --baseline do: the run's MLP started from a
    # random draw, a seed's rather than the encoder's
    name = Path(args.model).name or args.model
    label = f"untrained {name} [{'cls: its pretrained pooler' if pooler == 'cls' else pooler}]"
    row = {"label": label, "model": args.model, "pooler": pooler}
    pairs = {t: {k: (a, b, g.tolist()) for k, (a, b, g) in load_sts_pairs(args.sts_dir, t).items()}
             for t in STS_TASKS}
    made_of = key(args.model, pooler, pairs)
    path = default_cache_dir(args.sts_dir, args.cache_dir) / f"untrained-{digest(made_of)[:32]}.json" \
        if made_of else None
    if path and (figures := read(path, made_of)) is not None:
        return {**row, **figures, "kept_in": str(path), "reused": True}
    figures = evaluate(args.model, pooler, args.sts_dir, f"untrained {name}")
    if path and write(path, made_of, figures):
        return {**row, **figures, "kept_in": str(path), "reused": False}
    return {**row, **figures}
