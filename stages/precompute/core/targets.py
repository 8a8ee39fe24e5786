"""What a precompute keeps, per token stream, resolved against the teacher's config.

Layer numbering is HF's (docs/architecture.md): hidden layer j is ``hidden_states[j]`` (0 = embeddings) of the
stream's stack, attention block j is ``attentions[j-1]``; an encoder-decoder has an ``encoder`` and a ``decoder``
stack, each numbered on its own, and cross-attention blocks on the decoder.

Flags, and why they default the way they do:

* ``--layers`` selects hidden layers (of both stacks: the common case is "layers 2 and 4 of each stack");
  ``--encoder-layers`` / ``--decoder-layers`` override one stack, and ``none`` drops it.
* ``--attention-layers`` selects self-attention blocks (default: the blocks of the hidden selection);
  ``--encoder-attention-layers`` / ``--decoder-attention-layers`` override one stack.
* feature ``cross_attention`` adds cross-attention maps, by default at the decoder's self-attention blocks
  (or its hidden blocks), since those are the layers a student's decoder is matched on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdcache.stages.common import architectures
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.targets.draft.draft_layers import draft_layers, is_draft_preset
from kdcache.storage import FORMAT_VERSION, ArrayKind, LogitArray

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kdcache.stages.targets.attention import AttentionSettings
    from kdcache.stages.targets.logits import LogitSettings


CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


@dataclass(frozen=True)
class StreamTargets:
    """The layers kept of one token stream's stack of ``depth`` blocks."""

    hidden: tuple[int, ...] = ()
    attention: tuple[int, ...] = ()
    depth: int = 0


@dataclass(frozen=True)
class Targets:
    """Concrete layers, heads and logits of one precompute, per token stream (``""``, or ``encoder`` and
    ``decoder``); logits belong to the last stream."""

    streams: dict[str, StreamTargets]
    heads: tuple[int, ...] | None
    vocab_size: int
    num_heads: int
    causal: bool
    cross_attention: tuple[int, ...] = field(default=())
    # The logit mode and its fields as the family's one record (``LogitFlags.settings``), carried whole
    # into the spec, the fingerprint and the captures (which take it as their settings).
    logit: LogitSettings = field(kw_only=True)
    # The attention source and its score rules as the family's one record (``AttentionFlags.settings``;
    # ``capture.qk_capture.with_score_rules`` adds the rules), carried whole into the spec and the fingerprint.
    attention: AttentionSettings = field(kw_only=True)

    @functools.cached_property
    def logit_arrays(self) -> tuple[LogitArray, ...]:
        """The per-token logit arrays the mode stores, for these fields (none for ``head``), read once."""
        layout = self.logit.logit_layout
        return layout.arrays(self.logit) if layout else ()

    @property
    def wants_hidden(self) -> bool:
        return any(s.hidden for s in self.streams.values())

    @property
    def wants_attention(self) -> bool:
        """Whether any attention map is captured (the teacher then needs eager attention; queries and keys do not)."""
        maps = self.attention.source.teacher_maps
        return bool(self.cross_attention) or (maps and any(s.attention for s in self.streams.values()))


def depths_and_heads(config: PretrainedConfig) -> tuple[dict[str, int], int]:
    """Blocks per token stream and the attention heads of the teacher.

    Encoder-decoders (BART/mBART ``encoder_layers``, T5 ``num_layers``) have two stacks, and the heads are the
    smaller of the two stacks' counts, so a head subset valid for it is valid everywhere.
    """
    depths = architectures.stack_depths(config)  # an ArchitectureError is a KdcacheError: exit 2 as well
    if not architectures.is_encoder_decoder(config):
        return depths, int(getattr(config, "num_attention_heads", 0) or 0)
    keys = ("encoder_attention_heads", "decoder_attention_heads", "num_heads")
    heads = [int(h) for h in (getattr(config, k, None) for k in keys) if h]
    if not heads:
        raise PrecomputeError(f"cannot read the attention heads of a {config.model_type} config")
    return depths, min(heads)


def parse_layers(values: tuple[str, ...], depth: int, minimum: int, name: str) -> tuple[int, ...]:
    """Resolve a layer selection against a stack of ``depth`` (N) blocks: sorted, de-duplicated layer numbers.

    Args:
        values: ``("all",)``, ``("none",)`` (no layer), ``("draft",)`` (hidden states only: the three layers an
            EAGLE-3 draft fuses, ``stages.targets.draft.draft_layers.draft_layers``) or integer strings; negative
            numbers count from the last layer (-1 = N).
        minimum: the first valid layer (0 for hidden states, 1 for attention blocks).
        name: option name for messages.

    Raises:
        PrecomputeError: a layer outside ``minimum..depth``, with the valid range in the message.
    """
    if tuple(v.strip().lower() for v in values) == ("none",):
        return ()
    if tuple(v.lower() for v in values) == ("all",):
        return tuple(range(minimum, depth + 1))
    layers = set()
    try:
        if minimum == 0 and is_draft_preset(values):
            return tuple(sorted(set(draft_layers(depth))))
        for value in values:
            j = int(value)
            resolved = depth + 1 + j if j < 0 else j
            if not minimum <= resolved <= depth:
                raise PrecomputeError(f"{name}: layer {value} is out of range; this teacher has layers "
                                      f"{minimum}..{depth} ({depth} blocks"
                                      f"{', 0 = embeddings' if minimum == 0 else ''})")
            layers.add(resolved)
    except ValueError as exc:  # not a number, or a stack too shallow for the draft preset
        raise PrecomputeError(str(exc)) from None
    return tuple(sorted(layers))


def _stream(options: PrecomputeOptions, stream: str, depth: int) -> StreamTargets:
    """The hidden layers and self-attention blocks kept of one stream (its own values, else the unprefixed ones)."""
    t, prefix = options.targets, f"{stream}_" if stream else ""
    hidden_values = t.layers.get(stream) or t.layers.get("")
    hidden = parse_layers(hidden_values, depth, 0, f"{prefix}layers") if ArrayKind.HIDDEN in t.features else ()
    if ArrayKind.ATTENTION not in t.features:
        return StreamTargets(hidden, (), depth)
    given = t.attention_layers
    attention_flag = given and (given.get(stream) or given.get(""))
    if attention_flag:
        return StreamTargets(hidden, parse_layers(attention_flag, depth, 1, f"{prefix}attention_layers"), depth)
    # Default: the blocks of this stream's hidden selection (layer 0, the embeddings, has no attention map).
    blocks = tuple(j for j in parse_layers(hidden_values, depth, 0, f"{prefix}layers") if j >= 1)
    return StreamTargets(hidden, blocks, depth)


def _cross_attention(options: PrecomputeOptions, decoder: StreamTargets | None) -> tuple[int, ...]:
    t = options.targets
    if ArrayKind.CROSS_ATTENTION not in t.features or decoder is None:
        return ()
    values = t.attention_layers.get("cross") if t.attention_layers else None
    cross = parse_layers(values, decoder.depth, 1, "cross_attention_layers") if values else (
        decoder.attention or tuple(j for j in decoder.hidden if j >= 1))
    if not cross:
        raise PrecomputeError("cross_attention: no decoder block selected; set --attention-layers cross:BLOCKS")
    return cross


def resolve_targets(options: PrecomputeOptions, config: PretrainedConfig) -> Targets:
    """Turn the layer/head/logit options into concrete numbers for this teacher.

    Raises:
        PrecomputeError: a layer or head out of range, top-k above the vocabulary, attention asked for with no
            block left, or a triangle where no causal self-attention is kept.
    """
    t = options.targets
    depths, num_heads = depths_and_heads(config)
    streams = {name: _stream(options, name, depth) for name, depth in depths.items()}
    if is_draft_preset(t.layers.get("")) and "" not in streams:
        raise PrecomputeError("layers: the 'draft' preset (an EAGLE-3 draft's layers) is for a decoder-only target; "
                              "this teacher is an encoder-decoder")
    cross = _cross_attention(options, streams.get("decoder"))
    if ArrayKind.ATTENTION in t.features and not any(s.attention for s in streams.values()):
        flags = "--attention-layers" + (" (per stack: encoder:BLOCKS decoder:BLOCKS)" if len(streams) > 1 else "")
        raise PrecomputeError(f"attention: the layer selection keeps no block (only layer 0?); set {flags}")
    causal = architectures.is_causal_config(config)  # the same judgement stage two makes of the student
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    logit, top_k = t.logit.settings(t.features), t.logit.top_k
    kind = logit.kind
    for problem in kind.teacher_problems(options.engine.teacher, "" in streams, causal, vocab, top_k) if kind else ():
        raise PrecomputeError(problem)
    if kind and kind.teacher_head:
        # Stage two computes these logits with the teacher's head (``--logits head``, one causal stream), so the
        # last hidden layer (the LM head's input, after the final norm) is kept whatever ``--layers`` says.
        one = streams[""]
        streams = {"": StreamTargets(tuple(sorted({*one.hidden, one.depth})), one.attention, one.depth)}
    _check_triangle(options, streams, causal)
    attention = t.attention.settings()
    blocks = any(s.attention for s in streams.values())
    # the attention source's refusals of this teacher and the map options, when any block is kept
    for problem in attention.source.teacher_problems(options.engine.teacher, config, streams, t.triangle,
                                                     t.heads) if blocks else ():
        raise PrecomputeError(problem)
    heads = t.heads if (cross or blocks) else None
    if heads is not None and max(heads) >= num_heads:
        raise PrecomputeError(f"heads: head {max(heads)} is out of range; this teacher has heads 0..{num_heads - 1}")
    return Targets(streams, heads, vocab, num_heads, causal, cross, logit=logit, attention=attention)


def _check_triangle(options: PrecomputeOptions, streams: dict[str, StreamTargets], causal: bool) -> None:
    """Only a causal self-attention map (a decoder LM's, or an encoder-decoder's decoder) is a triangle."""
    if not options.targets.triangle:
        return
    if "decoder" in streams and not streams["decoder"].attention:
        raise PrecomputeError("triangle: only the decoder's causal self-attention can be stored as a triangle, "
                              "and no decoder attention block is selected; drop --triangle")
    if "" in streams and streams[""].attention and not causal:
        raise PrecomputeError(f"triangle: teacher {options.engine.teacher!r} is not causal, so its attention maps are "
                              f"not triangular; drop --triangle")


def settings_fingerprint(options: PrecomputeOptions, targets: Targets) -> dict[str, Any]:
    """The settings the targets depend on, as far as they are known before the weights load (key names as
    caches have always recorded them: ``layers`` for one stream, ``encoder_layers``... for two)."""
    out: dict[str, Any] = {"max_length": options.dataset.max_length}
    if "" in targets.streams:
        out.update(packing=options.dataset.packing, layers=list(targets.streams[""].hidden),
                   attention_layers=list(targets.streams[""].attention))
    else:
        out["max_target_length"] = options.dataset.max_target_length or options.dataset.max_length
        out.update({f"{s}_layers": list(t.hidden) for s, t in targets.streams.items()})
        out.update({f"{s}_attention_layers": list(t.attention) for s, t in targets.streams.items()})
        out["cross_attention_layers"] = list(targets.cross_attention)
    engine, storage = options.engine, options.storage
    return {**out, "heads": list(targets.heads) if targets.heads is not None else None,
            "features": list(options.targets.features), **targets.logit.fingerprint(),
            # Draws follow the seed, the batches and the head's chunks: a resume must form them alike.
            "sampling": {"seed": engine.seed, "batch_size": engine.batch_size, "logits_chunk": engine.logits_chunk}
            if targets.logit.kind and targets.logit.kind.draws else None,
            "dtype": storage.dtype, "codec": storage.codec_config, "bitround": storage.bitround,
            "triangle": options.targets.triangle, "format_version": FORMAT_VERSION,
            # Fused kernels round otherwise than eager ones: a resume must not mix them (absent when off, so that
            # earlier caches' fingerprints stay the same).
            **({"compile_teacher": True} if engine.compile_teacher else {}),
            **targets.attention.fingerprint(),
            # Recorded only when it is not the dtype's own (also when given explicitly, as --hidden-codec fp16), so
            # that the fingerprints of caches written before codecs stay the same.
            **({"hidden_codec": codec.record()} if not (codec := storage.resolved_hidden_codec).is_plain(storage.dtype)
               else {})}
