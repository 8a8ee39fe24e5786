"""Where a cache's attention targets come from: the maps, or the queries and keys (and values) they are made of.

``"maps"`` stores ``attention/{j}``, each sequence's ``[H', L, L]`` probabilities. ``"qk"`` / ``"qkv"`` store
``attention_q/{j}``, ``attention_k/{j}`` (and ``attention_v/{j}``): token rows ``[T, heads * head_dim]`` like hidden
states, after rotary embeddings, keys and values once per key/value head. A map costs H x L values per token;
queries and keys (H + H_kv) x head_dim whatever L. The spec's ``attention_scores`` records what rebuilding the
scores needs (see docs/cache-format.md). Pure names and checks; nothing reads data.
"""

from __future__ import annotations

from typing import Any

from kdcache.storage.errors import SpecError

ATTENTION_SOURCES: dict[str, tuple[str, ...]] = {"maps": ("attention",), "qk": ("attention_q", "attention_k"),
                                                 "qkv": ("attention_q", "attention_k", "attention_v")}
QKV_KINDS = ATTENTION_SOURCES["qkv"]
# The head counts and width, whether attention is causal, and per block (keyed by the block number as a string)
# the score scale, the sliding window (null: none) and the logit soft-cap (null: none).
SCORE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "causal", "blocks")
BLOCK_SCORE_KEYS = ("scaling", "sliding_window", "softcap")


def check_attention_source(source: str, scores: dict[str, Any] | None, layers: tuple[int, ...], *,
                           one_stream: bool, all_heads: bool, triangle: bool) -> None:
    """Raise ``SpecError`` unless ``source`` is known and, for queries and keys, the spec is one stream with every
    head and no triangle, and ``scores`` describe every block of ``layers``."""
    if source not in ATTENTION_SOURCES:
        raise SpecError(f"unknown attention_source {source!r}; expected one of {list(ATTENTION_SOURCES)}")
    if source == "maps":
        if scores is not None:
            raise SpecError("attention_scores describe a q/k attention source; attention_source is 'maps'")
        return
    if not one_stream or triangle or not all_heads:
        raise SpecError(f"attention_source {source!r}: one token stream only, all heads and no triangle (queries "
                        f"and keys are per token already)")
    if layers and not _complete(scores, layers):
        raise SpecError(f"attention_source {source!r} needs attention_scores with {list(SCORE_KEYS)}, and "
                        f"{list(BLOCK_SCORE_KEYS)} for each of blocks {list(layers)}; got {scores}")


def _complete(scores: object, layers: tuple[int, ...]) -> bool:
    """Whether ``scores`` is an object with every key of ``SCORE_KEYS`` and, under ``blocks``, an object of
    ``BLOCK_SCORE_KEYS`` per layer (an edited manifest may hold anything)."""
    if not isinstance(scores, dict) or not all(k in scores for k in SCORE_KEYS):
        return False
    blocks = scores["blocks"]
    return isinstance(blocks, dict) and all(
        isinstance(blocks.get(str(j)), dict) and all(k in blocks[str(j)] for k in BLOCK_SCORE_KEYS) for j in layers)
