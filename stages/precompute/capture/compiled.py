"""``--compile-teacher``: the teacher's forward through ``torch.compile`` (inductor), so that a batch launches fused
kernels, fewer of them, each of which waits its turn for the GIL on a GPU host; with the eager forward kept.

The capture's hooks stay on the teacher's blocks and are traced into the compiled graph (what they keep is the
same arrays, within the rounding of fused kernels). Shapes are static (``dynamic=False``): rows packed to one
length compile once; length-bucketed batches compile once per length. Where compiling fails (no C++ compiler, an
architecture dynamo refuses), the run says why once and goes on eagerly, the failed batch run again. CUDA graphs
(``mode="reduce-overhead"``) are not used: a replay overwrites the previous replay's outputs while their copy to
the host may still be in flight.

What it costs, said in one note before the first batch (``compile_note``): each distinct batch shape is compiled
once, seconds to a minute apiece, and length-bucketed batches make many shapes. It pays on a GPU over many batches
of one shape; on a CPU inductor's kernels gain little over the eager ones, and compiling dominates: all-MiniLM-L6-v2
took 161.5 s compiled against 6.2 s eager on 2 cores (issue 53), 50.3 s against 0.7 s with ``--packing concat``.
The flag is still honoured there (a user may be trying it out before a GPU run), with the note saying so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kdcache.stages.precompute.rows.batching import plan_batches

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedModel

    from kdcache.stages.precompute.rows.data import TokenStreams
    from kdcache.storage import CacheSpec

T = TypeVar("T")


class TeacherCalls:
    """The teacher's whole model (``model``, its forward) and its base model (``base``, no LM head) as the capture
    calls them: compiled or eager.

    Args:
        model: the loaded teacher (its hooks are registered on its own blocks, so both forms run them).
        compiled: compile both calls (``--compile-teacher``).
    """

    def __init__(self, model: PreTrainedModel, compiled: bool) -> None:
        self.model: Callable[..., Any] = model
        self.base: Callable[..., Any] = model.base_model
        self._eager = (self.model, self.base)
        if compiled:
            # Graphs traced before in this process ran other hooks, or none (an earlier run, the projection fit's
            # capture), and dynamo may reuse one for this model: trace again, with this capture's hooks.
            torch._dynamo.reset()
            self.model, self.base = (torch.compile(module, dynamic=False) for module in self._eager)
        self.compiled = compiled

    def run(self, batch: Callable[[], T], reset: Callable[[], None]) -> T:
        """``batch()``; after a compile failure, ``reset()`` what it left and run it again, eagerly from then on."""
        try:
            return batch()
        except Exception as exc:
            if not self.compiled:
                raise  # an eager run's own error, as it is (no compiler module is loaded to judge it)
            from torch._dynamo.exc import TorchDynamoException
            from torch._inductor.exc import InductorError

            if not isinstance(exc, (TorchDynamoException, InductorError)):
                raise  # the model's or kdcache's own, not torch.compile's
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            print(f"kdcache precompute: --compile-teacher: compiling the teacher failed ({type(exc).__name__}: "
                  f"{reason}); it runs eagerly", file=sys.stderr)
            (self.model, self.base), self.compiled = self._eager, False
            reset()
            return batch()


def batch_shapes(lengths: np.ndarray, bounds: Iterable[tuple[int, int]], batch_size: int) -> int:
    """How many distinct ``(rows, length)`` batch shapes the shards in ``bounds`` make, batched as the stream
    batches them (``rows.plan_batches``): with static shapes, each is one compile."""
    shapes: set[tuple[int, int]] = set()
    for start, stop in bounds:
        shard = lengths[start:stop]
        shapes.update((len(batch), int(shard[batch].max())) for batch in plan_batches(shard, batch_size))
    return len(shapes)


def compile_note(device: torch.device, shapes: int) -> str:
    """The one line ``--compile-teacher`` prints before its first batch: what compiling costs here, and where it
    pays (on a CPU, that the eager forward is faster)."""
    cost = (f"each of this run's {shapes:,} batch shapes is compiled once before its first batch (seconds to a "
            "minute apiece; rows packed to one length, --packing concat, make one shape)")
    if device.type == "cpu":
        return (f"kdcache precompute: --compile-teacher on the CPU: the eager forward is faster here (all-MiniLM-L6-v2 "
                f"ran 25x slower compiled on 2 cores): {cost}, and fusing kernels saves little on a CPU; compiling "
                "pays on a GPU, where fused kernels cut the launches each batch waits on; drop --compile-teacher on "
                "this machine")
    return (f"kdcache precompute: --compile-teacher: {cost}; it pays on a long run of few shapes, where fused kernels "
            "cut the launches each batch waits on, and costs more than it saves on a short or many-shaped one")


def say_compile_cost(device: torch.device, data: TokenStreams, spec: CacheSpec, shards: Iterable[int],
                     batch_size: int) -> None:
    """Print ``compile_note`` for the batches of ``shards`` to stderr (rank 0 calls it, before the first batch)."""
    lengths = data.lengths(data.streams[0])  # the stream the compiled forward batches by
    shapes = batch_shapes(lengths, (spec.shard_range(k) for k in shards), batch_size)
    print(compile_note(device, shapes), file=sys.stderr, flush=True)
