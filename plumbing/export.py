"""The export: a model folder that transformers and sentence-transformers both load (best/, and rcl.py's
end/), and the commands that use it at the end of a run.

The rules, and the function that keeps each:
1. best/ loads as any model, in both libraries, read off with the run's pooler (save_pretrained_dir): a
   user's next step is `SentenceTransformer(best)`, not this project's code.
2. It is written whole or not at all (save_pretrained_dir, through atomic_writes.atomic_dir).
3. A run ends by saying what to run next (what_next): compare, evaluate again, load.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch.nn as nn

from plumbing.atomic_writes import atomic_dir
from plumbing.downloads import in_data
from plumbing.inputs import max_positions

ST_POOLING = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}   # the poolers it has a module for


def save_pretrained_dir(path: str | Path, encoder: nn.Module, tokenizer, pooler: str,
                        mlp: nn.Module | None = None, extra: dict | None = None) -> None:
    """The encoder and tokenizer at the root (AutoModel), saved again by sentence-transformers' save()
    with a Pooling and, for `cls`, Dense(d, d, Tanh) holding `mlp` (also BERT's pooler: tanh(W h_cls + b))."""
    with atomic_dir(Path(path)) as tmp:      # swapped in whole at the end, or removed
        if pooler == "cls" and hasattr(getattr(encoder, "pooler", None), "dense"):
            encoder.pooler.dense.load_state_dict(mlp.dense.state_dict())
        encoder.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if pooler in ST_POOLING:
            from sentence_transformers import SentenceTransformer
            from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer
            d = encoder.config.hidden_size
            modules = [Transformer(str(tmp), max_seq_length=max_positions(encoder.config, tokenizer)),
                       Pooling(d, ST_POOLING[pooler])]     # Transformer reads the root back, then writes it
            if pooler == "cls":
                modules.append(Dense(d, d, activation_function=nn.Tanh()))
                modules[-1].linear.load_state_dict(mlp.dense.state_dict())
            SentenceTransformer(modules=modules, device="cpu").save(str(tmp), create_model_card=False)
        else:
            print(f"note: sentence-transformers has no '{pooler}' pooling; {path} loads with AutoModel only",
                  file=sys.stderr)
        for name, obj in (extra or {}).items():         # {filename: json-able}: args.json, ...
            (tmp / name).write_text(json.dumps(obj, indent=2, default=str))


def tool(name: str) -> str:
    """A tool's path as typed from the working folder: tools/compare.py in the repository, else all of it."""
    path = Path(__file__).resolve().parents[1] / "tools" / name
    return (path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path).as_posix()


def what_next(best: Path, model: str, pooler: str, sts_dir: str) -> str:
    """The end of a run: where its best model is, and the commands to run next (from the working folder)."""
    q = shlex.quote
    sts = "" if Path(sts_dir) == Path(in_data("sts")) else f" --sts_dir {q(sts_dir)}"
    # Python inside the shell's single quotes: its strings in double quotes
    folder, pair = json.dumps(str(best)), '["A man is playing a guitar.", "Someone plays music."]'
    if (best / "modules.json").is_file():          # written for the poolers sentence-transformers has
        load = (f"from sentence_transformers import SentenceTransformer; m = SentenceTransformer({folder}); "
                f"e = m.encode({pair}); print(m.similarity(e[:1], e[1:]))")
        how = "in sentence-transformers: the cosine of two sentences"
    else:
        load = (f"from transformers import AutoModel, AutoTokenizer; t = AutoTokenizer.from_pretrained("
                f"{folder}); m = AutoModel.from_pretrained({folder}); print(m(**t({pair}, padding=True, "
                f'return_tensors="pt"), output_hidden_states=True).hidden_states[-1].shape)')
        how = f"in transformers: sentence-transformers has no {pooler} pooling (common.pool has)"
    return "\n".join([
        f"best model: {best} (the figures above: its test_metrics.json); next:",
        f"  python {tool('compare.py')} {q(str(best.parent))} --baseline {q(model)} --pooler {pooler}{sts}"
        f"   # beside the untrained encoder",
        f"  python {tool('eval.py')} --model {q(str(best))} --pooler {pooler}{sts}   # the 7 tasks again",
        f"  python -c {q(load)}   # {how}"])
