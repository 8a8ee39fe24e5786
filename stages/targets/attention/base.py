"""The attention source interface and its registry: one ``AttentionSource`` per ``--attention-source`` value.

A source owns how feature ``attention`` lives in both stages: what stage one captures of the teacher (its maps
through hooks, or the queries, keys and values its blocks hand the attention kernel), what stage one refuses, the
cache's size per token for ``--estimate``, which arrays stage two streams and how it rebuilds scores from them,
what it records of the student (its maps, or its queries and keys), the refusals of the loss options, and its
``kdcache inspect`` line. What it stores (array kinds, token rows or maps) is the ``AttentionLayout`` object it
holds (``layout``, from ``storage.core.attention_source``), whose name is the source's: registering the source
registers the layout, so a source is registered once. A name is looked up where it enters (``get``); past that
edge a cache's source is ``of(spec.attention_layout)``, by the object. Callers never compare source names.

Nothing here imports torch, so that the option classes and ``kdcache inspect`` describe sources without it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kdcache.storage import DEFAULT_ATTENTION_SOURCE, AttentionLayout, KdcacheError, Registry, register_attention_layout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kdcache.storage import CacheSpec


class AttentionSourceError(KdcacheError, ValueError):
    """An unknown attention source."""


class AttentionSource:
    """One attention source. Subclasses set ``name`` and ``summary`` and override what differs from the defaults,
    which are those of maps.

    Attributes:
        layout: its storage facet, the array kinds stored per block and whether they are token rows; a subclass
            sets it, and takes its ``name`` from it.
        name: the ``--attention-source`` value and ``CacheSpec.attention_source``: its layout's name.
        summary: what it stores, for the flag's help.
    """

    layout: ClassVar[AttentionLayout]
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The name is the layout's, written once (a subclass that keeps its parent's layout keeps its name)."""
        super().__init_subclass__(**kwargs)
        if "layout" in cls.__dict__:
            cls.name = cls.layout.name

    # ---- stage one -------------------------------------------------------------------------------------------
    @property
    def teacher_maps(self) -> bool:
        """Stage one hooks the teacher's attention maps (which needs eager attention); else it records rows."""
        return not self.layout.token_rows

    @property
    def recorded_parts(self) -> tuple[str, ...]:
        """What stage one records of each block's attention inputs (``q``, ``k``, ``v``); () for maps."""
        return tuple(k.removeprefix("attention_") for k in self.layout.kinds) if self.layout.token_rows else ()

    def teacher_problems(self, teacher: str, config: PretrainedConfig, streams: Collection[str], triangle: bool,
                         heads: tuple[int, ...] | None) -> list[str]:
        """Problems of this source with a teacher of token ``streams`` ("" for one stream) and the map options."""
        return []

    def estimate_bytes(self, spec: CacheSpec, name: str, config: PretrainedConfig, tokens: int, sum_sq: int,
                       item: int) -> int:
        """Uncompressed bytes of attention block array ``name`` (named as maps in the spec sized before the
        teacher loads) over ``tokens`` tokens whose lengths' squares sum to ``sum_sq``, at ``item`` bytes a value;
        blocks kept per document depend on the data and count 0."""
        if spec.by_documents(name):
            return 0
        heads = len(spec.attention_heads) if spec.attention_heads else config_heads(config)
        return int(sum_sq * heads * item / (2 if spec.attention_triangle else 1))

    # ---- stage two -------------------------------------------------------------------------------------------
    @property
    def student_maps(self) -> bool:
        """Stage two reads the student's attention maps (eager attention); else it records its queries and keys."""
        return not self.layout.token_rows

    def stream_kinds(self, attention_loss: str) -> tuple[str, ...]:
        """The arrays stage two streams per cached block for ``--attention-loss`` (``kl`` or ``relation``)."""
        return self.layout.kinds

    def loss_problems(self, attention_loss: str) -> list[str]:
        """The attention loss against a cache of this source (the relation loss needs rows)."""
        if attention_loss == "relation" and not self.layout.token_rows:
            rows = " or ".join(n for n in names() if get(n).layout.token_rows)
            return [f"--attention-loss relation needs the teacher's queries and keys (and values), but the cache "
                    f"holds attention {self.name}; re-run precompute with --attention-source {rows}, or use "
                    f"--attention-loss kl"]
        return []

    def teacher_heads(self, scores: Mapping[str, Any] | None, stored: int | None) -> int | None:
        """The teacher heads stage two pairs with the student's: those stored per map (``stored``)."""
        return stored

    def describe(self, info: Mapping[str, Any]) -> str:
        """What ``kdcache inspect`` adds to each attention line, from the manifest's spec fields."""
        return ", causal triangle" if info.get("attention_triangle") else ""


def config_heads(config: PretrainedConfig) -> int:
    """The teacher's attention heads as its config names them (decoder-only or encoder)."""
    return int(getattr(config, "num_attention_heads", None) or getattr(config, "encoder_attention_heads", 0) or 0)


@dataclass(frozen=True)
class AttentionSettings:
    """Stage one's attention source as one record, built from its flags (``AttentionFlags.settings``) and carried
    whole by the run's targets into its ``CacheSpec`` and its settings fingerprint.

    The family alone names these fields (``spec_fields``, ``fingerprint``); nothing between the flags and the spec
    copies them one by one. Equality is the source's name and the scores (a pickled copy's source is another
    object).

    Attributes:
        source: the ``--attention-source`` value as its object.
        scores: how a source of token rows forms scores (head counts, causality, each block's rule), learnt from
            the loaded teacher (stage one's ``qk_capture`` replaces them); None before, and for maps.
        name: the source's name.
    """

    source: AttentionSource = field(compare=False, repr=False)
    scores: dict[str, Any] | None = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.source.name)

    def spec_fields(self) -> dict[str, Any]:
        """The ``CacheSpec`` keyword arguments of the source: token rows without score rules (no block kept) store
        nothing of theirs, so the spec names the default source."""
        rows = self.scores is None and self.source.layout.token_rows
        return {"attention_source": DEFAULT_ATTENTION_SOURCE if rows else self.name, "attention_scores": self.scores}

    def fingerprint(self) -> dict[str, str]:
        """The source's part of stage one's settings fingerprint; empty for the default, as caches before issue 23
        recorded."""
        return {} if self.source.layout.default else {"attention_source": self.name}


_SOURCES: Registry[AttentionSource] = Registry("attention source", AttentionSourceError)
S = TypeVar("S", bound=type[AttentionSource])


def register(cls: S) -> S:
    """Class decorator: register one instance of an ``AttentionSource`` subclass under its ``name``, and its layout
    in storage's table (a built-in layout is there already; a new source's arrives with it)."""
    register_attention_layout(cls.layout)
    _SOURCES.add(cls.name, cls())
    return cls


names = _SOURCES.names  # every registered source, in registration order
# The registered names as a live view: the flag's choices, which follow a source registered later (a test's).
choices = _SOURCES.keys


def get(name: str | None) -> AttentionSource:
    """The source registered as ``name`` (None: the default source).

    Raises:
        AttentionSourceError: naming ``name`` and the registered sources.
    """
    name = DEFAULT_ATTENTION_SOURCE if name is None else name
    return _SOURCES.lookup(name)


def of(layout: AttentionLayout) -> AttentionSource:
    """The source that holds ``layout`` (a cache's ``spec.attention_layout``, resolved from its name at the edge).

    Raises:
        AttentionSourceError: no registered source holds it (a layout registered without its source).
    """
    source = next((s for s in _SOURCES.values() if s.layout == layout), None)  # equal: a spec that was pickled
    if source is None:
        raise AttentionSourceError(f"no attention source holds the layout {layout.name!r}; expected one of "
                                   f"{', '.join(_SOURCES)}")
    return source


def usage() -> str:
    """The flag's help: each source and what it stores."""
    return "how feature 'attention' is stored: " + "; ".join(f"{s.name}: {s.summary}" for s in _SOURCES.values())
