"""Process groups and devices: gloo on CPU, nccl on CUDA, chosen automatically."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(rank: int) -> torch.device:
    """cuda:<local rank> when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(rank: int, world: int, init_method: str, timeout_s: float,
         device: torch.device) -> None:
    """Join the process group; `timeout_s` bounds every collective and point-to-point op."""
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    # NCCL: the first call on a group must involve every rank before batched p2p may
    # involve a subset (batch_isend_irecv); a barrier is that call, and cheap on gloo.
    dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

