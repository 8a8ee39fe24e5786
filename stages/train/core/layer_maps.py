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

``include_embeddings`` prepends (0, 0).
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdcache.stages.common.stream_options import StreamValues
from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler
    from pydantic_core import CoreSchema

LAYER_MAP_KINDS = ("uniform", "last", "reverse", "all-to-one", "random", "explicit", "none")
_ALIASES = {"last-k": "last", "all_to_one": "all-to-one", "alltoone": "all-to-one", "skip": "uniform"}

Pair = tuple[int, int]


class LayerMapError(KdcacheError, ValueError):
    """A layer map is malformed, or needs layers that the student or the cache does not have."""


@dataclass(frozen=True)
class LayerMap:
    """A layer map as the config gives it, parsed once: a kind of ``LAYER_MAP_KINDS`` and, for ``explicit``, its
    pairs. The empty kind ``""`` means "not given" (a per-stream map then follows ``--layer-map``).

    ``str(m)`` is the canonical text (``uniform``, ``explicit:1-2,2-4``), which parses back to ``m``.
    """

    kind: str = "uniform"
    pairs: tuple[Pair, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LayerMap:
        """Read ``uniform``, ``last-k``, ``explicit:1-2,2-4``... (or ``""``: not given).

        Raises:
            LayerMapError: an unknown kind or unreadable pairs, naming the text.
        """
        name = text.strip().lower()
        if name.startswith("explicit:"):
            return cls("explicit", tuple(parse_layer_map(text.split(":", 1)[1])))
        name = _ALIASES.get(name, name)
        if name in LAYER_MAP_KINDS and name != "explicit" or name == "":
            return cls(name)
        named = [k for k in LAYER_MAP_KINDS if k != "explicit"]
        raise LayerMapError(f"unknown map {text!r}; use one of {', '.join(named)} or explicit:S-T,S-T")

    def __str__(self) -> str:
        return f"explicit:{','.join(f'{s}-{t}' for s, t in self.pairs)}" if self.kind == "explicit" else self.kind

    def build(self, num_student_layers: int, num_teacher_layers: int, *, seed: int = 0) -> list[Pair]:
        """The pairs for a student of M blocks and a teacher of N (``build_layer_map``)."""
        return build_layer_map(self.kind, num_student_layers, num_teacher_layers, seed=seed,
                               explicit=self.pairs or None)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
        """Let pydantic read a map from its text (``pipeline.config``); a bad text becomes a config problem."""
        from pydantic_core import core_schema

        def read(value: object) -> object:
            return cls.parse(value) if isinstance(value, str) else value

        return core_schema.no_info_before_validator_function(read, core_schema.is_instance_schema(cls))


class StreamMaps(StreamValues):
    """A ``LayerMap`` per token stream (``stages.common.stream_options``): ``last decoder:explicit:1-2``, or a
    YAML mapping ``{encoder: last, decoder: "explicit:1-2"}``; the map ``""`` means "not given"."""

    @staticmethod
    def read(text: str) -> LayerMap:
        """One stream's map from its text (``LayerMap.parse``)."""
        return LayerMap.parse(text)


def build_layer_map(
    kind: str,
    num_student_layers: int,
    num_teacher_layers: int,
    *,
    seed: int = 0,
    explicit: str | Sequence[Sequence[int]] | None = None,
    include_embeddings: bool = False,
) -> list[Pair]:
    """Build a layer map of one of ``LAYER_MAP_KINDS``.

    Args:
        kind: a map name; ``"explicit:1-2,2-4"`` (the CLI's form) is also accepted.
        num_student_layers: M, the student's block count.
        num_teacher_layers: N, the teacher's block count.
        seed: seeds the ``random`` map.
        explicit: the pairs of an ``explicit`` map, as a string or a sequence of pairs.
        include_embeddings: prepend (0, 0) (ignored for ``none``).

    Returns:
        ``[(student_layer, teacher_layer), ...]`` ordered by student layer (for ``explicit``: as given).
    """
    name = kind.strip().lower()
    if name.startswith("explicit:"):
        name, explicit = "explicit", kind.split(":", 1)[1]
    name = _ALIASES.get(name, name)
    if name == "none":
        return []
    if name == "explicit":
        if explicit is None:
            raise LayerMapError("an explicit layer map needs its pairs, e.g. explicit:1-2,2-4")
        pairs = parse_layer_map(explicit) if isinstance(explicit, str) else _as_pairs(explicit)
    elif name in LAYER_MAP_KINDS:
        teachers = _teacher_layers(name, num_student_layers, num_teacher_layers, seed)
        pairs = list(zip(range(1, num_student_layers + 1), teachers))
    else:
        raise LayerMapError(f"unknown layer map {kind!r}; choose one of {', '.join(LAYER_MAP_KINDS)}")
    if include_embeddings and (0, 0) not in pairs:
        pairs.insert(0, (0, 0))
    return pairs


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
        pairs: the map.
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
            f"student layer(s) {_join(bad_students)} do not exist (the student has layers 0..{student_depth})"
        )
    available = sorted(set(available_teacher_layers))
    missing = sorted({t for _, t in pairs} - set(available))
    if missing:
        needed = sorted({t for _, t in pairs} | set(available))
        problems.append(
            f"the layer map needs teacher {what} layers {_join(missing)} but the cache holds "
            f"{_join(available) or 'none'}; re-run precompute with --layers {','.join(map(str, needed))} "
            "or pick another map"
        )
    if problems:
        raise LayerMapError("; ".join(problems))


def pair_key(pair: Pair) -> str:
    """The name of a pair in module dicts and logs: (2, 4) -> ``"s2_t4"``."""
    return f"s{pair[0]}_t{pair[1]}"


def _teacher_layers(kind: str, m: int, n: int, seed: int) -> list[int]:
    """Teacher layer for student j = 1..M under a formula map."""
    if not 1 <= m <= n:
        raise LayerMapError(
            f"the {kind} layer map needs 1 <= student depth <= teacher depth, got M={m}, N={n}; "
            "use an explicit map for anything else"
        )
    uniform = [j * n // m for j in range(1, m + 1)]
    if kind == "uniform":
        return uniform
    if kind == "last":
        return [n - m + j for j in range(1, m + 1)]
    if kind == "reverse":
        return uniform[::-1]
    if kind == "all-to-one":
        return [math.ceil(n / 2)] * m
    shuffled = list(uniform)  # kind == "random"
    random.Random(seed).shuffle(shuffled)
    return shuffled


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


def _join(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values)
