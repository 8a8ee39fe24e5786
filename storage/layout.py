"""Attention packing: each sequence's ``[H, L, L]`` map becomes ``[R, H']`` rows, and back.

Rows are the (query, key) pairs in row-major order: all ``L*L`` of them, or only the ``L*(L+1)/2`` pairs with
query >= key when the cache keeps the causal triangle. Heads go last so that one row (one query-key pair) is
contiguous across heads, and the array stays token-major like every other target.

Cross-attention maps (seq2seq caches) are rectangular, ``[H, L_q, L_k]`` with decoder queries and encoder keys;
they are packed the same way into ``L_q * L_k`` rows, and never as a triangle.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def attention_rows(length: int, triangle: bool, keys: int | None = None) -> int:
    """Rows one sequence occupies in an attention array: ``length`` queries by ``keys`` keys (default square)."""
    if triangle:
        return length * (length + 1) // 2
    return length * (length if keys is None else keys)


@lru_cache(maxsize=64)
def _tril(length: int) -> tuple[np.ndarray, np.ndarray]:
    # np.tril_indices walks rows in order, so the pairs come out row-major with query >= key.
    return np.tril_indices(length)


def pack_attention(attn: np.ndarray, heads: tuple[int, ...] | None, triangle: bool) -> np.ndarray:
    """Select heads and (optionally) the causal triangle of one sequence's attention.

    Args:
        attn: ``[H, L, L]`` attention probabilities of one sequence (query axis before key axis); a
            cross-attention map may be ``[H, L_q, L_k]`` (no triangle).
        heads: head indices to keep, or None for all heads.
        triangle: keep only query >= key.

    Returns:
        ``[R, H']`` with R = ``attention_rows(L, triangle)``.
    """
    if heads is not None:
        attn = attn[list(heads)]
    num_heads, length = attn.shape[0], attn.shape[1]
    if triangle:
        q, k = _tril(length)
        return np.ascontiguousarray(attn[:, q, k].T)
    return np.ascontiguousarray(attn.reshape(num_heads, -1).T)


def unpack_attention(rows: np.ndarray, length: int, triangle: bool, keys: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_attention`.

    Args:
        rows: ``[R, H']`` rows of one sequence.
        length: L, the sequence's (query) token count.
        triangle: whether ``rows`` hold only query >= key.
        keys: L_k, the key count of a rectangular (cross-attention) map; None = ``length``.

    Returns:
        ``[H', L, L_k]``, zeros above the diagonal for a triangle cache.
    """
    num_heads = rows.shape[1]
    if not triangle:
        return np.ascontiguousarray(rows.T.reshape(num_heads, length, length if keys is None else keys))
    out = np.zeros((num_heads, length, length), dtype=rows.dtype)
    q, k = _tril(length)
    out[:, q, k] = rows.T
    return out
