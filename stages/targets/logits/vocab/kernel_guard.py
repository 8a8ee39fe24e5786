"""The road the vocabulary pass takes (``--vocab-kernel``), and the check that guards the fused kernel's road.

The fused Triton kernel (``fused_vocab``, ``vocab_kernels``) is the default road of every CUDA run whose terms have
feeds, and the interpreter that tests it on a CPU forgives things a GPU does not (a block size, a shape, a compile
error of one Triton version). So the first chunk of every new kind of pass — a new logits dtype, vocabulary size,
set of terms, temperature or dense teacher, the things a kernel is compiled for — runs both roads: the kernel on
the chunk, and the pure-torch chunk (autograd over the same terms) on a copy of its logits. Their values and
``dz`` are compared within a tolerance stated per dtype (``TOLERANCE``); from then on that kind of pass takes the
kernel alone. A kernel that raises or disagrees makes the run say so in one line and go on the pure-torch road for
the rest of the process (``auto``), or stops it with ``KernelCheckFailed`` (``fused``); ``torch`` never runs it.

What the check cannot catch: an error the device reports later and asynchronously (an illegal memory access
poisons the CUDA context; PyTorch then raises at some later call), or a kernel that is right on the checked chunk
and wrong on another of the same kind (nothing here compiles per chunk: the rows are the launch grid).
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.storage import KdcacheError

ChunkGrad = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class VocabRoad(Enum):
    """Which road the vocabulary pass takes where the fused kernel can run."""

    AUTO = "auto"  # the kernel, checked on each new kind of pass; the pure-torch pass where it fails
    FUSED = "fused"  # the kernel, checked the same way; a failure stops the run
    TORCH = "torch"  # never the kernel (liger-kernel's fused CE, where installed, still runs alone)

    @classmethod
    def of(cls, name: str | VocabRoad) -> VocabRoad:
        """The road named ``name``; an unknown name is refused, naming the choices."""
        if isinstance(name, VocabRoad):
            return name
        try:
            return cls(name)
        except ValueError:
            raise LossError(f"vocab_kernel {name!r} is not a road; expected one of "
                            f"{tuple(road.value for road in cls)}") from None


# The bound, element by element: |fast − reference| ≤ rtol · |reference| + noise(V) · c + floor, for dz in the
# logits' dtype, where c = Σ_t |weight_t · scale_t| / min(1, T) is the most a softmax entry of dz can weigh.
# Both roads read the same logits and compute in float32, then round dz once to the logits' dtype:
# - rounding the two float32 results can land on neighbouring values, one unit in the last place apart: rtol is
#   about that unit (bf16: 2⁻⁷ of the element, fp16: 2⁻¹⁰) and fp16's subnormals a fixed step (floor);
# - float32 sums the normaliser of each softmax over V in another order on each road: about √V · 2⁻²⁴ of each
#   probability (2e-5 at V = 128k), which survives where a KL's two softmaxes nearly cancel (a student close to
#   its teacher, α = 0) and dz is far below its softmax entries: hence a share of c, not of the largest |dz|,
#   five times that order (noise(V) = PROBABILITY_NOISE · √V · 2⁻²⁴: 1.1e-4 at V = 128k, 5e-6 at V = 320).
# A kernel 2% off on its dense part (the planted one of the tests) fails every dtype's bound wherever a
# probability passes noise(V) · c / (0.02 · its own term's share of c) (0.3% at V = 128k): a flat 1e-4 of c let it
# pass at V = 320, and a bound taken on the largest |dz| alone let it pass in float32, since a label's −1
# outweighs every softmax entry.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {  # dtype -> (rtol, floor)
    torch.float32: (1e-4, 0.0),
    torch.float16: (1.5e-3, 1.2e-7),
    torch.bfloat16: (1e-2, 0.0),
}
PROBABILITY_NOISE = 5.0
# A term's value sums per-row log-sum-exps of size about ln V: float32 gives each 1e-6 of that, ten times over.
VALUE_RTOL, VALUE_NOISE = 1e-4, 1e-5


@dataclass(frozen=True)
class PassFacts:
    """What the guard knows of a pass besides its chunks.

    Attributes:
        widths: per term, its number of target rows after its ``[C]`` counted mask (the rows' layout).
        kind: what the kernel is compiled for besides the logits (the terms' feeds, temperature, dense teacher).
        scales: ``[T]`` float32, each term's scale (1/n_valid, T²).
        temperature: the pass's T (``fused_vocab.temperature_of``).
    """

    widths: tuple[int, ...]
    kind: Hashable
    scales: torch.Tensor
    temperature: float


class KernelCheckFailed(KdcacheError, RuntimeError):
    """The fused kernel raised or disagreed with the pure-torch pass, and ``--vocab-kernel fused`` was asked for."""


@dataclass
class KernelGuard:
    """The process's road and what its checks found: the kinds of pass the kernel passed on, and why it was given
    up (None: it was not)."""

    road: VocabRoad = VocabRoad.AUTO
    trusted: set[Hashable] = field(default_factory=set)
    given_up: str | None = None

    def allows(self) -> bool:
        """Whether the kernel may run at all in this process."""
        return self.road is not VocabRoad.TORCH and self.given_up is None

    def guarded(self, fast: ChunkGrad, reference: ChunkGrad, facts: PassFacts) -> ChunkGrad:
        """``fast`` once this kind of pass has passed its check; until then a chunk grad that runs both roads.

        Args:
            fast, reference: ``grad(z [C, V], weights [T], *rows) -> (values [T], dz [C, V])``; ``fast`` may
                overwrite ``z`` (the kernel writes ``dz`` over it).
            facts: the pass's layout, kind, scales and temperature.
        """
        def live_reference(z: torch.Tensor, weights: torch.Tensor,
                           *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """``reference`` on the rows some term counts, its ``dz`` 0 elsewhere. The fused road hands every row
            to the chunk, padding too, whose targets may be garbage (NaN ids) that the pure-torch terms would index
            with; the pure-torch pass selects the counted rows first (a host sync, as here)."""
            index = _live_rows(rows, facts.widths).nonzero().squeeze(1)
            values, dz_live = reference(z.index_select(0, index), weights, *(r.index_select(0, index) for r in rows))
            return values, torch.zeros_like(z).index_copy_(0, index, dz_live.to(z.dtype))

        def grad(z: torch.Tensor, weights: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Triton compiles per argument dtype: fp16 / bf16 teacher rows (issue 63) are a kernel of their own.
            key = (z.device.type, z.dtype, z.shape[1], facts.kind, tuple(r.dtype for r in rows))
            if key in self.trusted:
                return fast(z, weights, *rows)
            if not self.allows():  # given up on an earlier chunk of this same pass
                return live_reference(z, weights, *rows)
            return self._checked(key, fast, live_reference, facts, z, weights, rows)
        return grad

    def _checked(self, key: Hashable, fast: ChunkGrad, reference: ChunkGrad, facts: PassFacts, z: torch.Tensor,
                 weights: torch.Tensor, rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Both roads on one chunk: the kernel's result where it agrees, else the pure-torch one (or a stop)."""
        original = z.clone()  # the kernel overwrites z with dz
        try:
            got = fast(z, weights, *rows)
        except Exception as exc:  # a compile or launch error: Triton's own types, RuntimeError, ValueError...
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return self._give_up(f"raised {type(exc).__name__}: {first}", reference, original, weights, rows)
        want = reference(original.clone(), weights, *rows)
        live = _live_rows(rows, facts.widths)
        if not bool(live.any()):  # a chunk of padding only: nothing to compare, so the next chunk is checked
            return want
        problem = _disagreement(got, want, live, facts, weights)
        if problem is not None:
            return self._give_up(problem, reference, original, weights, rows)
        self.trusted.add(key)
        return got

    def _give_up(self, what: str, reference: ChunkGrad, z: torch.Tensor, weights: torch.Tensor,
                 rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Say once what failed, with the device and the versions a report needs, and go on with the pure-torch
        chunk; under ``fused``, stop instead."""
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = "none"
        name = torch.cuda.get_device_name(z.device) if z.device.type == "cuda" else z.device.type
        where = f"{name} (torch {torch.__version__}, triton {triton})"
        if self.road is VocabRoad.FUSED:
            raise KernelCheckFailed(f"the fused vocabulary kernel {what} on {where}; --vocab-kernel fused stops "
                                    "here (--vocab-kernel auto goes on with the pure-torch pass, torch skips the "
                                    "kernel). Please report this message.")
        self.given_up = what
        print(f"kdcache: the fused vocabulary kernel {what} on {where}; this run goes on with the pure-torch pass "
              "(the same losses, slower). Please report this line; --vocab-kernel torch skips the kernel.",
              file=sys.stderr)
        return reference(z, weights, *rows)


def split_rows(rows: Sequence[torch.Tensor],
               widths: Sequence[int]) -> tuple[list[torch.Tensor], list[Sequence[torch.Tensor]]]:
    """A chunk's rows as a pass lays them out (per term, its ``[C]`` counted mask, then its ``widths[t]`` targets'
    rows) split per term: its counted mask (bool) and its targets' rows."""
    keeps, targets, at = [], [], 0
    for width in widths:
        keeps.append(rows[at].bool())
        targets.append(rows[at + 1:at + 1 + width])
        at += 1 + width
    return keeps, targets


def _live_rows(rows: Sequence[torch.Tensor], widths: Sequence[int]) -> torch.Tensor:
    """``[C]`` bool: the rows some term counts (a pass has at least one term)."""
    return torch.stack(split_rows(rows, widths)[0]).any(0)


def _disagreement(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                  live: torch.Tensor, facts: PassFacts, weights: torch.Tensor) -> str | None:
    """None when the kernel's values and ``dz`` are within the check's bounds for this chunk (see ``TOLERANCE``) of
    the reference's on the rows some term counts, and its ``dz`` is exactly 0 elsewhere, as the reference's is (the
    head's bias gradient sums every row); else what differs, in words."""
    (values, dz), (ref_values, ref_dz) = got, want
    if not bool((dz[~live] == 0).all()):
        return "wrote non-zero gradients at rows no term counts"
    dtype, vocab = ref_dz.dtype, ref_dz.shape[1]  # the logits' (the reference's dz is built like them)
    rtol, floor = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    scales = facts.scales.double().abs()
    heaviest = float((weights.double().abs() * scales).sum()) / min(1.0, facts.temperature)
    lse_size, noise = max(1.0, math.log(vocab)), PROBABILITY_NOISE * math.sqrt(vocab) * 2.0**-24
    value_bound = VALUE_RTOL * ref_values.double().abs() + VALUE_NOISE * lse_size * scales * int(live.sum())
    dz_bound = rtol * ref_dz[live].double().abs() + (noise * heaviest + floor)
    return (_beyond("values", values, ref_values, value_bound, dtype)
            or _beyond("dz", dz[live], ref_dz[live], dz_bound, dtype))


def _beyond(name: str, fast: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor,
            dtype: torch.dtype) -> str | None:
    """The element of ``fast`` furthest past its ``bound`` around ``reference``, in words; None: all within."""
    if not fast.numel():
        return None
    a, b, bound = fast.double().flatten(), reference.double().flatten(), bound.flatten()
    excess = (a - b).abs() - bound
    worst = int(excess.nan_to_num(float("inf")).argmax())
    if float(excess[worst]) <= 0:  # False for NaN
        return None
    return (f"disagrees with the pure-torch pass: {name} {float(a[worst]):.6g} where it is {float(b[worst]):.6g} "
            f"(bound {float(bound[worst]):.3g}, {dtype})")


GUARD = KernelGuard()


def set_road(road: VocabRoad | str) -> KernelGuard:
    """Start this process's road afresh (a run's start, or a test's): nothing trusted, nothing given up. The one
    guard is changed in place, so a module holding it sees the new road."""
    GUARD.road, GUARD.given_up = VocabRoad.of(road), None
    GUARD.trusted.clear()
    return GUARD
