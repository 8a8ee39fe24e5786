"""Attention packing: each sequence's ``[H, L, L]`` map becomes ``[R, H']`` rows, and back.

Rows are the (query, key) pairs in row-major order: all ``L*L`` of them, or only the ``L*(L+1)/2`` pairs with
query >= key when the cache keeps the causal triangle. Heads go last so that one row (one query-key pair) is
contiguous across heads, and the array stays token-major like every other target.

Rows packed with documents kept apart (``position_ids`` in the cache) attend only inside each document, so their
self-attention is stored per document: each document's own ``[H, l, l]`` block (or its triangle), one after the
other, and nothing of the zeros between them; unpacking puts the blocks back on the diagonal of ``[H, L, L]``.

Cross-attention maps (seq2seq caches) are rectangular, ``[H, L_q, L_k]`` with decoder queries and encoder keys;
they are packed the same way into ``L_q * L_k`` rows, and never as a triangle.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def to_gaps(ids: np.ndarray) -> np.ndarray:
    """``[T, N]`` rows of non-decreasing ids -> each row's first id, then the gaps between neighbours (small numbers
    that compress better than the ids: 41 -> 39 B/token for 12 draws at V = 128k, benchmarks/RESULTS.md)."""
    return np.diff(ids, axis=1, prepend=np.zeros((ids.shape[0], 1), dtype=ids.dtype)) if ids.size else ids


def decode_rows(rows: np.ndarray, *, gaps: bool, logprob_step: float = 0.0) -> np.ndarray:
    """Rows as a reader returns them: gaps summed back (``gaps``), and quantised log-probs (``logprob_step`` > 0)
    turned back into float32 log-probabilities ``-q * step``; anything else as stored."""
    if gaps and rows.size:
        rows = np.cumsum(rows, axis=1, dtype=np.uint32 if logprob_step else rows.dtype)
    return rows.astype(np.float32) * np.float32(-logprob_step) if logprob_step else rows


def document_lengths(position_ids: np.ndarray) -> list[int]:
    """Token counts of the documents of one packed row: a document starts at the row's start and wherever a
    position is 0."""
    starts = sorted({0, *np.flatnonzero(np.asarray(position_ids) == 0).tolist()})
    lengths: list[int] = np.diff([*starts, len(position_ids)]).tolist()
    return lengths


def attention_rows(length: int, triangle: bool, keys: int | None = None, documents: list[int] | None = None) -> int:
    """Rows one sequence occupies in an attention array: ``length`` queries by ``keys`` keys (default square), or
    the square of each document (``documents``: their lengths, summing to ``length``)."""
    if documents is not None:
        return sum(attention_rows(n, triangle) for n in documents)
    if triangle:
        return length * (length + 1) // 2
    return length * (length if keys is None else keys)


@lru_cache(maxsize=64)
def _tril(length: int) -> tuple[np.ndarray, np.ndarray]:
    # np.tril_indices walks rows in order, so the pairs come out row-major with query >= key.
    return np.tril_indices(length)


def pack_attention(attn: np.ndarray, heads: tuple[int, ...] | None, triangle: bool,
                   documents: list[int] | None = None) -> np.ndarray:
    """Select heads and (optionally) the causal triangle of one sequence's attention.

    Args:
        attn: ``[H, L, L]`` attention probabilities of one sequence (query axis before key axis); a
            cross-attention map may be ``[H, L_q, L_k]`` (no triangle).
        heads: head indices to keep, or None for all heads.
        triangle: keep only query >= key.
        documents: the lengths of the row's documents, to keep only each one's diagonal block.

    Returns:
        ``[R, H']`` with R = ``attention_rows(L, triangle, documents=documents)``.
    """
    if heads is not None:
        attn = attn[list(heads)]
    if documents is not None:
        edges = np.cumsum([0, *documents])
        return np.concatenate([pack_attention(attn[:, a:b, a:b], None, triangle) for a, b in zip(edges, edges[1:])])
    num_heads, length = attn.shape[0], attn.shape[1]
    if triangle:
        q, k = _tril(length)
        return np.ascontiguousarray(attn[:, q, k].T)
    return np.ascontiguousarray(attn.reshape(num_heads, -1).T)


def unpack_attention(rows: np.ndarray, length: int, triangle: bool, keys: int | None = None,
                     documents: list[int] | None = None) -> np.ndarray:
    """Inverse of :func:`pack_attention`.

    Args:
        rows: ``[R, H']`` rows of one sequence.
        length: L, the sequence's (query) token count.
        triangle: whether ``rows`` hold only query >= key.
        keys: L_k, the key count of a rectangular (cross-attention) map; None = ``length``.
        documents: the lengths of a packed row's documents when ``rows`` hold only their diagonal blocks.

    Returns:
        ``[H', L, L_k]``, zeros above the diagonal for a triangle cache and between documents.
    """
    num_heads = rows.shape[1]
    if documents is not None:
        out = np.zeros((num_heads, length, length), dtype=rows.dtype)
        start = first = 0
        for n in documents:
            stop = first + attention_rows(n, triangle)
            out[:, start:start + n, start:start + n] = unpack_attention(rows[first:stop], n, triangle)
            start, first = start + n, stop
        return out
    if not triangle:
        return np.ascontiguousarray(rows.T.reshape(num_heads, length, length if keys is None else keys))
    out = np.zeros((num_heads, length, length), dtype=rows.dtype)
    q, k = _tril(length)
    out[:, q, k] = rows.T
    return out
