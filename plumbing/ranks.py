"""This process's place under torchrun: its rank among how many, and a wait for all of them."""

from __future__ import annotations

import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every rank under torchrun; nothing in one process."""
    if world()[1] > 1:
        dist.barrier()
