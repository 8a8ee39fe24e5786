"""``--compile-teacher``: the teacher's forward through ``torch.compile`` (inductor), so that a batch launches fused
kernels, fewer of them, each of which waits its turn for the GIL on a GPU host; with the eager forward kept.

The capture's hooks stay on the teacher's blocks and are traced into the compiled graph (what they keep is the
same arrays, within the rounding of fused kernels). Shapes are static (``dynamic=False``): rows packed to one
length compile once; length-bucketed batches compile once per length. Where compiling fails (no C++ compiler, an
architecture dynamo refuses), the run says why once and goes on eagerly, the failed batch run again. CUDA graphs
(``mode="reduce-overhead"``) are not used: a replay overwrites the previous replay's outputs while their copy to
the host may still be in flight.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")


def compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.compile's (dynamo's or inductor's), not the model's or kdcache's own."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return isinstance(exc, (TorchDynamoException, InductorError))


class TeacherCalls:
    """The teacher's whole model and its base model as the capture calls them: compiled or eager.

    Args:
        model: the loaded teacher (its hooks are registered on its own blocks, so both forms run them).
        compiled: compile both calls (``--compile-teacher``).
        say: where the fallback's one line goes (rank 0's stderr by default).
    """

    def __init__(self, model: PreTrainedModel, compiled: bool, say: Callable[[str], None] | None = None) -> None:
        import torch

        self._eager = {"model": model, "base": model.base_model}
        self._calls: dict[str, Callable[..., Any]] = dict(self._eager)
        if compiled:
            # Graphs traced before in this process ran other hooks, or none (an earlier run, the projection fit's
            # capture), and dynamo may reuse one for this model: trace again, with this capture's hooks.
            torch._dynamo.reset()
            self._calls = {name: torch.compile(module, dynamic=False) for name, module in self._eager.items()}
        self.compiled = compiled
        self._say = say or (lambda line: print(line, file=sys.stderr))

    def model(self, **kwargs: Any) -> Any:
        """The whole model's forward."""
        return self._calls["model"](**kwargs)

    def base(self, **kwargs: Any) -> Any:
        """The base model's forward (no LM head)."""
        return self._calls["base"](**kwargs)

    def run(self, batch: Callable[[], T], reset: Callable[[], None]) -> T:
        """``batch()``; after a compile failure, ``reset()`` what it left and run it again, eagerly from then on."""
        try:
            return batch()
        except Exception as exc:
            if not (self.compiled and compile_failure(exc)):
                raise
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            self._say(f"kdcache precompute: --compile-teacher: compiling the teacher failed ({type(exc).__name__}: "
                      f"{reason}); it runs eagerly")
            self._calls, self.compiled = dict(self._eager), False
            reset()
            return batch()
