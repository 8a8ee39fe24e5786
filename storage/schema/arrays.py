"""One array of a cache, its name read once: ``CacheSpec.array(name)`` and ``CacheSpec.arrays()`` give these.

An array's name (``encoder/hidden/3``, ``logits/topk_ids``, ``hidden_scale/2``) says what the array is; reading it
again at each use (``kind_of``, ``logit_array``, ``part_of``...) scatters the same decision over every module that
touches the array. A ``CachedArray`` is that decision made once per spec: what code switches on (its kind, its
logit record), where its rows are (its offsets array and attention geometry), and how it is stored (dtype, codec).
Batches and shards stay keyed by the plain name; code that walks a spec's arrays walks these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.logit_layouts import VOCAB_ID, LogitArray
from kdcache.storage.core.streams import (
    MAP_KINDS,
    ArrayKind,
)

# Per-token arrays stored beside a stream's ids, ragged the same way, and their on-disk dtypes.
TOKEN_ARRAYS: dict[str, np.dtype] = {"loss_mask": np.dtype(np.uint8), "position_ids": np.dtype(np.int32)}
# Every integer array with one value per token of a stream: its ids and the TOKEN_ARRAYS beside them.
TOKEN_KINDS: frozenset[str] = frozenset({ArrayKind.INPUT_IDS, *TOKEN_ARRAYS})


def topk_id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every id in ``range(vocab_size)``."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise SpecError(f"vocab_size {vocab_size} does not fit in 64 bits")


@dataclass(frozen=True)
class Geometry:
    """Where an attention map's rows come from: ``[H', L_q, L_k]`` per sequence, queries of ``queries``' stream,
    keys of ``keys``' stream; ``triangle``: stored as its causal lower triangle; ``by_documents``: stored per
    document of a packed row (self-attention of rows with ``position_ids``)."""

    queries: str
    keys: str
    triangle: bool
    by_documents: bool


@dataclass(frozen=True)
class CachedArray:
    """Array ``name`` of one spec.

    Attributes:
        name: the array's name, the key of batches, shards and manifests.
        stream: the token stream its rows follow: its prefix's (``encoder/hidden/3``), else ``""`` in a
            one-stream cache and ``decoder`` in a two-stream one (logits, cross-attention's queries).
        kind: an ``ArrayKind`` (``hidden``, ``attention_q``...), or the name's first part for a kind outside the
            vocabulary (a companion ``hidden_scale``, a test's own attention source).
        logit: the logit layout's record of the array; None for any other.
        part: the companion part it holds for a coded array (``scale``, ``outliers``, ``outlier_ids``, ``error``).
        coded: stored as codes of the spec's quantised hidden codec (with companions).
        token_rows: token rows ``[T, width]`` of one width per layer (hidden states, queries/keys/values).
        lossy: an activation (hidden, attention, token rows, full logits): what bitround may touch.
        dtype: its on-disk dtype.
        codec: the numcodecs configuration that compresses it.
        offsets: the offsets array locating its rows.
        geometry: an attention map's (None for any other array).
    """

    name: str
    stream: str
    kind: ArrayKind | str
    logit: LogitArray | None
    part: str | None
    coded: bool
    token_rows: bool
    lossy: bool
    dtype: np.dtype
    codec: dict[str, Any]
    offsets: str
    geometry: Geometry | None

    @property
    def is_map(self) -> bool:
        """A per-sequence attention map ``[H', L_q, L_k]`` (self- or cross-attention)."""
        return self.kind in MAP_KINDS

    @property
    def gap_coded(self) -> bool:
        """Rows non-decreasing along the last axis, stored as the first value and the gaps."""
        return self.logit is not None and self.logit.gap_coded

    @property
    def vocab_ids(self) -> bool:
        """A logit array of vocabulary ids (stored in the smallest unsigned type holding V-1)."""
        return self.logit is not None and self.logit.dtype == VOCAB_ID

    @property
    def exact(self) -> bool:
        """A logit array of a fixed type, handed to storage as computed (``LogitArray.exact``)."""
        return self.logit is not None and self.logit.exact
