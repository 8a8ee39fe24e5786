"""Token streams: how an array name maps to the rows it indexes and the offsets that locate them.

A single-stream cache (decoder-only or encoder teachers, format v1) has one token stream, named ``""``: its
arrays are ``input_ids``, ``hidden/{j}``, ``attention/{j}`` and ``logits/...``, located by ``offsets`` and
``attention_offsets``.

A seq2seq cache (format v2) has two streams, ``encoder`` and ``decoder``, each with its own token ids and
offsets (``encoder/input_ids``, ``encoder/offsets``...), plus cross-attention maps whose queries are decoder
tokens and whose keys are encoder tokens (``cross_attention/{j}``, located by ``cross_attention_offsets``).
Logits belong to the decoder stream.

Everything here is pure name arithmetic; nothing reads data.
"""

from __future__ import annotations

SEQ2SEQ_STREAMS = ("encoder", "decoder")
CROSS = "cross_attention"


def split_stream(name: str) -> tuple[str, str]:
    """Split an array name into ``(stream, rest)``.

    ``"encoder/hidden/3"`` -> ``("encoder", "hidden/3")``; ``"hidden/3"`` -> ``("", "hidden/3")``;
    ``"cross_attention/2"`` -> ``("", "cross_attention/2")`` (cross-attention spans both streams).
    """
    head, _, rest = name.partition("/")
    if head in SEQ2SEQ_STREAMS and rest:
        return head, rest
    return "", name


def kind_of(name: str) -> str:
    """The kind of an array, whatever its stream.

    One of ``input_ids``, ``offsets``, ``attention_offsets``, ``cross_attention_offsets``, ``hidden``,
    ``attention``, ``cross_attention``, ``logits`` (or the name itself for anything unknown).
    """
    _, rest = split_stream(name)
    return rest.split("/")[0]


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
    stream = streams[-1] if kind == "logits" else split_stream(name)[0]
    return (stream, stream) if kind == "attention" else (stream,)


def is_offsets(name: str) -> bool:
    """Whether ``name`` is an offsets array (token or attention rows)."""
    return kind_of(name).endswith("offsets")
