"""The step made fast behind train_step's one call (compiled_forward), so that the method scripts stay plain
PyTorch.

The rules, and the function that keeps each:
1. What a step computes is unchanged, up to floating-point order (and, on a CPU, which dropout draws a
   token gets): a speed-up never changes a method.
2. On a GPU: torch.compile with CUDA graphs (CompiledModel: a few launches a step, not hundreds) and
   the fastest attention kernel (attention_kernels); under torchrun, DDP (wrap_ddp).
3. On a CPU: the batch encoded in length-sorted parts (sub_batched), so that short sentences are not
   padded to the longest.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def attention_kernels():
    """Every attention kernel but cuDNN's, which PyTorch picks for 32-token batches on an H100 and
    the memory-efficient one beats there (docs/speed.md); nothing changes on a CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def stacked(model: Callable) -> Callable:
    """model(batch) with the logged figures as ONE vector: (loss, names, (k,) tensor). Inductor may return
    one buffer for the loss and a figure equal to it (`l + 0`, a detach), which AOTAutograd then marks
    non-differentiable, the loss with it (pytorch/pytorch#100348). A stacked vector is a buffer of its own."""
    def forward(batch: dict):
        out = model(batch)
        loss, stats = out if isinstance(out, tuple) else (out, {})
        return loss, tuple(stats), torch.stack(list(stats.values())) if stats else None
    return forward


class CompiledModel:
    """model(batch) through torch.compile, replayed from CUDA graphs in one process (DDP's hooks run inside
    the backward: no graphs there). If compiling fails: one note, then the model itself from there on.
    `backend`: inductor on CUDA, aot_eager on the CPU (tests name inductor there)."""

    def __init__(self, model: nn.Module, device: torch.device, world_size: int = 1,
                 backend: str | None = None):
        self.model = model
        self.graphs = device.type == "cuda" and world_size == 1
        backend = backend or ("inductor" if device.type == "cuda" else "aot_eager")
        self.compiled = torch.compile(stacked(model), mode="reduce-overhead" if self.graphs else None,
                                      backend=backend)

    def __call__(self, batch: dict):
        if self.compiled is not None:
            try:
                if self.graphs:
                    torch.compiler.cudagraph_mark_step_begin()     # the last step's outputs are consumed
                with attention_kernels():
                    loss, names, figures = self.compiled(batch)
                return loss, dict(zip(names, figures.unbind() if names else ()))
            except torch.cuda.OutOfMemoryError:                    # Ctrl-C is no Exception: it passes too
                raise
            except Exception as e:
                print(f"note: the compiled step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                      f"running eager from here on (pass --no-compile to skip compiling)", file=sys.stderr)
                self.compiled = None
                self.model.zero_grad(set_to_none=True)             # what the failed attempt left behind
        return self.model(batch)


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP over `model`. Every trainable parameter gets a gradient every step (load_encoder freezes
    BERT's NSP pooler), so DDP need not search for unused ones; the torchrun tests run each script."""
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


SUB_BATCHES = 4      # MiniLM's forward + backward on real wiki1m batches: 1,480 -> 1,205 ms (docs/speed.md)
SPLIT_KWARGS = {"token_type_ids", "position_ids"}     # per-token inputs, (N, L) like input_ids, cut like it


def sub_batched(encoder: nn.Module, parts: int = SUB_BATCHES) -> nn.Module:
    """`encoder` (a transformers model) whose forward, in training, encodes a right-padded batch as `parts`
    length-sorted groups of rows, each cut to its own longest row, and pads the outputs back in the rows'
    order (last_hidden_state, hidden_states, pooler_output; zeros past a group's longest row). Exact: a
    BERT or RoBERTa row is encoded from its own tokens under its mask, whatever the rows beside it; only which
    dropout draw a token gets differs. Any other call (eval mode, inputs_embeds, a mask that is not
    1s then 0s, output_attentions, return_dict, few rows, little padding to save, torch.compile's
    tracing: a compiled step keeps its static shapes) runs unchanged.
    IFCL calls the layer stack (encoder.encoder) itself, which this leaves as it is."""
    if getattr(encoder.forward, "sub_batched", False):
        return encoder

    def forward(self, input_ids=None, attention_mask=None, **kw):
        plain = functools.partial(type(self).forward, self)       # the class's: a deep copy calls its own
        per_token = {k: v for k, v in kw.items() if k in SPLIT_KWARGS and v is not None}
        if torch.compiler.is_compiling() or not (
                self.training and torch.is_tensor(input_ids) and torch.is_tensor(attention_mask)
                and input_ids.dim() == 2 and attention_mask.shape == input_ids.shape
                and all(torch.is_tensor(v) and v.shape == input_ids.shape for v in per_token.values())
                and set(kw) <= SPLIT_KWARGS | {"output_hidden_states"} and len(input_ids) >= 2 * parts):
            return plain(input_ids=input_ids, attention_mask=attention_mask, **kw)
        n, width = input_ids.shape
        lengths = attention_mask.sum(1)                                           # (N,)
        order = torch.argsort(lengths, stable=True)                               # (N,) shortest first
        groups = order.chunk(parts)
        widths = [int(lengths[g].max()) for g in groups]
        right_padded = torch.equal(attention_mask.bool(),
                                   torch.arange(width, device=lengths.device) < lengths[:, None])
        if not right_padded or sum(len(g) * w for g, w in zip(groups, widths)) > 0.9 * n * width:
            return plain(input_ids=input_ids, attention_mask=attention_mask, **kw)
        outs = [plain(input_ids=input_ids[g, :w], attention_mask=attention_mask[g, :w],
                      **{**kw, **{k: v[g, :w] for k, v in per_token.items()}})
                for g, w in zip(groups, widths)]
        back = torch.empty_like(order)
        back[order] = torch.arange(n, device=order.device)                        # (N,) sorted -> original

        def rows(parts_: list[torch.Tensor]) -> torch.Tensor:    # (N, width, d) or (N, d) in the rows' order
            if parts_[0].dim() == 3:
                parts_ = [F.pad(t, (0, 0, 0, width - t.shape[1])) for t in parts_]
            return torch.cat(parts_)[back]

        fields = {}
        for name, value in outs[0].items():
            if torch.is_tensor(value) and value.dim() in (2, 3):
                fields[name] = rows([o[name] for o in outs])
            elif isinstance(value, tuple) and all(torch.is_tensor(v) and v.dim() == 3 for v in value):
                fields[name] = tuple(rows(list(layer)) for layer in zip(*(o[name] for o in outs)))
            else:                                                  # an output this does not know how to join
                return plain(input_ids=input_ids, attention_mask=attention_mask, **kw)
        return type(outs[0])(**fields)

    forward.sub_batched = True
    encoder.forward = types.MethodType(forward, encoder)
    return encoder


def compiled_forward(model: nn.Module, device: torch.device, compile: bool, world_size: int) -> Callable:
    """model(batch) as train() calls it (rules 2 and 3; compiled unless --no-compile)."""
    if device.type == "cpu" and hasattr(getattr(model, "encoder", None), "config"):
        sub_batched(model.encoder)
    net = wrap_ddp(model, device) if world_size > 1 else model
    return CompiledModel(net, device, world_size) if compile and device.type == "cuda" else net
