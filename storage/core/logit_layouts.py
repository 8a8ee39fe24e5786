"""How each logit layout lies on disk: its arrays, their dtypes and codec group, and the spec fields it uses.

A *layout* is the storage side of a logit mode (``CacheSpec.logits``): model-free, numpy only, so that ``kdcache
verify`` / ``inspect`` and the storage tests read any cache without torch. The stage side of a mode (capture,
checks, loss, metric) lives in ``stages.targets.logits``; a new mode whose arrays follow an existing layout
registers only there. A layout is an object from the edge on: ``CacheSpec.logit_layout`` is the one its
``logits`` name resolves to (here, the one place a name is looked up), and the functions below take a holder of
that object (``LayoutFields``), never the name. Each mode is registered once: the stage side's ``LogitKind`` holds
its layout and registering the kind registers the layout (the built-in layouts are also in the table from the start,
so that storage reads every built-in cache without stages); the manifest's fields stay those of format 4.

Dtype rules of a ``LogitArray``: ``"vocab id"`` (the smallest unsigned type holding V-1), ``"float"`` (the
cache's float dtype, fp16 or bf16), or a numpy dtype name. Codec groups: ``"sparse"`` (the spec's ``topk_codec``,
made for ids and sorted values) or ``"activation"`` (the spec's ``codec``, bitround applies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.registry import Registry

VOCAB_ID = "vocab id"
FLOAT = "float"
TOPK_VALUE_FORMATS = ("fp16", "logprob")  # how top-k values are stored (see CacheSpec.topk_values)
TOPK_MASS = "logits/topk_mass"  # per token, the probability the top-k keep: handed over, recorded per shard, not stored


class LayoutFields(Protocol):
    """What decides a layout's arrays (``CacheSpec`` and stage one's ``Targets`` both have it)."""

    @property
    def logit_layout(self) -> LogitLayout | None: ...  # None: no logits
    @property
    def logprob_step(self) -> float: ...  # > 0: top-k values stored as quantised log-probs (topk_values logprob)


class SamplingFields(Protocol):
    """How many logits a token keeps and how they are drawn (``CacheSpec`` and stage one's ``Targets`` have it)."""

    @property
    def top_k(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def sample_temperature(self) -> float: ...


class LogitFields(LayoutFields, SamplingFields, Protocol):
    """The spec fields a layout validates (``CacheSpec`` has them all)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def topk_values(self) -> str: ...


@dataclass(frozen=True)
class LogitArray:
    """One stored per-token array ``[T, width]`` (``[T]`` when ``width`` is None).

    Attributes:
        name: the array's name, e.g. ``logits/topk_ids``.
        dtype: ``VOCAB_ID``, ``FLOAT`` or a numpy dtype name (``"float32"``, ``"uint8"``, ``"uint16"``).
        sparse: compressed with the top-k codec (True) or the activation codec.
        gap_coded: rows non-decreasing along the last axis, stored as the first value and the gaps.
        width: the spec field giving the last axis (``"top_k"``, ``"samples"``, ``"vocab_size"``), or None.
        descending: float rows that must be sorted in descending order (checked when a shard is encoded).
        mass: the per-token kept probability (``TOPK_MASS``) handed over with it is recorded in its ``lossy``
            record (what the array keeps of the teacher's distribution), and stored nowhere.
        logprob: log-probabilities handed over as floats, stored as gaps of ``-logp / spec.logprob_step`` and read
            back as float32.
    """

    name: str
    dtype: str
    sparse: bool = True
    gap_coded: bool = False
    width: str | None = None
    descending: bool = False
    mass: bool = False
    logprob: bool = False

    @property
    def exact(self) -> bool:
        """Handed to storage as computed (ids, counts, fp32 values, log-probs storage quantises), not rounded to
        the cache's float dtype first."""
        return self.dtype != FLOAT


@dataclass(frozen=True)
class LogitLayout:
    """A registered layout: ``arrays(spec)`` what it stores, ``validate(spec)`` raises ``SpecError`` on its fields
    (None: none of its own); ``logprob``: its values may be stored as quantised log-probabilities (``topk_values``
    "logprob"); ``file_sparse``: a backend that compresses a whole shard with one codec (Arrow) takes the top-k
    codec for a cache whose only arrays are this layout's (else the activation codec, as every cache before layouts
    had)."""

    name: str
    arrays: Callable[[LayoutFields], tuple[LogitArray, ...]]
    validate: Callable[[LogitFields], None] | None = None
    logprob: bool = False
    file_sparse: bool = False


LAYOUTS: Registry[LogitLayout] = Registry("logits kind", SpecError)


def register_layout(layout: LogitLayout) -> LogitLayout:
    """Add ``layout`` under its name (the value of ``CacheSpec.logits``)."""
    return LAYOUTS.add(layout.name, layout)


def layout_named(name: str | None) -> LogitLayout | None:
    """The layout registered as ``name`` (None: no logits): the edge where a manifest's or a flag's name becomes
    the object.

    Raises:
        SpecError: ``name`` is no registered layout.
    """
    return None if name is None else LAYOUTS.lookup(name)


def logit_arrays(spec: LayoutFields) -> tuple[LogitArray, ...]:
    """The per-token logit arrays ``spec`` stores, in order."""
    layout = spec.logit_layout
    return layout.arrays(spec) if layout else ()


def logit_array(spec: LayoutFields, name: str) -> LogitArray | None:
    """The record of logit array ``name`` of ``spec``, or None where it stores no such array."""
    return next((a for a in logit_arrays(spec) if a.name == name), None)


@dataclass(frozen=True)
class _Fields:
    logit_layout: LogitLayout | None
    logprob_step: float


def vocab_id_names() -> frozenset[str]:
    """Every array name any registered layout stores as vocabulary ids, in any of its forms (for readers that
    see a batch's names without its spec)."""
    forms = (_Fields(layout, step) for layout in LAYOUTS.values() for step in (0.0, 1.0))
    return frozenset(a.name for spec in forms for a in logit_arrays(spec) if a.dtype == VOCAB_ID)


def vocab_row_names() -> frozenset[str]:
    """Every array name any registered layout stores as float rows as wide as the vocabulary (``logits/full``):
    per token ``V`` values, the one target whose batch is ``[B, L, V]`` (stage two's feed keeps it in its stored
    dtype and reads it per batch)."""
    forms = (_Fields(layout, step) for layout in LAYOUTS.values() for step in (0.0, 1.0))
    return frozenset(a.name for spec in forms for a in logit_arrays(spec)
                     if a.dtype == FLOAT and a.width == "vocab_size")


def exact_arrays(spec: LayoutFields) -> tuple[str, ...]:
    """The logit arrays (and the kept mass) a capture hands to storage as computed (``LogitArray.exact``)."""
    return (*(a.name for a in logit_arrays(spec) if a.exact), TOPK_MASS)


def validate_logits(spec: LogitFields) -> None:
    """The logit part of ``storage.schema.spec.check_spec``: the layout exists, has a vocabulary, and its
    fields hold.

    Raises:
        SpecError: naming the bad field and what was expected.
    """
    layout = spec.logit_layout
    if layout and spec.vocab_size < 1:
        raise SpecError(f"logits={layout.name!r} needs vocab_size >= 1, got {spec.vocab_size}")
    if layout and layout.validate:
        layout.validate(spec)
    _check_value_format(spec, logprob_allowed=layout is not None and layout.logprob)


def _check_value_format(spec: LogitFields, logprob_allowed: bool) -> None:
    if spec.topk_values not in TOPK_VALUE_FORMATS or (spec.topk_values == "logprob") != (
            logprob_allowed and spec.logprob_step > 0):
        raise SpecError(f"topk_values {spec.topk_values!r} (logprob_step {spec.logprob_step}): expected fp16, or "
                        f"logprob with top-k logits and a step > 0")


# ---- the layouts of the four modes -------------------------------------------------------------------------
def _topk_arrays(spec: LayoutFields) -> tuple[LogitArray, ...]:
    # fp16: logits with their logsumexp; logprob: log-probs quantised to uint16 steps, rising along k in -logp.
    if spec.logprob_step > 0:
        values = LogitArray("logits/topk_values", "uint16", gap_coded=True, width="top_k", mass=True, logprob=True)
        return values, LogitArray("logits/topk_ids", VOCAB_ID, width="top_k")
    return (LogitArray("logits/topk_values", FLOAT, width="top_k", descending=True, mass=True),
            LogitArray("logits/topk_ids", VOCAB_ID, width="top_k"), LogitArray("logits/lse", "float32"))


def _topk_validate(spec: LogitFields) -> None:
    if not 1 <= spec.top_k <= spec.vocab_size:
        raise SpecError(f"top_k must be in 1..vocab_size ({spec.vocab_size}), got {spec.top_k}")


def _sampled_arrays(spec: LayoutFields) -> tuple[LogitArray, ...]:
    # per token, the distinct ids of N draws at sample_temperature (ascending, so gap-coded), how often each was
    # drawn (0 in unused slots) and the teacher's log-probability of each at that temperature
    return (LogitArray("logits/sample_ids", VOCAB_ID, gap_coded=True, width="samples"),
            LogitArray("logits/sample_counts", "uint8", width="samples"),
            LogitArray("logits/sample_logp", FLOAT, width="samples"))


def _sampled_validate(spec: LogitFields) -> None:
    if not (1 <= spec.samples <= 255 and spec.sample_temperature > 0):
        raise SpecError(f"sampled logits need 1..255 samples and a temperature > 0, got {spec.samples} at "
                        f"{spec.sample_temperature}")


def _full_arrays(spec: LayoutFields) -> tuple[LogitArray, ...]:
    return (LogitArray("logits/full", FLOAT, sparse=False, width="vocab_size"),)


def _no_arrays(spec: LayoutFields) -> tuple[LogitArray, ...]:
    # head: nothing per token; the teacher's LM head is stored beside the cache (teacher_head/) and reads the last
    # layer
    return ()


# The built-in layouts, each the object its stage-side kind holds (``LogitKind.layout``). Module-level functions,
# not lambdas, so that a spec holding its layout pickles (the writer processes receive it).
FULL_LAYOUT = register_layout(LogitLayout("full", _full_arrays))
TOPK_LAYOUT = register_layout(LogitLayout("topk", _topk_arrays, _topk_validate, logprob=True, file_sparse=True))
SAMPLED_LAYOUT = register_layout(LogitLayout("sampled", _sampled_arrays, _sampled_validate))
HEAD_LAYOUT = register_layout(LogitLayout("head", _no_arrays))
