"""A teacher larger than one device: ``--teacher-parallel`` layouts and the grid of ranks they make.

Three layouts, one option:

* ``none`` (the default): every process holds the whole teacher on its own device.
* ``tp:N``: transformers' own tensor parallelism (``DistributedConfig(tp_size=N)``, DTensor underneath) over N
  consecutive torchrun ranks. The ranks of a group run the same batches in lockstep; rank 0 of each group writes
  its group's shards, the others only lend their share of the weights. With W ranks there are W / N groups, which
  split the shards among themselves as the plain data-parallel ranks do (``dp_replicate_size = W / N``).
* ``layers:N``: layer-wise placement inside one process (``device_map``) over N of the node's GPUs, for
  architectures transformers has no tensor-parallel plan for; process ``local_rank`` uses GPUs
  ``local_rank * N .. local_rank * N + N - 1``, so a node of G GPUs runs G / N processes.

The layout never enters the settings fingerprint: what a shard holds depends only on its sequences, so a cache
written by 2 x 2 ranks resumes on 1 x 4 (``CacheWriter.committed_shards`` counts every part's shards).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

# FSDP2's module class (torch >= 2.6; pyproject allows 2.1). At the top: only stage one's run imports this module
# (no light path), and a recent transformers loads torch.distributed.fsdp with any model anyway.
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:
    FSDPModule = None  # type: ignore[assignment, misc]

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.targets import logits as logit_kinds
from kdcache.storage import MAP_KINDS

_LAYOUT = re.compile(r"^(none|tp:[1-9]\d*|layers:[1-9]\d*)$")


@dataclass(frozen=True)
class Layout:
    """A parsed ``--teacher-parallel``: ``kind`` none / tp / layers and the group size ``size``."""

    kind: str = "none"
    size: int = 1

    @classmethod
    def parse(cls, value: str) -> Layout:
        """``none``, ``tp:N`` or ``layers:N``.

        Raises:
            PrecomputeError: any other value, naming the forms taken.
        """
        if not _LAYOUT.match(value):
            raise PrecomputeError(f"teacher_parallel: got {value!r}, expected none, tp:N (tensor parallelism over N "
                                  f"ranks) or layers:N (layer-wise placement over N GPUs)")
        kind, _, size = value.partition(":")
        return cls(kind, int(size or 1))

    @property
    def tensor(self) -> int:
        """Ranks per tensor-parallel group (1 unless ``tp``)."""
        return self.size if self.kind == "tp" else 1

    def __str__(self) -> str:
        return "none" if self.kind == "none" else f"{self.kind}:{self.size}"


@dataclass(frozen=True)
class Grid:
    """Where one rank sits among ``world`` ranks in groups of ``tensor``: its group (the data-parallel index) and
    its place in the group; only place 0 writes."""

    rank: int
    world: int
    tensor: int

    @classmethod
    def of(cls, layout: Layout, rank: int, world: int) -> Grid:
        """Raises PrecomputeError where ``world`` is not a multiple of the group size."""
        if world % layout.tensor:
            raise PrecomputeError(f"teacher_parallel: {layout} needs a multiple of {layout.tensor} processes, and "
                                  f"torchrun started {world}; use --nproc-per-node {layout.tensor} (or a multiple)")
        return cls(rank, world, layout.tensor)

    @property
    def group(self) -> int:
        return self.rank // self.tensor

    @property
    def groups(self) -> int:
        return self.world // self.tensor

    @property
    def place(self) -> int:
        return self.rank % self.tensor

    @property
    def writes(self) -> bool:
        return self.place == 0


def load_kwargs(layout: Layout, grid: Grid, local_rank: int) -> dict[str, Any]:
    """Extra ``from_pretrained`` keywords for the layout (none for ``none``)."""
    if layout.kind == "tp":
        from transformers.distributed import DistributedConfig  # recent transformers only (pyproject allows 4.45)

        # Groups of consecutive ranks; the replicas axis makes W / N of them (transformers' own mesh order).
        return {"distributed_config": DistributedConfig(tp_size=grid.tensor, dp_replicate_size=grid.groups)}
    if layout.kind != "layers":
        return {}
    # max_memory that confines device_map="auto" to this process's N GPUs
    size, count = layout.size, torch.cuda.device_count() if torch.cuda.is_available() else 0
    first = local_rank * size
    if first + size > count:
        raise PrecomputeError(f"teacher_parallel: layers:{size} on local rank {local_rank} needs GPUs "
                              f"{first}..{first + size - 1}, and this node has {count}; start fewer processes "
                              f"per node (GPUs / {size}) or choose a smaller N")
    return {"device_map": "auto", "max_memory": {i: torch.cuda.get_device_properties(i).total_memory
                                                 if first <= i < first + size else 0 for i in range(count)}}


def no_autograd(model: torch.nn.Module) -> Callable[[], AbstractContextManager[Any]]:
    """What a forward runs under: ``inference_mode``, except for a teacher that transformers wrapped in FSDP2
    (``tp:N`` with several groups: the replicas axis comes with it), whose parameters cannot be inference tensors
    ("Inference tensors do not track version counter"); ``no_grad`` does the same there."""
    if FSDPModule is None:  # a torch without FSDP2 cannot have wrapped it
        return torch.inference_mode
    wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
    return torch.no_grad if wrapped else torch.inference_mode


def settle(model: torch.nn.Module) -> None:
    """One forward of the whole model on one token, where transformers wrapped it in FSDP2: FSDP sets itself up
    in the root module's first forward, and refuses a first call through a child (the base model alone, as the
    chunked LM head runs it). Every rank of the group runs it, as it runs every forward."""
    if no_autograd(model) is not torch.no_grad:
        return
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def check_features(layout: Layout, features: tuple[str, ...], attention_source: str, logits: str | None) -> None:
    """Refuse what tensor parallelism cannot capture whole: attention maps and queries/keys exist only as each
    rank's share of the heads, and ``--logits head`` would need the whole head gathered for its copy."""
    if layout.kind != "tp" or layout.tensor == 1:
        return
    if not MAP_KINDS.isdisjoint(features):
        raise PrecomputeError(f"teacher_parallel: {layout} splits every attention block's heads across ranks, so "
                              f"attention ({attention_source}) is not whole on any rank; drop 'attention' from "
                              f"--features, or run without --teacher-parallel")
    if logit_kinds.uses_head(logits):
        raise PrecomputeError(f"teacher_parallel: {layout} shards the LM head across ranks; --logits head copies "
                              f"it whole: use --logits topk, or run without --teacher-parallel")
