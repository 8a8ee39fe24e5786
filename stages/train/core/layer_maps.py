"""Layer maps: which teacher layer each student layer is matched with.

Numbering follows HF ``hidden_states``: 0 = embeddings, j = output of block j. A map is a list of
``(student_layer, teacher_layer)`` pairs. For a student of depth M and a teacher of depth N (j = 1..M):

=========== =====================================================
uniform     j -> ⌊jN/M⌋   (1-based, so student M meets teacher N)
last        j -> N − M + j (the top M teacher blocks, the top one included: this is DESIGN's "last-k";
            PKD-Last proper would also drop the pair (M, N), whose signal the logit loss already carries)
reverse     uniform's teacher layers in reverse order
all-to-one  every j -> ⌈N/2⌉
random      a seeded permutation of uniform's teacher layers
explicit    pairs, given as "1-2,2-4" or [(1, 2), (2, 4)]
none        [] (no hidden or attention term)
=========== =====================================================

An ``explicit`` map may name the embeddings (``0-0``).
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kdcache.stages.common.stream_options import StreamValues, read_before
from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler
    from pydantic_core import CoreSchema


class LayerMapKind(str, Enum):
    """The kind of a layer map, read from its name once (``LayerMap.parse``): what the map code switches on.

    A ``str`` so that a member equals, hashes and formats as its name (``LayerMapKind.ALL_TO_ONE == "all-to-one"``,
    ``f"{LayerMapKind.LAST}" == "last"``): configs, sweep folders and messages are unchanged whichever a caller
    holds. ``__str__`` returns the value because Python 3.11+ would print ``LayerMapKind.LAST`` otherwise.
    """

    UNIFORM = "uniform"
    LAST = "last"
    REVERSE = "reverse"
    ALL_TO_ONE = "all-to-one"
    RANDOM = "random"
    EXPLICIT = "explicit"
    NONE = "none"
    UNSET = ""  # not given: a per-stream map that follows the unprefixed one; never built

    def __str__(self) -> str:
        """The name itself, as a plain string would print."""
        return self.value


LAYER_MAP_KINDS = tuple(kind for kind in LayerMapKind if kind is not LayerMapKind.UNSET)  # the maps one can build
_BY_NAME = {kind.value: kind for kind in LayerMapKind}
_ALIASES = {"last-k": "last", "all_to_one": "all-to-one", "alltoone": "all-to-one", "skip": "uniform"}

Pair = tuple[int, int]


class LayerMapError(KdcacheError, ValueError):
    """A layer map is malformed, or needs layers that the student or the cache does not have."""


@dataclass(frozen=True)
class LayerMap:
    """A layer map as the config gives it, parsed once: a ``LayerMapKind`` and, for ``explicit``, its pairs. The
    kind ``UNSET`` (``""``) means "not given" (a per-stream map then follows ``--layer-map``). Callers ask the map
    what they need (``given``, ``maps_layers``, ``restricts_to_cache``), never compare its kind.

    ``str(m)`` is the canonical text (``uniform``, ``explicit:1-2,2-4``), which parses back to ``m``.
    """

    kind: LayerMapKind = LayerMapKind.UNIFORM
    pairs: tuple[Pair, ...] = ()

    def __post_init__(self) -> None:
        # A kind given by its name (``LayerMap("last")``, as tests write it) becomes its member, so that ``is`` holds.
        object.__setattr__(self, "kind", LayerMapKind(self.kind))

    @classmethod
    def parse(cls, text: str) -> LayerMap:
        """Read ``uniform``, ``last-k``, ``explicit:1-2,2-4``... (or ``""``: not given).

        Raises:
            LayerMapError: an unknown kind or unreadable pairs, naming the text.
        """
        name = text.strip().lower()
        if name.startswith("explicit:"):
            return cls(LayerMapKind.EXPLICIT, tuple(parse_layer_map(text.split(":", 1)[1])))
        kind = _BY_NAME.get(_ALIASES.get(name, name))
        if kind is not None and kind is not LayerMapKind.EXPLICIT:  # explicit comes with its pairs, as above
            return cls(kind)
        named = [k for k in LAYER_MAP_KINDS if k is not LayerMapKind.EXPLICIT]
        raise LayerMapError(f"unknown map {text!r}; use one of {', '.join(named)} or explicit:S-T,S-T")

    def __str__(self) -> str:
        if self.kind is LayerMapKind.EXPLICIT:
            return f"explicit:{','.join(f'{s}-{t}' for s, t in self.pairs)}"
        return self.kind.value  # the plain name: str() would hand back the member itself, whose repr differs

    @property
    def given(self) -> bool:
        """Whether the config gave this map (not ``UNSET``, a per-stream map that follows the unprefixed one)."""
        return self.kind is not LayerMapKind.UNSET

    @property
    def maps_layers(self) -> bool:
        """Whether the map pairs any layer: ``none`` switches its term off (the hidden one, or as ``cross:none`` the
        cross-attention one)."""
        return self.kind is not LayerMapKind.NONE

    @property
    def restricts_to_cache(self) -> bool:
        """Whether the map keeps just its pairs whose teacher layer the cache holds, as evaluation does: ``uniform``
        (the default), so that a cache of a few layers trains on them without a map naming them. Any other map must
        be met in full."""
        return self.kind is LayerMapKind.UNIFORM

    def build(self, num_student_layers: int, num_teacher_layers: int, *, seed: int = 0) -> list[Pair]:
        """The pairs for a student of M blocks and a teacher of N, by the kind held."""
        given = _as_pairs(self.pairs) if self.pairs else None
        return _pairs(self.kind, num_student_layers, num_teacher_layers, seed, given)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
        """Let pydantic read a map from its text (``pipeline.config``); a bad text becomes a config problem."""
        def read(value: object) -> object:
            return cls.parse(value) if isinstance(value, str) else value

        return read_before(cls, read)


class StreamMaps(StreamValues):
    """A ``LayerMap`` per token stream (``stages.common.stream_options``): ``last decoder:explicit:1-2``, or a
    YAML mapping ``{encoder: last, decoder: "explicit:1-2"}``; the map ``""`` means "not given"."""

    read = staticmethod(LayerMap.parse)  # one stream's map from its text


def parse_layer_map(spec: str) -> list[Pair]:
    """Parse ``"1-2,2-4"`` (student-teacher pairs, comma separated; spaces allowed) into pairs."""
    pairs: list[Pair] = []
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        parts = item.split("-")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise LayerMapError(
                f"cannot read layer pair {item!r} in {spec!r}; write student-teacher pairs like 1-2,2-4"
            )
        pairs.append((int(parts[0]), int(parts[1])))
    if not pairs:
        raise LayerMapError(f"the explicit layer map {spec!r} holds no pairs; write e.g. 1-2,2-4")
    return pairs


def validate_layer_map(
    pairs: Sequence[Pair], student_depth: int, available_teacher_layers: Iterable[int], *, what: str = "hidden"
) -> None:
    """Check a map against the student's depth and the teacher layers the cache holds.

    Args:
        student_depth: M; valid student layers are 0..M.
        available_teacher_layers: the cache's ``hidden_layers`` (or ``attention_layers``).
        what: "hidden" or "attention", for the message.

    Raises:
        LayerMapError: naming every out-of-range student layer and every missing teacher layer.
    """
    problems: list[str] = []
    bad_students = sorted({s for s, _ in pairs if not 0 <= s <= student_depth})
    if bad_students:
        problems.append(
            f"student layer(s) {', '.join(map(str, bad_students))} do not exist (the student has layers "
            f"0..{student_depth})"
        )
    available = sorted(set(available_teacher_layers))
    missing = sorted({t for _, t in pairs} - set(available))
    if missing:
        needed = sorted({t for _, t in pairs} | set(available))
        problems.append(
            f"the layer map needs teacher {what} layers {', '.join(map(str, missing))} but the cache holds "
            f"{', '.join(map(str, available)) or 'none'}; re-run precompute with --layers {','.join(map(str, needed))} "
            "or pick another map"
        )
    if problems:
        raise LayerMapError("; ".join(problems))


def pair_key(pair: Pair) -> str:
    """The name of a pair in module dicts and logs: (2, 4) -> ``"s2_t4"``."""
    return f"s{pair[0]}_t{pair[1]}"


def _pairs(kind: LayerMapKind, m: int, n: int, seed: int, given: Sequence[Pair] | None) -> list[Pair]:
    """The pairs of a map of ``kind``: ``given`` for ``explicit``, none for ``none``, else its formula's."""
    if kind is LayerMapKind.NONE:
        return []
    if kind is LayerMapKind.EXPLICIT:
        if given is None:
            raise LayerMapError("an explicit layer map needs its pairs, e.g. explicit:1-2,2-4")
        return list(given)
    if kind not in _FORMULAS:  # UNSET: a per-stream map that was not given has no pairs of its own
        raise LayerMapError(f"unknown layer map {str(kind)!r}; choose one of {', '.join(LAYER_MAP_KINDS)}")
    if not 1 <= m <= n:
        raise LayerMapError(
            f"the {kind} layer map needs 1 <= student depth <= teacher depth, got M={m}, N={n}; "
            "use an explicit map for anything else"
        )
    return list(zip(range(1, m + 1), _FORMULAS[kind](m, n, seed)))


def _uniform(m: int, n: int, seed: int) -> list[int]:
    """j -> ⌊jN/M⌋: spread evenly, student M meeting teacher N."""
    return [j * n // m for j in range(1, m + 1)]


def _shuffled(m: int, n: int, seed: int) -> list[int]:
    """Uniform's teacher layers in a seeded order."""
    shuffled = _uniform(m, n, seed)
    random.Random(seed).shuffle(shuffled)
    return shuffled


# The formula maps, by kind: the teacher layer of student j = 1..M, given M, N and the seed.
_FORMULAS: dict[LayerMapKind, Callable[[int, int, int], list[int]]] = {
    LayerMapKind.UNIFORM: _uniform,
    LayerMapKind.LAST: lambda m, n, seed: [n - m + j for j in range(1, m + 1)],
    LayerMapKind.REVERSE: lambda m, n, seed: _uniform(m, n, seed)[::-1],
    LayerMapKind.ALL_TO_ONE: lambda m, n, seed: [math.ceil(n / 2)] * m,
    LayerMapKind.RANDOM: _shuffled,
}


def _as_pairs(items: Sequence[Sequence[int]]) -> list[Pair]:
    pairs = []
    for item in items:
        try:
            student, teacher = (operator.index(v) for v in item)
        except (TypeError, ValueError):
            student = teacher = -1
        if student < 0 or teacher < 0:
            raise LayerMapError(f"a layer pair must be two non-negative ints (student, teacher), got {item!r}")
        pairs.append((student, teacher))
    if not pairs:
        raise LayerMapError("the explicit layer map holds no pairs")
    return pairs
