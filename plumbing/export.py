"""The export: a model folder that Hugging Face (AutoModel) and sentence-transformers both load,
written whole or not at all (best/, and rcl.py's end/). The `cls` pooler's MLP goes into BERT's own
pooler layer (tanh(W h_cls + b) is the MLP) and into a sentence-transformers Dense module."""

from __future__ import annotations

import json
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
