"""The step made fast behind train_step's one call: torch.compile with CUDA graphs (a few launches a step,
not hundreds), DDP under torchrun, the fastest attention kernel. What a step computes is unchanged."""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn as nn


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


def compiled_forward(model: nn.Module, device: torch.device, compile: bool, world_size: int) -> Callable:
    """model(batch) as train() calls it: DDP over several processes, compiled on a GPU unless --no-compile."""
    net = wrap_ddp(model, device) if world_size > 1 else model
    return CompiledModel(net, device, world_size) if compile and device.type == "cuda" else net
