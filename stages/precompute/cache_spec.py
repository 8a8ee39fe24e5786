"""The cache's spec of a run: the resolved targets (``core.targets``) with the plan's encoding (``WriteSetup``) and
the rows' token arrays and lengths, which the targets, on the floor below the rows, never see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kdcache.storage import CROSS, CacheSpec, kind_of

if TYPE_CHECKING:
    from kdcache.stages.precompute.core.plan import WriteSetup
    from kdcache.stages.precompute.core.targets import Targets
    from kdcache.stages.precompute.rows.data import TokenStreams


def build_spec(write: WriteSetup, targets: Targets, data: TokenStreams) -> CacheSpec:
    """The ``CacheSpec`` of this run (storage validates it): one stream's layers, or each stack's, and the token
    arrays ``data`` (a ``data.TokenStreams``) carries beside the ids."""
    layers: dict[str, dict[str, Any]] = {s: {"hidden": t.hidden, "attention": t.attention}
                                         for s, t in targets.streams.items()}
    if "decoder" in layers:  # cross-attention blocks are the decoder's (decoder queries, encoder keys)
        layers["decoder"][CROSS] = targets.cross_attention
    causal = targets.streams.get("") or targets.streams["decoder"]  # the self-attention a triangle can hold
    triangle = bool(causal.attention and write.triangle)
    token_arrays = tuple(dict.fromkeys(str(kind_of(name)) for name in data.tokens))  # plain names, as manifests hold
    return CacheSpec(
        num_sequences=len(data), token_arrays=token_arrays, backend=write.backend, attention_heads=targets.heads,
        attention_triangle=triangle, vocab_size=targets.vocab_size if targets.logit.name else 0,
        **targets.logit.spec_fields(),  # the logit mode's fields, as its family names them
        **targets.attention.spec_fields(),  # the attention source's fields, as its family names them
        dtype=write.dtype, codec=write.codec, bitround=write.bitround, hidden_codec=write.hidden_codec, layers=layers,
        sequences_per_shard=shard_sequences(write.sequences_per_shard, data))


SHARD_TOKENS = 32_768  # tokens per shard when sized automatically: at d = 2,048 and four fp16 layers 512 MiB
MAX_SHARD_SEQUENCES = 256


def shard_sequences(given: int, data: TokenStreams) -> int:
    """Sequences per shard: ``given``, or (0) as many rows of the longest length as ``SHARD_TOKENS`` holds, at
    most ``MAX_SHARD_SEQUENCES``. A shard is the unit the writer threads take: one that holds the whole run (256
    rows of 2,048 tokens) would leave them idle until the teacher is done, then write everything at once."""
    if given:
        return given
    longest = max(data.longest(stream) for stream in data.streams)
    return max(1, min(MAX_SHARD_SEQUENCES, SHARD_TOKENS // max(1, longest)))
