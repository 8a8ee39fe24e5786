"""Token streams: how an array name maps to the rows it indexes and the offsets that locate them.

A single-stream cache (decoder-only or encoder teachers, format v1) has one token stream, named ``""``: its
arrays are ``input_ids``, ``hidden/{j}``, ``attention/{j}`` and ``logits/...``, located by ``offsets`` and
``attention_offsets``.

A seq2seq cache (format v2) has two streams, ``encoder`` and ``decoder``, each with its own token ids and
offsets (``encoder/input_ids``, ``encoder/offsets``...), plus cross-attention maps whose queries are decoder
tokens and whose keys are encoder tokens (``cross_attention/{j}``, located by ``cross_attention_offsets``).
Logits belong to the decoder stream.

A spec names its cached layers as data, one mapping ``{stream: {kind: layers}}`` (``layer_mapping``): stream ``""``
alone, or ``encoder`` and ``decoder``, whose cross-attention blocks are the decoder's kind ``cross_attention``.
Manifests keep the flat keys they have always had (``MANIFEST_LAYER_KEYS``).

Everything here is pure name arithmetic; nothing reads data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, SupportsInt

from kdcache.storage.core.errors import SpecError


class ArrayKind(str, Enum):
    """The kind of an array, its name's first part after the stream (``kind_of``): what code switches on.

    A ``str`` so that a member equals, hashes and formats as its name (``ArrayKind.HIDDEN == "hidden"``, and
    ``f"{ArrayKind.HIDDEN}/3" == "hidden/3"``): manifests, array names and dict keys are unchanged whichever a
    caller holds. ``__str__`` returns the value because Python 3.11+ would print ``ArrayKind.HIDDEN`` otherwise.
    """

    INPUT_IDS = "input_ids"
    LOSS_MASK = "loss_mask"
    POSITION_IDS = "position_ids"
    OFFSETS = "offsets"
    ATTENTION_OFFSETS = "attention_offsets"
    CROSS_ATTENTION_OFFSETS = "cross_attention_offsets"
    HIDDEN = "hidden"
    ATTENTION = "attention"  # maps [H', L, L], or the group of an attention source's arrays (attention_q...)
    CROSS_ATTENTION = "cross_attention"
    ATTENTION_Q = "attention_q"  # token rows of the qk / qkv attention sources (storage.core.attention_source)
    ATTENTION_K = "attention_k"
    ATTENTION_V = "attention_v"
    LOGITS = "logits"

    def __str__(self) -> str:
        """The name itself, as a plain string would print."""
        return self.value


_KINDS: dict[str, ArrayKind] = {kind.value: kind for kind in ArrayKind}  # a dict: kind_of runs per array name
# Per-sequence attention maps ``[H', L_q, L_k]`` (self- and cross-attention), stored by rows of their own offsets.
MAP_KINDS = frozenset({ArrayKind.ATTENTION, ArrayKind.CROSS_ATTENTION})
SEQ2SEQ_STREAMS = ("encoder", "decoder")
CROSS = "cross_attention"
LayerValues = Iterable[SupportsInt | str]  # layer numbers as given: ints, or digits from a flag or YAML
# The layer kinds each stream may cache, and the first layer of each kind (0 = embeddings; blocks from 1).
STREAM_KINDS = {"": ("hidden", "attention"), "encoder": ("hidden", "attention"),
                "decoder": ("hidden", "attention", CROSS)}
FIRST_LAYER = {"hidden": 0, "attention": 1, CROSS: 1}
STREAM_SETS = (("",), SEQ2SEQ_STREAMS)  # the token streams a cache can have
# How manifests spell each (stream, kind) list, unchanged since format 2 (a seq2seq manifest also says
# ``"layout": "seq2seq"`` and leaves hidden_layers / attention_layers empty): CacheSpec.to_dict / from_dict.
MANIFEST_LAYER_KEYS = {("", "hidden"): "hidden_layers", ("", "attention"): "attention_layers",
                       ("encoder", "hidden"): "encoder_hidden_layers",
                       ("encoder", "attention"): "encoder_attention_layers",
                       ("decoder", "hidden"): "decoder_hidden_layers",
                       ("decoder", "attention"): "decoder_attention_layers",
                       ("decoder", CROSS): "cross_attention_layers"}
SEQ2SEQ_LAYOUT = "seq2seq"  # the manifest's "layout" of a two-stream cache (one stream writes no layout)
SEQ2SEQ_MANIFEST_KEYS = ("layout", *(key for (stream, _), key in MANIFEST_LAYER_KEYS.items() if stream))


def stream_manifest_keys(layers: Mapping[str, Mapping[str, tuple[int, ...]]]) -> dict[str, Any]:
    """What a manifest adds for a complete ``layer_mapping`` beside ``hidden_layers`` / ``attention_layers``:
    nothing for one stream (format v1's spec), ``layout`` and each stream's lists for two."""
    if "" in layers:
        return {}
    return {"layout": SEQ2SEQ_LAYOUT, **{key: layers[stream][kind] for (stream, kind), key in
                                         MANIFEST_LAYER_KEYS.items() if stream}}


def stream_layers_of_manifest(spec: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The layer mapping of a two-stream manifest spec, or None for one stream (whose ``hidden_layers`` /
    ``attention_layers`` build it).

    Raises:
        SpecError: an unknown ``layout``, or per-stream keys without ``layout: seq2seq``.
    """
    layout = spec.get("layout", "single")
    if layout not in ("single", SEQ2SEQ_LAYOUT):
        raise SpecError(f"unknown layout {layout!r}; expected one of ['single', {SEQ2SEQ_LAYOUT!r}]")
    per_stream = {key: sk for sk, key in MANIFEST_LAYER_KEYS.items() if sk[0]}
    if layout == "single":
        stray = [key for key in per_stream if spec.get(key)]
        if stray:
            raise SpecError(f"{stray} are seq2seq fields; set layout='seq2seq' to use them")
        return None
    layers: dict[str, dict[str, Any]] = {stream: {} for stream in SEQ2SEQ_STREAMS}
    for key, (stream, kind) in per_stream.items():
        layers[stream][kind] = spec.get(key, ())
    return layers


def layer_mapping(given: Mapping[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{stream: {kind: layers}}`` checked and complete: every kind of each stream present, layers sorted and
    de-duplicated.

    Args:
        given: ``{stream: {kind: iterable of int}}``; kinds left out hold no layer.

    Raises:
        SpecError: streams other than ``""`` or ``encoder`` + ``decoder``, a kind the stream cannot hold, or a
            layer below the kind's first.
    """
    streams = tuple(s for s in STREAM_SETS if set(s) == set(given))
    if not streams:
        raise SpecError(f"layers has streams {sorted(given)}; expected [''] (one token stream) or "
                        f"{list(SEQ2SEQ_STREAMS)}")
    out = {}
    for stream in streams[0]:
        kinds = given[stream] or {}
        stray = sorted(set(kinds) - set(STREAM_KINDS[stream]))
        if stray:
            raise SpecError(f"layers[{stream!r}] has kinds {stray}; expected some of {list(STREAM_KINDS[stream])}")
        out[stream] = {kind: sorted_layers(f"{prefixed(stream, kind)} layers", kinds.get(kind, ()), FIRST_LAYER[kind])
                       for kind in STREAM_KINDS[stream]}
    return out


def spec_layers(layers: Mapping[str, Any], hidden: LayerValues, attention: LayerValues
                ) -> dict[str, dict[str, tuple[int, ...]]]:
    """A spec's complete ``layer_mapping``: ``layers``, or stream ``""`` of the one-stream conveniences
    ``hidden`` / ``attention`` when ``layers`` is empty.

    Raises:
        SpecError: the conveniences given beside two streams, or beside a different stream ``""``.
    """
    one = layer_mapping({"": {"hidden": hidden, "attention": attention}})[""]
    if not layers:
        return {"": one}
    mapping = layer_mapping(layers)
    if any(one.values()) and "" not in mapping:
        raise SpecError("a seq2seq spec names its layers per stream (layers={'encoder': ..., 'decoder': ...}); "
                        "hidden_layers and attention_layers must be empty")
    if any(one.values()) and one != mapping[""]:
        raise SpecError(f"hidden_layers {list(one['hidden'])} / attention_layers {list(one['attention'])} differ "
                        f"from layers {mapping}; give the layers once")
    return mapping


def sorted_layers(what: str, values: LayerValues, minimum: int) -> tuple[int, ...]:
    """``values`` as sorted, distinct ints, each at least ``minimum`` (``what`` names the field, for the error)."""
    layers = tuple(sorted({int(v) for v in values}))
    if any(j < minimum for j in layers):
        raise SpecError(f"{what} {list(values)} has a layer below {minimum}; expected layers >= {minimum}")
    return layers


def split_stream(name: str) -> tuple[str, str]:
    """Split an array name into ``(stream, rest)``.

    ``"encoder/hidden/3"`` -> ``("encoder", "hidden/3")``; ``"hidden/3"`` -> ``("", "hidden/3")``;
    ``"cross_attention/2"`` -> ``("", "cross_attention/2")`` (cross-attention spans both streams).
    """
    head, _, rest = name.partition("/")
    if head in SEQ2SEQ_STREAMS and rest:
        return head, rest
    return "", name


def kind_of(name: str) -> ArrayKind | str:
    """The kind of an array, whatever its stream: an ``ArrayKind`` (``hidden/3`` -> ``ArrayKind.HIDDEN``), or the
    name's first part as it is for a kind outside the vocabulary (a test's own attention source, row-store text).
    """
    _, rest = split_stream(name)
    head = rest.split("/")[0]
    return _KINDS.get(head, head)


def prefixed(stream: str, name: str) -> str:
    """``name`` inside ``stream``: ``prefixed("decoder", "hidden/2") == "decoder/hidden/2"``."""
    return f"{stream}/{name}" if stream else name


def token_offsets_name(stream: str) -> str:
    """The offsets array locating the token rows of ``stream``."""
    return prefixed(stream, "offsets")


def attention_offsets_name(name: str) -> str:
    """The offsets array locating the rows of attention array ``name`` (self- or cross-attention)."""
    if kind_of(name) == CROSS:
        return "cross_attention_offsets"
    stream, _ = split_stream(name)
    return prefixed(stream, "attention_offsets")


def ragged_streams(name: str, streams: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The stream each ragged dim of per-sequence array ``name`` follows, in order: one for token rows, two for an
    attention map (queries, keys). Cross-attention has decoder queries and encoder keys; logits live on the last
    stream (the only one, or the decoder)."""
    kind = kind_of(name)
    if kind == CROSS:
        return ("decoder", "encoder")
    stream = streams[-1] if kind == ArrayKind.LOGITS else split_stream(name)[0]
    return (stream, stream) if kind == ArrayKind.ATTENTION else (stream,)


def is_offsets(name: str) -> bool:
    """Whether ``name`` is an offsets array (token or attention rows)."""
    return kind_of(name).endswith("offsets")
