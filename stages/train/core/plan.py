"""The training plan: which cached arrays stage two streams and which student layer meets which teacher layer.

A cache holds named token streams (``storage.core.streams``): one, named ``""``, for decoder-only and encoder
teachers; ``encoder`` and ``decoder`` for encoder-decoder teachers, plus cross-attention maps between them. The
plan has one ``StreamPairs`` per stream, built by the same code for every architecture; only the depths and the
layer map of each stream differ:

* a single stream uses ``--layer-map`` against the student's depth;
* ``encoder`` / ``decoder`` use ``--encoder-layer-map`` / ``--decoder-layer-map`` (both default to ``--layer-map``)
  against the student's encoder / decoder depth, since the two stacks are usually shrunk by different factors;
* self-attention pairs follow the stream's map restricted to the cached attention blocks (or
  ``--attention-layers``); cross-attention pairs follow ``--cross-attention-map``, by default the decoder's map
  restricted to the cached cross-attention blocks.

Every problem is collected and reported at once (``checks.CacheCheckError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdcache.stages.targets import attention as attention_sources, logits as logit_kinds
from kdcache.stages.targets.attention import AttentionSource
from kdcache.stages.targets.hidden.device_codecs import hidden_width, load_projection
from kdcache.stages.targets.logits import LogitKind
from kdcache.stages.train.core.checks import (
    CacheCheckError,
    checked_map,
    cross_problems,
    feature_problems,
    restricted_map,
    stream_problems,
    vocab_problems,
)
from kdcache.stages.train.core.layer_maps import LayerMap, Pair
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.core.student import StudentFacts
from kdcache.storage import CROSS, ArrayKind, prefixed, split_stream

if TYPE_CHECKING:
    from kdcache.storage import CacheReader, CacheSpec


@dataclass(frozen=True)
class StreamPairs:
    """One token stream's layer pairs: ``stream`` is ``""``, ``"encoder"`` or ``"decoder"``."""

    stream: str
    hidden_pairs: tuple[Pair, ...] = ()
    attention_pairs: tuple[Pair, ...] = ()
    teacher_hidden_sizes: dict[int, int] = field(default_factory=dict)  # d_t per teacher hidden layer
    teacher_depth: int = 0


@dataclass(frozen=True)
class TrainPlan:
    """What training reads from the cache and how the loss uses it.

    ``streams`` ends with the stream the logits belong to (the only one, or ``decoder``): ``main``, which is what
    evaluation and reports show.
    """

    streams: tuple[StreamPairs, ...]
    logit_kind: LogitKind | None  # the cache's logit kind, which forms the KL term, or None (no KL)
    names: tuple[str, ...]  # arrays streamed per sequence
    source: AttentionSource  # the cache's attention source (what the attention term reads of teacher and student)
    cross_attention_pairs: tuple[Pair, ...] = ()
    attention_scores: dict[str, Any] | None = None  # a q/k cache's score record (CacheSpec.attention_scores)
    notes: tuple[str, ...] = ()  # what the plan chose for the user that they should hear (train prints them)

    @property
    def main(self) -> StreamPairs:
        """The stream that carries the logits (and the CE labels)."""
        return self.streams[-1]

    @property
    def wants_hidden(self) -> bool:
        """Whether any term reads the student's hidden states."""
        return any(s.hidden_pairs for s in self.streams)

    @property
    def wants_attention(self) -> bool:
        """Whether any term reads the student's attention maps (self or cross); a q/k cache's term reads the
        student's queries and keys instead (``qk_blocks``)."""
        maps = self.source.student_maps and any(s.attention_pairs for s in self.streams)
        return bool(self.cross_attention_pairs) or maps

    @property
    def qk_blocks(self) -> tuple[int, ...]:
        """The student blocks whose queries and keys a q/k cache's attention term reads."""
        if self.source.student_maps:
            return ()
        return tuple(sorted({s for pairs in self.streams for s, _ in pairs.attention_pairs}))

    def to_json(self) -> dict[str, Any]:
        """The plan as ``plan.json`` records it (the main stream's pairs at the top, as evaluation reads them; the
        logit mode by its name)."""
        out: dict[str, Any] = {"hidden_pairs": self.main.hidden_pairs, "attention_pairs": self.main.attention_pairs,
                               "logits": self.logit_kind.name if self.logit_kind else None, "names": self.names}
        if len(self.streams) > 1:
            out["streams"] = {s.stream: {"hidden_pairs": s.hidden_pairs, "attention_pairs": s.attention_pairs}
                              for s in self.streams}
            out["cross_attention_pairs"] = self.cross_attention_pairs
        return out


@dataclass(frozen=True)
class _Stream:
    """How one cached stream meets the student: the cached layers, both depths, and the map that pairs them."""

    name: str
    hidden: tuple[int, ...]
    attention: tuple[int, ...]
    teacher_depth: int
    student_depth: int
    layer_map: LayerMap


def teacher_depth(reader: CacheReader, stream: str = "") -> int:
    """N, the block count of the teacher stack behind ``stream``, needed by the formula layer maps.

    Stage one records it (``fingerprints.teacher.num_layers``, or ``num_encoder_layers`` /
    ``num_decoder_layers``); otherwise the deepest cached layer of the stream is the best estimate (exact
    whenever the cache holds the stack's last layer).
    """
    teacher = (reader.fingerprints or {}).get("teacher") or {}
    keys = (f"num_{stream}_layers",) if stream else ("num_layers", "num_hidden_layers")
    for key in keys:
        if isinstance(teacher.get(key), int) and teacher[key]:
            return int(teacher[key])
    layers = [j for kind in reader.spec.layers[stream].values() for j in kind]  # the decoder's: cross too
    return max(layers, default=0)


def _stream_pairs(options: TrainOptions, s: _Stream, problems: list[str],
                  notes: list[str]) -> tuple[list[Pair], list[Pair]]:
    """(hidden pairs, self-attention pairs) of one stream; problems and notes are appended."""
    what = prefixed(s.name, "hidden").replace("/", " ")
    hidden: list[Pair] = []
    seed = options.data.seed
    if options.loss.gamma > 0 and s.layer_map.restricts_to_cache and s.hidden:
        # uniform (the default, or named) keeps its pairs the cache holds, as evaluation does: a cache of a few
        # layers trains on them without a map naming them; every other map must be met in full.
        hidden = restricted_map(s.layer_map, s.student_depth, s.teacher_depth, s.hidden, seed, what, problems, notes)
    elif options.loss.gamma > 0 and s.layer_map.maps_layers and s.hidden:
        hidden = checked_map(s.layer_map, seed, s.student_depth, s.teacher_depth, s.hidden, what, problems)
    what = prefixed(s.name, "attention").replace("/", " ")
    attention: list[Pair] = []
    if options.loss.delta > 0 and s.attention:
        given = options.maps.attention_map(s.name)
        if given is not None:
            attention = checked_map(given, seed, s.student_depth, s.teacher_depth, s.attention, what, problems)
        else:
            attention = restricted_map(s.layer_map, s.student_depth, s.teacher_depth, s.attention, seed, what,
                                       problems)
    return hidden, attention


def _cross_pairs(options: TrainOptions, spec: CacheSpec, decoder: _Stream | None, problems: list[str]) -> list[Pair]:
    """(student decoder block, teacher decoder block) pairs of the cross-attention term."""
    cross, seed = options.maps.attention_map("cross"), options.data.seed
    cached, what = spec.layers_of(CROSS, "decoder"), "cross attention"
    if decoder is None or options.loss.delta <= 0 or not cached or cross is not None and not cross.maps_layers:
        return []
    if cross is not None:
        return checked_map(cross, seed, decoder.student_depth, decoder.teacher_depth, cached, what, problems)
    return restricted_map(decoder.layer_map, decoder.student_depth, decoder.teacher_depth, cached, seed, what,
                          problems)


def stream_names(spec: CacheSpec, pairs: dict[str, list[Pair]], logits: LogitKind | None,
                 attention_kinds: tuple[str, ...] = ("attention",)) -> list[str]:
    """The per-sequence arrays to stream, nothing the losses do not read: every stream's ids, the teacher layers
    the pairs use (``pairs`` is keyed by array group, e.g. ``encoder/hidden`` or ``cross_attention``; the
    ``attention`` group reads ``attention_kinds``: maps, or a q/k cache's ``attention_q``...), logits."""
    names = spec.token_names()  # ids, and the loss masks and document positions that decide what counts
    for group, group_pairs in pairs.items():
        stream, kind = split_stream(group)
        kinds = attention_kinds if kind == ArrayKind.ATTENTION else (kind,)
        names += [prefixed(stream, f"{k}/{t}") for t in sorted({t for _, t in group_pairs}) for k in kinds]
    names += spec.logit_arrays() if logits else []
    if logits is not None and logits.teacher_head:  # the head's input: the last layer, which such a cache holds
        # Head mode is for one-stream (decoder-only) caches, whose last layer is the deepest one kept (stage one
        # always keeps it; the loop checks the head's own record against it).
        names.append(f"hidden/{max(spec.hidden_layers)}")
    return list(dict.fromkeys(names))


def plan_training(options: TrainOptions, reader: CacheReader, student: StudentFacts,
                  student_tokenizer: dict[str, Any] | None) -> TrainPlan:
    """Compare cache and student; return the plan, or raise listing every problem.

    Args:
        options: the run's options (weights decide which features are needed).
        student_tokenizer: the student's tokenizer fingerprint, or None when it has no tokenizer.

    Raises:
        CacheCheckError: one or more mismatches, each explained.
    """
    spec = reader.spec
    problems = stream_problems(spec, student)
    if problems:  # the layer maps below would only add noise
        raise CacheCheckError(problems)
    if options.loss.cross_tokenizer:  # another tokenizer is the point: the checks are the cross path's own
        problems += cross_problems(reader, options)
    else:
        problems += vocab_problems(reader, student.vocab_size, student_tokenizer,
                                   logits_needed=options.loss.kl_weight > 0)
    problems += feature_problems(options, spec, student)
    depths = {"": student.num_layers, "encoder": student.num_layers, "decoder": student.decoder_layers}
    streams = [_Stream(name, hidden, attention, teacher_depth(reader, name), depths[name],
                       options.maps.for_stream(name)) for name, hidden, attention in spec.stream_layers()]
    pairs: dict[str, list[Pair]] = {}
    notes: list[str] = []
    for s in streams:
        pairs[prefixed(s.name, "hidden")], pairs[prefixed(s.name, "attention")] = _stream_pairs(options, s, problems,
                                                                                              notes)
    pairs[CROSS] = _cross_pairs(options, spec, next((s for s in streams if s.name == "decoder"), None), problems)
    problems += _relation_problems(options, spec, student)
    if problems:
        raise CacheCheckError(problems)
    logits = logit_kinds.of(spec.logit_layout) if options.loss.kl_weight > 0 else None
    source = attention_sources.of(spec.attention_layout)
    # What the attention term reads of a cached block: its map, its queries and keys for the KL, or every cached
    # kind (queries, keys and values when stored) for the relation loss.
    names = stream_names(spec, pairs, logits, source.stream_kinds(options.loss.attention.attention_loss))
    sizes, heads = _target_shapes(reader, names)
    heads = source.teacher_heads(spec.attention_scores, heads)
    uneven = heads is not None and student.num_heads and heads % student.num_heads
    if options.loss.attention.attention_loss == "kl" and uneven:  # relations pair any head counts
        raise CacheCheckError([f"the cache stores {heads} attention heads per layer and the student has "
                               f"{student.num_heads}; the attention loss averages teacher heads in groups of "
                               "H_t/H_s, so H_t must be a multiple of H_s (or cache a head subset that is)"])
    plans = tuple(StreamPairs(s.name, tuple(pairs[prefixed(s.name, "hidden")]),
                              tuple(pairs[prefixed(s.name, "attention")]), sizes.get(s.name, {}), s.teacher_depth)
                  for s in streams)
    return TrainPlan(plans, logits, tuple(names), source, tuple(pairs[CROSS]), spec.attention_scores, tuple(notes))


def _relation_problems(options: TrainOptions, spec: CacheSpec, student: StudentFacts) -> list[str]:
    """The relation loss splits each side's query and key/value rows into R heads: R must divide every width,
    checked here rather than at the first step, after DeepSpeed has started."""
    loss, scores = options.loss, spec.attention_scores
    if loss.delta <= 0 or loss.attention.attention_loss != "relation" or not scores:
        return []
    given = loss.attention.relation_heads
    relation_heads = given or student.num_heads
    head_dim = int(scores["head_dim"])
    widths = {"the teacher's queries": int(scores["num_heads"]) * head_dim,
              "the teacher's keys and values": int(scores["num_kv_heads"]) * head_dim}
    widths.update(zip(("the student's queries", "the student's keys and values"), student.attention_widths()))
    bad = [f"{name} ({width})" for name, width in widths.items() if width % relation_heads]
    return [f"--relation-heads {relation_heads}{'' if given else ' (the student heads)'} does not "
            f"divide the width of {', '.join(bad)}; choose R dividing {sorted(set(widths.values()))}"] if bad else []


def _target_shapes(reader: CacheReader, names: list[str]) -> tuple[dict[str, dict[int, int]], int | None]:
    """Teacher widths d_t per stream and hidden layer, and the stored heads H', from the cache's first sequence."""
    described = [reader.spec.array(name) for name in names]
    hidden = [a.name for a in described if a.kind == ArrayKind.HIDDEN]
    attention = [a.name for a in described if a.is_map][:1]
    if not hidden + attention:
        return {}, None
    first = reader.get(reader.shard_ranges[0][0], names=hidden + attention)
    sizes: dict[str, dict[int, int]] = {}
    projection = load_projection(reader)  # a rank cache's layers are as wide as their bases
    for name in hidden:
        stream, rest = split_stream(name)
        sizes.setdefault(stream, {})[int(rest.split("/")[1])] = hidden_width(
            reader.spec.hidden_codec, int(first[name].shape[-1]), projection.width(name) if projection else None)
    heads = int(first[attention[0]].shape[0]) if attention else None
    return sizes, heads


def unused_targets(spec: CacheSpec, plan: TrainPlan, options: TrainOptions) -> list[str]:
    """Cached targets this run's weights and maps leave unused, each with the reason and how to use it.

    An empty list when every cached target is used.
    """
    notes = []
    by_stream = {s.stream: s for s in plan.streams}
    for stream, hidden_cached, attention_cached in spec.stream_layers():
        used = by_stream.get(stream, StreamPairs(stream))
        hidden = sorted(set(hidden_cached) - {t for _, t in used.hidden_pairs})
        if hidden:
            layer_map = options.maps.for_stream(stream)
            why = ("--gamma is 0" if options.loss.gamma <= 0 else "--layer-map is none" if not layer_map.maps_layers
                   else f"the layer map {str(layer_map)!r} pairs no student layer with them")
            notes.append(f"{prefixed(stream, 'hidden').replace('/', ' ')} layers {', '.join(map(str, hidden))} ({why})")
        attention = sorted(set(attention_cached) - {t for _, t in used.attention_pairs})
        if attention:
            why = ("--delta is 0: set --delta > 0 to distil attention maps" if options.loss.delta <= 0
                   else "the attention map pairs no student block with them")
            notes.append(f"{prefixed(stream, 'attention').replace('/', ' ')} layers {', '.join(map(str, attention))} "
                         f"({why})")
    if spec.logits and plan.logit_kind is None:
        notes.append(f"logits/{spec.logits} (--beta is 0)")
    return notes
