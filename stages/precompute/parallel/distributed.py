"""Rank discovery for torchrun / the deepspeed launcher, and the collectives stage one needs: a barrier, and a sum
of the ranks' counts for the run's summary.

Data-parallel ranks never exchange tensors: each writes its own shards through its own ``CacheWriter`` part, so
gloo on the CPU is enough even when the teachers run on GPUs. The barrier only lets rank 0 merge the parts once
every rank has committed its last shard. A tensor-parallel teacher (``parallel``) does exchange activations: on
GPUs its group then joins with NCCL for CUDA tensors beside gloo for the CPU's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

# Ranks may finish far apart (a resumed rank has little left to do), so the barrier waits long.
BARRIER_TIMEOUT = timedelta(hours=24)


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class DistContext:
    """This process's place among the launcher's processes (rank 0 of 1 without a launcher)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @classmethod
    def from_env(cls, gpu_collectives: bool = False) -> DistContext:
        """Read RANK / WORLD_SIZE / LOCAL_RANK; join a gloo group when there is more than one process (and NCCL
        for CUDA tensors with ``gpu_collectives``, where CUDA is there: a tensor-parallel teacher's)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        ctx = cls(rank, world, local_rank)
        if world > 1 and not dist.is_initialized():
            nccl = gpu_collectives and torch.cuda.is_available()
            dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", timeout=BARRIER_TIMEOUT)
            ctx.owns_group = True
        return ctx

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.world > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over every rank (gloo, on the CPU); the values themselves for one process."""
        if self.world == 1:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total)
        return [float(v) for v in total.tolist()]

    def groups_of(self, size: int) -> ProcessGroup | None:
        """The process group of this rank's ``size`` consecutive ranks (every rank makes every group, as
        ``new_group`` requires); None for groups of one."""
        if size == 1:
            return None
        groups = [dist.new_group(list(range(g, g + size))) for g in range(0, self.world, size)]
        return groups[self.rank // size]

    def close(self) -> None:
        """Leave the process group if this context created it."""
        if self.owns_group:
            dist.destroy_process_group()
            self.owns_group = False
