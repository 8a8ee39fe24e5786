"""The runner's side of ``--teacher-parallel``: the checks before loading, and the lockstep of a group's ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.memory import check_layout, rank_memory
from kdcache.stages.precompute.parallel import Grid, Layout, check_features
from kdcache.stages.precompute.progress import Progress, RunStats

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from kdcache.stages.precompute.options import PrecomputeOptions
    from kdcache.stages.precompute.targets import Targets


def check_parallel(options: PrecomputeOptions, config: PretrainedConfig, targets: Targets, layout: Layout,
                   device: torch.device) -> dict[str, Any] | None:
    """Before the weights load: refuse what the layout cannot capture or hold; the memory per rank (for
    ``--estimate``, and whenever a layout is chosen), else None.

    Raises:
        PrecomputeError: a target the layout splits (``parallel.check_features``), a rank codec's fit under
            tensor parallelism, or ranks that cannot hold the teacher (``memory.check_layout``).
    """
    check_features(layout, options.targets.features, targets.attention_source, targets.logits)
    if layout.tensor > 1 and options.storage.hidden_rank is not None:
        raise PrecomputeError(f"teacher_parallel: --hidden-rank fits its bases on the main rank alone, and {layout} "
                              f"needs every rank of a group in each forward; drop --hidden-rank, or fit the bases "
                              f"in a run without --teacher-parallel first (the cache keeps them)")
    if layout.kind == "none" and not options.engine.estimate:
        return None
    memory = rank_memory(options, config, targets, layout, device.type == "cuda")
    check_layout(memory, layout)
    return {"layout": str(layout), "per_rank_bytes": memory.total, "weights_bytes": memory.weights,
            "activations_bytes": memory.activations, "capacity_bytes": memory.capacity, "source": memory.source,
            "line": memory.describe(layout)}


def group_todo(todo: list[int] | None, group: Any, grid: Grid) -> list[int]:
    """The group leader's list of shards still to compute, on every rank of its tensor-parallel group."""
    if group is None:
        assert todo is not None
        return todo
    import torch.distributed as dist

    box: list[Any] = [todo]
    dist.broadcast_object_list(box, src=grid.group * grid.tensor, group=group)
    return list(box[0])


def lend_share(spec: Any, todo: list[int], compute: Callable[[tuple[int, int], Progress], Any],
               stats: RunStats) -> None:
    """A group's other ranks: run the same shards' forwards (their share of the weights is needed in every
    collective) and drop the results, which the leader writes."""
    import time

    stats.compute_started = time.perf_counter()
    progress = Progress(0, False, stats)
    for k in todo:
        compute(spec.shard_range(k), progress)
    stats.compute_seconds = time.perf_counter() - stats.compute_started
