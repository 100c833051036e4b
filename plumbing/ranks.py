"""This process's place under torchrun: the process group and the device (init_distributed), its rank
among how many (world), a wait for all of them (barrier), its share of a batch (local_rows), and the
global batch a loss sees (gather).

The rules, and the function that keeps each:
1. One GPU a process (init_distributed): two processes on one GPU would each hold a copy of the model
   and the optimizer and share its memory and time; more processes on a machine than its GPUs is
   refused before anything loads, with the --nproc_per_node to pass instead.
2. Under torchrun every loss sees the global batch, and the gradients are one process's on it (gather):
   in-batch negatives are the method, and a loss over a rank's share would be another loss (fewer
   negatives), however the gradients are averaged after. Tested with 2 CPU processes.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from plumbing.errors import UserError


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


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
