"""CacheSpec's fields, resolved and checked once at construction, and each array of a shard described from them.

``CacheSpec`` (``storage.schema.spec``) adds to these the array names, their lookups and the JSON; a describe that
reads the fields from here needs nothing of that.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdcache.storage.core.attention_source import (
    ATTENTION_LAYOUTS,
    DEFAULT_ATTENTION_SOURCE,
    AttentionLayout,
    check_attention_source,
    token_row_kinds,
)
from kdcache.storage.core.backend_registry import DEFAULT_BACKEND, BackendClass, backend_class
from kdcache.storage.core.codecs import CompressorConfig, resolve_codec
from kdcache.storage.core.dtypes import STORAGE_DTYPES, storage_dtype
from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.logit_layouts import (
    FLOAT,
    VOCAB_ID,
    LogitArray,
    LogitLayout,
    layout_named,
    logit_array,
    validate_logits,
)
from kdcache.storage.core.streams import (
    CROSS,
    MAP_KINDS,
    ArrayKind,
    attention_offsets_name,
    kind_of,
    sorted_layers,
    spec_layers,
    split_stream,
    token_offsets_name,
)
from kdcache.storage.hidden_codecs import CODES_CODEC, HiddenCodec, applies_to, hidden_codec_of, part_name, part_of
from kdcache.storage.schema.arrays import TOKEN_ARRAYS, CachedArray, Geometry, topk_id_dtype


@dataclass(frozen=True)
class CacheSpecFields:
    """The fields of ``CacheSpec`` (documented there), with what describing an array reads of them."""

    num_sequences: int
    backend: str = DEFAULT_BACKEND  # a name of storage.core.backend_registry
    hidden_layers: tuple[int, ...] = ()
    attention_layers: tuple[int, ...] = ()
    attention_heads: tuple[int, ...] | None = None
    attention_triangle: bool = False
    logits: str | None = None
    top_k: int = 0
    samples: int = 0  # logits "sampled": N, the draws per token (also the width of its arrays)
    sample_temperature: float = 1.0
    vocab_size: int = 0
    dtype: str = "fp16"
    # A numcodecs configuration, its name or alias, or None: the backend's default (Backend.default_codecs);
    # always the resolved configuration once constructed (``codec_configs``).
    codec: CompressorConfig | str | None = None
    topk_codec: CompressorConfig | str | None = None
    topk_values: str = "fp16"  # of TOPK_VALUE_FORMATS; left out of to_dict() when fp16 (older manifests)
    logprob_step: float = 0.0  # "logprob": the quantisation step; every stored log-prob is within step/2
    bitround: int | None = None
    # The codec of hidden states (and queries/keys/values): given as a codec of storage.hidden_codecs, its name,
    # its {name, configuration} record or None (the float ``dtype``); always the configured codec once constructed.
    # Its record is what to_dict() writes, left out for the float dtype's.
    hidden_codec: HiddenCodec = None  # type: ignore[assignment]
    sequences_per_shard: int = 256
    token_arrays: tuple[str, ...] = ()  # of TOKEN_ARRAYS, stored for every stream; absent before format 4
    layers: dict[str, dict[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)  # {}: see above
    # Attention as queries/keys (issue 23); left out of to_dict() when "maps" (every earlier manifest).
    attention_source: str = DEFAULT_ATTENTION_SOURCE
    attention_scores: dict[str, Any] | None = None  # attention_source.SCORE_KEYS, BLOCK_SCORE_KEYS per block

    def __post_init__(self) -> None:
        # Every check of a spec runs here, once: a bad spec fails where it is made, not at the first shard.
        def put(key: str, value: object) -> None:  # a frozen dataclass sets its own fields this way
            object.__setattr__(self, key, value)

        put("layers", spec_layers(self.layers, self.hidden_layers, self.attention_layers))
        one = self.layers.get("", {})
        put("hidden_layers", one.get("hidden", ()))
        put("attention_layers", one.get("attention", ()))
        put("token_arrays", tuple(self.token_arrays))
        if self.attention_heads is not None:
            put("attention_heads", sorted_layers("attention_heads", self.attention_heads, 0))
        codec, topk_codec = self.backend_type.default_codecs
        put("codec", resolve_codec(codec if self.codec is None else self.codec))
        put("topk_codec", resolve_codec(topk_codec if self.topk_codec is None else self.topk_codec))
        put("hidden_codec", hidden_codec_of(self.hidden_codec, self.dtype if self.dtype in ("fp16", "bf16")
                                            else "fp16"))
        check_spec(self)

    # The names as objects, resolved once where a name enters (``check_spec`` refuses an unknown one): what storage
    # reads of them, and what the stages join their kinds to (``logit_kinds.of``, ``attention_sources.of``).
    @functools.cached_property
    def backend_type(self) -> BackendClass:  # a SpecError names the registered backends
        return backend_class(self.backend)

    @functools.cached_property
    def logit_layout(self) -> LogitLayout | None:
        return layout_named(self.logits)

    @functools.cached_property
    def attention_layout(self) -> AttentionLayout:
        return ATTENTION_LAYOUTS.lookup(self.attention_source)  # a SpecError names the registered sources

    @property
    def codec_configs(self) -> tuple[CompressorConfig, CompressorConfig]:
        """(activation codec, top-k codec): the resolved numcodecs configurations construction made of the
        ``codec`` and ``topk_codec`` fields."""
        if not isinstance(self.codec, dict) or not isinstance(self.topk_codec, dict):
            raise SpecError(f"codecs not resolved: {self.codec!r}, {self.topk_codec!r}")  # only a bypassed __init__
        return self.codec, self.topk_codec

    # ---- derived streams -----------------------------------------------------------------------------
    @property
    def is_encoder_decoder(self) -> bool:
        """Whether the cache holds two token streams (encoder and decoder)."""
        return "" not in self.layers

    # ---- hidden codecs (storage.hidden_codecs) ---------------------------------------------------------
    def coded(self, name: str) -> bool:
        """Whether ``name`` is stored as codes of a quantised hidden codec (with companion arrays)."""
        return not self.hidden_codec.float_dtype and applies_to(name)

    def with_parts(self, name: str) -> list[str]:
        """``name`` and, when it is coded, its companion arrays (scales, outliers kept aside, their ids)."""
        return [name, *(part_name(name, p) for p in self.hidden_codec.parts())] if self.coded(name) else [name]

    def float_dtype(self, name: str) -> str:
        """The float type ("fp16" / "bf16") float array ``name`` is stored in: a float hidden codec's, else
        ``dtype``."""
        return self.hidden_codec.float_dtype or self.dtype if applies_to(name) else self.dtype


def check_spec(spec: CacheSpecFields) -> None:
    """Refuse a spec whose fields do not fit together, once its codecs and layers are resolved.

    Raises:
        SpecError: counts below 1, a dtype, bitround, token array or codec the spec cannot store, an empty head
            list, or logits / attention-source fields that contradict each other.
    """
    storage_dtype(spec.dtype)
    if spec.num_sequences < 1 or spec.sequences_per_shard < 1:
        raise SpecError(f"num_sequences ({spec.num_sequences}) and sequences_per_shard "
                        f"({spec.sequences_per_shard}) must both be >= 1")
    validate_logits(spec)
    if spec.bitround is not None and spec.float_dtype("hidden/0") != spec.dtype:
        raise SpecError(f"bitround needs hidden states in the float dtype {spec.dtype!r}; hidden codec "
                        f"{spec.hidden_codec.name!r} differs")
    mantissa = STORAGE_DTYPES[spec.dtype][1]
    if spec.bitround is not None and not 0 < spec.bitround < mantissa:
        raise SpecError(f"bitround keepbits must be in 1..{mantissa - 1} for {spec.dtype}, got {spec.bitround}")
    if spec.attention_heads is not None and not spec.attention_heads:
        raise SpecError("attention_heads is empty; use None for all heads")
    unknown = [a for a in spec.token_arrays if a not in TOKEN_ARRAYS]
    if unknown or len(set(spec.token_arrays)) != len(spec.token_arrays):
        raise SpecError(f"token_arrays {list(spec.token_arrays)}: expected distinct names among "
                        f"{list(TOKEN_ARRAYS)}")
    for config in spec.codec_configs:  # fail at creation, not at the first shard
        spec.backend_type.check_codec(config)
    check_attention_source(spec.attention_layout, spec.attention_scores, spec.attention_layers,
                           one_stream=not spec.is_encoder_decoder, all_heads=spec.attention_heads is None,
                           triangle=spec.attention_triangle)


def describe(spec: CacheSpecFields, name: str) -> CachedArray:
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


def _dtype(spec: CacheSpecFields, name: str, kind: str, logit: LogitArray | None, part: str | None,
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


def _codec(spec: CacheSpecFields, logit: LogitArray | None, codes: bool) -> dict[str, Any]:
    """The compressor: codes and companions get the codes' own where the backend compresses per array, sparse
    logits the top-k codec, everything else the activation codec."""
    if codes and spec.backend_type.codec_per_array:
        return resolve_codec(CODES_CODEC)  # a column-major codec's too (COLUMN_CODES_CODEC is the same)
    activations, sparse = spec.codec_configs
    return sparse if logit is not None and logit.sparse else activations


def _geometry(spec: CacheSpecFields, kind: str, stream: str) -> Geometry:
    """Cross-attention has decoder queries and encoder keys; only a (decoder) self-attention map can be stored as
    its causal triangle, or per document."""
    if kind == CROSS:
        return Geometry("decoder", "encoder", False, False)
    by_documents = ArrayKind.POSITION_IDS in spec.token_arrays and kind == ArrayKind.ATTENTION
    return Geometry(stream, stream, spec.attention_triangle and stream in ("", "decoder"), by_documents)
