"""One array of a cache, its name read once: ``CacheSpec.array(name)`` and ``CacheSpec.arrays()`` give these.

An array's name (``encoder/hidden/3``, ``logits/topk_ids``, ``hidden_scale/2``) says what the array is; reading it
again at each use (``kind_of``, ``logit_array``, ``part_of``...) scatters the same decision over every module that
touches the array. A ``CachedArray`` is that decision made once per spec: what code switches on (its kind, its
logit record), where its rows are (its offsets array and attention geometry), and how it is stored (dtype, codec).
Batches and shards stay keyed by the plain name; code that walks a spec's arrays walks these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kdcache.storage.core.attention_source import token_row_kinds
from kdcache.storage.core.backend_registry import BackendClass
from kdcache.storage.core.codecs import CompressorConfig, resolve_codec
from kdcache.storage.core.dtypes import storage_dtype
from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.logit_layouts import FLOAT, VOCAB_ID, LayoutFields, LogitArray, logit_array
from kdcache.storage.core.streams import (
    CROSS,
    MAP_KINDS,
    ArrayKind,
    attention_offsets_name,
    kind_of,
    split_stream,
    token_offsets_name,
)
from kdcache.storage.hidden_codecs import CODES_CODEC, HiddenCodec, part_of

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


class ArraySpecFields(LayoutFields, Protocol):
    """What ``describe`` reads of a ``CacheSpec``: a Protocol, so that this module sits below ``spec`` (which
    describes its arrays with it) rather than importing it back."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def backend_type(self) -> BackendClass: ...  # the class registered as ``backend``
    @property
    def hidden_codec(self) -> HiddenCodec: ...
    @property
    def attention_triangle(self) -> bool: ...
    @property
    def token_arrays(self) -> tuple[str, ...]: ...
    @property
    def codec_configs(self) -> tuple[CompressorConfig, CompressorConfig]: ...
    @property
    def is_encoder_decoder(self) -> bool: ...
    def float_dtype(self, name: str) -> str: ...
    def coded(self, name: str) -> bool: ...


def describe(spec: ArraySpecFields, name: str) -> CachedArray:
    """Array ``name`` of ``spec``: where its name is read, once per spec (``spec.coded`` and ``spec.float_dtype``,
    which the spec's own naming needs before any array is described, read the hidden codec's kinds from it too)."""
    kind, logit, part = kind_of(name), logit_array(spec, name), part_of(name)
    stream = split_stream(name)[0] or ("decoder" if spec.is_encoder_decoder else "")
    rows = kind == ArrayKind.HIDDEN or kind in token_row_kinds()  # the registry's: a test may register a source
    lossy = rows or kind in MAP_KINDS or (logit is not None and not logit.sparse)
    coded = spec.coded(name)
    return CachedArray(name, stream, kind, logit, part, coded, rows, lossy,
                       _dtype(spec, name, kind, logit, part, coded), _codec(spec, logit, coded or part is not None),
                       attention_offsets_name(name) if kind in MAP_KINDS else token_offsets_name(stream),
                       _geometry(spec, kind, stream) if kind in MAP_KINDS else None)


def _dtype(spec: ArraySpecFields, name: str, kind: str, logit: LogitArray | None, part: str | None,
           coded: bool) -> np.dtype:
    """The on-disk dtype: offsets int64, ids int32, token arrays and logit arrays of a fixed type their own,
    codes the codec's, companions float16 (their ids uint16), any other float array the spec's float dtype."""
    if kind.endswith("offsets"):
        return np.dtype(np.int64)
    if kind == ArrayKind.INPUT_IDS:
        return np.dtype(np.int32)
    if kind in TOKEN_ARRAYS:
        return TOKEN_ARRAYS[kind]
    if logit is not None and logit.dtype != FLOAT:
        return topk_id_dtype(spec.vocab_size) if logit.dtype == VOCAB_ID else np.dtype(logit.dtype)
    if coded:
        return np.dtype(spec.hidden_codec.code_dtype)
    if part is not None:
        return np.dtype(np.uint16) if part == "outlier_ids" else np.dtype(np.float16)
    return storage_dtype(spec.float_dtype(name))


def _codec(spec: ArraySpecFields, logit: LogitArray | None, codes: bool) -> dict[str, Any]:
    """The compressor: codes and companions get the codes' own where the backend compresses per array, sparse
    logits the top-k codec, everything else the activation codec."""
    if codes and spec.backend_type.codec_per_array:
        return resolve_codec(CODES_CODEC)  # a column-major codec's too (COLUMN_CODES_CODEC is the same)
    activations, sparse = spec.codec_configs
    return sparse if logit is not None and logit.sparse else activations


def _geometry(spec: ArraySpecFields, kind: str, stream: str) -> Geometry:
    """Cross-attention has decoder queries and encoder keys; only a (decoder) self-attention map can be stored as
    its causal triangle, or per document."""
    if kind == CROSS:
        return Geometry("decoder", "encoder", False, False)
    by_documents = ArrayKind.POSITION_IDS in spec.token_arrays and kind == ArrayKind.ATTENTION
    return Geometry(stream, stream, spec.attention_triangle and stream in ("", "decoder"), by_documents)
