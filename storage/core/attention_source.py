"""Where a cache's attention targets come from, the storage facet: each attention source's stored array kinds.

``maps`` stores ``attention/{j}``, each sequence's ``[H', L, L]`` probabilities. ``qk`` / ``qkv`` store
``attention_q/{j}``, ``attention_k/{j}`` (and ``attention_v/{j}``): token rows ``[T, heads * head_dim]`` like hidden
states, after rotary embeddings, keys and values once per key/value head. A map costs H x L values per token;
queries and keys (H + H_kv) x head_dim whatever L. The spec's ``attention_scores`` records what rebuilding the
scores needs (see docs/cache-format.md). Pure names and checks; nothing reads data.

The stage facet (capture, loss, estimate, inspect) is ``stages.targets.attention``: each ``AttentionSource``
holds its layout object, and registering the source registers the layout, so a source is registered once (the
built-in layouts are in the table from the start, so that storage reads every built-in cache without stages).
``CacheSpec.attention_layout`` is the object its ``attention_source`` name resolves to, at construction; nothing
outside these two registries compares a source's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.registry import Registry


@dataclass(frozen=True)
class AttentionLayout:
    """How one attention source lies in a shard.

    Attributes:
        name: the ``--attention-source`` value and ``CacheSpec.attention_source``.
        kinds: the array kinds stored per attention block (``attention`` for maps; ``attention_q``... for rows).
        token_rows: the arrays are ``[T, heads * head_dim]`` token rows (coded like hidden states, scored through
            ``attention_scores``) rather than per-sequence maps.
        default: the source every cache before issue 23 holds; ``to_dict()`` leaves it out of the manifest.
    """

    name: str
    kinds: tuple[str, ...]
    token_rows: bool
    default: bool = False


ATTENTION_LAYOUTS: Registry[AttentionLayout] = Registry("attention_source", SpecError)


def register_attention_layout(layout: AttentionLayout) -> AttentionLayout:
    """Add ``layout`` to the registry (a test may add its own); returns it."""
    return ATTENTION_LAYOUTS.add(layout.name, layout)


MAPS_LAYOUT = register_attention_layout(AttentionLayout("maps", ("attention",), token_rows=False, default=True))
QK_LAYOUT = register_attention_layout(AttentionLayout("qk", ("attention_q", "attention_k"), token_rows=True))
QKV_LAYOUT = register_attention_layout(AttentionLayout("qkv", ("attention_q", "attention_k", "attention_v"),
                                                         token_rows=True))
DEFAULT_ATTENTION_SOURCE = MAPS_LAYOUT.name


def token_row_kinds() -> tuple[str, ...]:
    """Every kind of token rows a registered source stores (coded like hidden states, shaped ``[T, width]``)."""
    return tuple(dict.fromkeys(k for layout in ATTENTION_LAYOUTS.values() if layout.token_rows for k in layout.kinds))


QKV_KINDS = token_row_kinds()  # the built-in sources' (storage.hidden_codecs.CODED_KINDS reads it at import)
# The head counts and width, whether attention is causal, and per block (keyed by the block number as a string)
# the score scale, the sliding window (null: none) and the logit soft-cap (null: none).
SCORE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "causal", "blocks")
BLOCK_SCORE_KEYS = ("scaling", "sliding_window", "softcap")


def check_attention_source(layout: AttentionLayout, scores: dict[str, Any] | None, layers: tuple[int, ...], *,
                           one_stream: bool, all_heads: bool, triangle: bool) -> None:
    """Raise ``SpecError`` unless, for token rows, the spec is one stream with every head and no triangle, and
    ``scores`` describe every block of ``layers``."""
    source = layout.name
    if not layout.token_rows:
        if scores is not None:
            raise SpecError(f"attention_scores describe an attention source of token rows; attention_source is "
                            f"{source!r}")
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
