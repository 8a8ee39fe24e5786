"""Device memory per rank for a ``--teacher-parallel`` layout, from the teacher's config alone (no weights).

What one rank holds, in the dtype the teacher runs in:

* weights: every parameter counted on the meta device (``from_config`` allocates nothing); tensor parallelism
  and layer-wise placement split them N ways, except the norms, which tensor parallelism copies to every rank;
* activations of one batch (``batch_size x max_length`` tokens, T): the residual stream and the block's working
  copies (4 x T x d), the MLP's intermediate (2 x T x I / N), eager attention's ``[B, H/N, L, L]`` scores where
  attention maps are captured, the kept hidden layers in fp16 (layers x T x d x 2 bytes) until they reach the
  host, and the LM head's ``[chunk, V/N]`` block in the teacher's dtype plus its fp32 copy. Two batches are in
  flight at once (``core.IN_FLIGHT``), so activations count twice.

The sum is compared with ``USABLE`` of the device's memory (the rest is the CUDA context, the allocator's slack and
the collectives' buffers); a layout that does not fit is refused before any weight loads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AutoModel, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import IN_FLIGHT
from kdcache.stages.precompute.parallel.layouts import Layout
from kdcache.storage import format_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kdcache.stages.precompute.core.plan import BatchSetup, PrecomputePlan
    from kdcache.stages.precompute.core.targets import Targets

USABLE = 0.9  # share of a device's memory a run may plan to use
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs (``weights``, ``activations``) and has (``capacity``, from ``source``)."""

    weights: int
    activations: int
    capacity: int
    source: str

    @property
    def total(self) -> int:
        return self.weights + self.activations

    def describe(self, layout: Layout) -> str:
        return (f"memory per rank ({layout}): {format_bytes(self.total)} (weights {format_bytes(self.weights)}, "
                f"activations {format_bytes(self.activations)}) of {format_bytes(self.capacity)} ({self.source})")


def param_counts(config: PretrainedConfig) -> tuple[int, int]:
    """``(all parameters, norm parameters)`` of the causal LM the config builds, counted on the meta device."""
    with torch.device("meta"), _errors_only():
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM class for this config: its bare model
            model = AutoModel.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name.lower())
    return total, norms


@contextmanager
def _errors_only() -> Iterator[None]:
    """transformers' logs at errors only, for the block inside: building an encoder's causal-LM class only to
    count its parameters (``BertLMHeadModel`` for MiniLM) warns that it is no decoder, a line about a model that
    never runs (``pipeline.quiet`` turns the same switch for ``--quiet``)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def run_dtype_bytes(chosen: str, config: PretrainedConfig, on_gpu: bool) -> int:
    """Bytes per value of the dtype the teacher will run in (``chosen``, the ``TeacherSetup.dtype``, by
    ``teacher.load_for_inference``'s rule)."""
    if chosen != "auto":
        return {"fp32": 4, "fp16": 2, "bf16": 2}[chosen]
    if not on_gpu:
        return 4
    return _BYTES.get(str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "float32"))
                      .replace("torch.", ""), 4)


def rank_memory(plan: PrecomputePlan, config: PretrainedConfig, targets: Targets, layout: Layout,
                gpu: int | None) -> RankMemory:
    """What one rank of ``layout`` needs and has (see the module docstring for the terms); ``gpu`` is the rank's
    CUDA device index, None off a GPU."""
    size = run_dtype_bytes(plan.teacher.dtype, config, gpu is not None)
    total, norms = param_counts(config)
    n = layout.size
    replicated = norms if layout.kind == "tp" else 0
    weights = ((total - replicated) // n + replicated) * size
    # Layer placement splits the blocks, not a block's work: its activations are whole on each GPU in turn.
    activations = _activations(plan.batch, config, targets, layout.tensor, size)
    return RankMemory(weights, activations, *device_capacity(plan.teacher.device_memory, gpu))


def _activations(batch: BatchSetup, config: PretrainedConfig, targets: Targets, n: int, size: int) -> int:
    tokens = batch.batch_size * batch.max_length
    d = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * d)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    blocks = (4 * tokens * d + 2 * tokens * inter // n) * size
    if targets.wants_attention:
        blocks += batch.batch_size * -(-heads // n) * batch.max_length ** 2 * size
    kept = sum(len(t.hidden) for t in targets.streams.values()) * tokens * d * 2
    chunk = batch.logits_chunk or tokens
    head = min(chunk, tokens) * -(-vocab // n) * (size + 4) if targets.logit.name else 0
    return IN_FLIGHT * (blocks + kept) + head


def device_capacity(given: str | None, gpu: int | None) -> tuple[int, str]:
    """``(bytes, where the figure comes from)``: ``given`` (--device-memory), else the rank's GPU's (``gpu``: its
    index; ranks of one node may hold different cards), else the host's per process."""
    if given:  # 80GB / 24GiB / 512 MB: decimal GB, binary GiB
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]+)", given.strip())
        if not match or match.group(2).lower() not in _UNITS:
            raise PrecomputeError(f"device_memory: got {given!r}, expected a size such as 80GB, 24GiB or 512MB")
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()]), "--device-memory"
    if gpu is not None:
        return int(torch.cuda.get_device_properties(gpu).total_memory), torch.cuda.get_device_name(gpu)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // per_node, f"host memory / {per_node} process(es)"


def group_sizes(config: PretrainedConfig, at_least: int) -> int:
    """The smallest group size from ``at_least`` on that divides the teacher's query and key/value heads (what
    tensor parallelism splits); ``at_least`` itself where the config names no heads."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    fits = [n for n in range(at_least, max(heads, at_least) + 1) if heads and heads % n == 0 and kv % n == 0]
    return fits[0] if fits else at_least


def check_layout(memory: RankMemory, layout: Layout, config: PretrainedConfig | None = None) -> None:
    """Refuse a layout whose ranks cannot hold the teacher, before any weight loads.

    Raises:
        PrecomputeError: naming the need, the room, and a layout that would fit.
    """
    if memory.total <= USABLE * memory.capacity:
        return
    need = memory.weights * layout.size  # the unsplit weights (the replicated norms are negligible here)
    room = int(USABLE * memory.capacity - memory.activations)  # what this layout's activations leave
    wanted = group_sizes(config, -(-need // room)) if room > 0 and config is not None else None
    hint = (f"split it over at least {wanted} devices (--teacher-parallel tp:{wanted})"
            if wanted else "its activations alone do not fit: lower --batch-size / --max-length / --logits-chunk")
    raise PrecomputeError(f"teacher_parallel: {memory.describe(layout)}: more than {USABLE:.0%} of the device; "
                          f"{hint}")
