"""The runner's side of ``--teacher-parallel``: the checks before loading, and the lockstep of a group's ranks."""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import CONFIG_MAPPING

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.progress import Progress, RunStats
from kdcache.stages.precompute.core.teacher_id import teacher_files_fingerprint
from kdcache.stages.precompute.parallel.layouts import Grid, Layout, check_features
from kdcache.stages.precompute.parallel.memory import check_layout, rank_memory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig

    from kdcache.stages.precompute.core.plan import PrecomputePlan
    from kdcache.stages.precompute.core.targets import Targets
    from kdcache.storage import CacheSpec


def check_parallel(plan: PrecomputePlan, config: PretrainedConfig, targets: Targets, layout: Layout,
                   device: torch.device) -> dict[str, Any] | None:
    """Before the weights load: refuse what the layout cannot capture or hold; the memory per rank (for
    ``--estimate``, and whenever a layout is chosen), else None.

    Raises:
        PrecomputeError: a target the layout splits (``parallel.check_features``), a rank codec's fit under
            tensor parallelism, or ranks that cannot hold the teacher (``memory.check_layout``).
    """
    check_features(layout, plan.features, targets.attention.name, targets.logit.name)
    if layout.kind == "layers" and layout.size > 1 and not plan.batch.estimate:
        # Review found the capture unready for it: blocks on several GPUs leave the hooked states, the last
        # hidden state and the copy stream's event on different devices. Refused until a multi-GPU test covers it.
        raise PrecomputeError(f"teacher_parallel: {layout} places the blocks over {layout.size} GPUs, whose targets "
                              f"stage one cannot yet gather on one device; use --teacher-parallel tp:N (hidden "
                              f"states and top-k logits), or --estimate to size the layout")
    if layout.size > 1 and getattr(config, "is_encoder_decoder", False):
        raise PrecomputeError(f"teacher_parallel: {layout}: an encoder-decoder teacher runs on one device (its "
                              f"capture has no parallel path); drop --teacher-parallel")
    check_tensor_plan(layout, config)
    if layout.size > 1 and importlib.util.find_spec("accelerate") is None:
        raise PrecomputeError(f"teacher_parallel: {layout} loads the teacher through transformers' tensor "
                              f"parallelism / device_map, which needs accelerate: pip install 'kdcache[parallel]'")
    if layout.tensor > 1 and plan.write.hidden_codec.rank is not None:
        raise PrecomputeError(f"teacher_parallel: --hidden-rank fits its bases on the main rank alone, and {layout} "
                              f"needs every rank of a group in each forward; drop --hidden-rank, or fit the bases "
                              f"in a run without --teacher-parallel first (the cache keeps them)")
    heads = [int(getattr(config, k, 0) or 0) for k in ("num_attention_heads", "num_key_value_heads")]
    if any(h % layout.tensor for h in heads if h):
        raise PrecomputeError(f"teacher_parallel: {layout} splits the teacher's {heads[0]} attention heads "
                              f"({heads[1]} key/value heads) into {layout.tensor} equal groups, which they do not "
                              f"divide; choose N among {_divisors(*heads)}, or layers:N")
    if layout.kind == "none" and not (plan.batch.estimate or plan.teacher.device_memory):
        return None  # one device and no size given: the device itself says whether the teacher fits
    # the CUDA device index (``cuda`` alone: the current one), None off a GPU
    gpu = None if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device()
    memory = rank_memory(plan, config, targets, layout, gpu)
    check_layout(memory, layout, config)
    return {"layout": str(layout), "per_rank_bytes": memory.total, "weights_bytes": memory.weights,
            "activations_bytes": memory.activations, "capacity_bytes": memory.capacity, "source": memory.source,
            "line": memory.describe(layout)}


def check_tensor_plan(layout: Layout, config: PretrainedConfig) -> None:
    """Refuse ``tp:N`` for a teacher whose transformers config has no tensor-parallel plan. The runner calls this
    before the ranks join their process group too: a rank that refused after joining would leave its partners
    waiting in the group, and torchrun would report the collapse rather than the reason.

    Raises:
        PrecomputeError: naming the model type and the common families that have a plan.
    """
    if layout.tensor > 1 and not getattr(config, "base_model_tp_plan", None):
        # the common families whose transformers config carries a tensor-parallel plan (as installed)
        families = [name for name in COMMON_FAMILIES
                    if name in CONFIG_MAPPING and getattr(CONFIG_MAPPING[name], "base_model_tp_plan", None)]
        raise PrecomputeError(f"teacher_parallel: {layout} shards the teacher by its transformers tensor-parallel "
                              f"plan, and {getattr(config, 'model_type', 'this')!r} models have none; teachers "
                              f"whose families have one include {', '.join(families)}; drop "
                              f"--teacher-parallel for this teacher")


COMMON_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                   "olmo2", "granite", "cohere", "deepseek_v3")


def _divisors(heads: int, kv: int) -> str:
    common = math.gcd(heads, kv or heads)
    return ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)


def memory_only(plan: PrecomputePlan, config: PretrainedConfig, layout: Layout, world: int,
                device: torch.device) -> bool:
    """Whether ``--estimate`` stops at the memory per rank: the teacher has no weights here (a config alone), or
    this launch cannot run the layout (fewer ranks than a tensor-parallel group, or layer placement without
    GPUs): the memory needs only the config, the size and time need the teacher run as it will be."""
    if teacher_files_fingerprint(plan.teacher, config) is None or world < layout.tensor:
        return True
    return layout.kind == "layers" and layout.size > 1 and device.type != "cuda"


def group_todo(todo: list[int] | None, group: ProcessGroup | None, grid: Grid) -> list[int]:
    """The group leader's list of shards still to compute, on every rank of its tensor-parallel group."""
    if group is None:
        assert todo is not None
        return todo
    box: list[Any] = [todo]
    dist.broadcast_object_list(box, src=grid.group * grid.tensor, group=group)
    return list(box[0])


def lend_share(spec: CacheSpec, todo: list[int], stream: Callable[[list[tuple[int, int]], Progress], Iterator[Any]],
               stats: RunStats) -> None:
    """A group's other ranks: run the same shards' forwards (their share of the weights is needed in every
    collective) and drop the results, which the leader writes."""
    stats.compute_started = time.perf_counter()
    for _ in stream([spec.shard_range(k) for k in todo], Progress(0, False, stats)):
        pass
    stats.compute_seconds = time.perf_counter() - stats.compute_started
