"""The export: a model folder that Hugging Face (AutoModel) and sentence-transformers both load,
written whole or not at all (best/, and rcl.py's end/), and the commands that use it at the end
of a run. The `cls` pooler's MLP goes into BERT's own pooler layer (tanh(W h_cls + b) is the MLP)
and into a sentence-transformers Dense module."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch.nn as nn

from plumbing.atomic_writes import atomic_dir
from plumbing.inputs import max_positions

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


def tool(name: str) -> str:
    """A tool's path as typed from the working folder: tools/compare.py in the repository, else
    the whole path."""
    path = Path(__file__).resolve().parents[1] / "tools" / name
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else Path(relative).as_posix()


def what_next(best: Path, model: str, pooler: str, sts_dir: str) -> str:
    """The end of a run: where its best model is, and the commands to run next, as typed from the
    working folder: the run beside the untrained encoder, best/ evaluated again, best/ loaded."""
    q = shlex.quote
    sts = "" if Path(sts_dir) == Path("data/sts") else f" --sts_dir {q(sts_dir)}"
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
