"""The few torch.distributed calls training makes: the process group, rank, barriers and FSDP2 sharding.

Under `torchrun` (WORLD_SIZE > 1) each process trains its slice of the global batch on a model sharded
with FSDP2 (`fully_shard`); in one process the rank is 0, the world size 1, and the calls here do nothing.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def is_launched() -> bool:
    """Whether this process is one of several started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*args) -> None:
    """Print a progress message to stderr, once (from rank 0)."""
    if rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over the processes, in place."""
    if dist.is_initialized():
        dist.all_reduce(tensor)


def init(device: str | None, *, multi_process: bool = True) -> torch.device:
    """The training device (default: cuda if available); under torchrun, when `multi_process`, also the
    process group and this process's GPU."""
    launched = multi_process and is_launched()
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
    if launched and chosen.type == "cuda":
        chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(chosen)
    return chosen


def shard(model: torch.nn.Module) -> None:
    """Shard a DiffusionGemma (the bare model, not a peft wrapper) with FSDP2: each layer, then the root."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    # The stack is driven through these methods, not forward(): gather its root parameters around them.
    for method in ("encode", "denoise", "denoise_hidden", "soft_embedding", "lm_head"):
        register_fsdp_forward_method(model, method)
