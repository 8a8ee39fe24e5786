"""CacheSpec: what a cache holds, and the naming and dtype rules derived from it.

Array names inside a shard (see docs/architecture.md):

- ``input_ids [T]`` int32 and ``offsets [S+1]`` int64;
- token arrays named by ``token_arrays``, ``[T]`` like ``input_ids``: ``loss_mask`` uint8 (1 = a loss counts this
  token) and ``position_ids`` int32 (positions that restart at 0 where a packed row starts a new document);
- ``hidden/{j} [T, d]`` per hidden layer j (0 = embeddings);
- ``attention/{j} [R, H']`` per attention block j (1..N) and ``attention_offsets [S+1]`` int64; or, with
  ``attention_source`` "qk"/"qkv", ``attention_q/{j} [T, H*d]``, ``attention_k/{j}`` (and ``attention_v/{j}``)
  ``[T, H_kv*d]`` token rows, with ``attention_scores`` recording how scores are formed;
- ``logits/full [T, V]``, or ``logits/topk_values [T, k]``, ``logits/topk_ids [T, k]``, ``logits/lse [T]``.

A seq2seq cache (``layers`` keyed by ``encoder`` and ``decoder``; format v2) holds two token streams, each with its
own ids, offsets, hidden and self-attention layers (``encoder/input_ids``, ``encoder/offsets``, ``encoder/hidden/{j}``,
``encoder/attention/{j}``, ``encoder/attention_offsets``, and the same under ``decoder/``), plus cross-attention
``cross_attention/{j} [R, H']`` (per sequence ``L_dec * L_enc`` rows) with ``cross_attention_offsets``; logits
are on decoder tokens. See ``storage.core.streams``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
from kdcache.storage.core.errors import LayerNotInCacheError, SpecError, UnknownFeatureError
from kdcache.storage.core.formats import FORMAT_VERSION
from kdcache.storage.core.logit_layouts import (
    FLOAT,
    VOCAB_ID,
    LogitArray,
    LogitLayout,
    layout_named,
    logit_array,
    logit_arrays,
    validate_logits,
)
from kdcache.storage.core.streams import (
    CROSS,
    MAP_KINDS,
    SEQ2SEQ_MANIFEST_KEYS,
    ArrayKind,
    attention_offsets_name,
    kind_of,
    prefixed,
    sorted_layers,
    spec_layers,
    split_stream,
    stream_layers_of_manifest,
    stream_manifest_keys,
    token_offsets_name,
)
from kdcache.storage.hidden_codecs import (
    CODES_CODEC,
    HiddenCodec,
    applies_to,
    hidden_codec_of,
    part_name,
    part_of,
)
from kdcache.storage.schema.arrays import TOKEN_ARRAYS, CachedArray, Geometry, topk_id_dtype


@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds and how. Frozen; round-trips through JSON via ``to_dict`` / ``from_dict``.

    Layers are stored sorted and de-duplicated; codecs are stored as full numcodecs config dicts.
    ``bitround`` (keepbits) applies to activations (hidden, attention, full logits), never to top-k.

    ``layers`` is the one record of the cached layers: ``{stream: {kind: layers}}`` (``storage.core.streams``), e.g.
    ``{"": {"hidden": (2, 4), "attention": (4,)}}``, or ``{"encoder": {...}, "decoder": {"hidden": ...,
    "attention": ..., "cross_attention": ...}}``. ``hidden_layers`` / ``attention_layers`` are a one-stream
    convenience: given instead of ``layers`` they build stream ``""``; afterwards they mirror that stream (empty
    for two streams).
    """

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

    # Each array of a shard with its name read once (``schema.arrays``), built on first use.
    @functools.cached_property
    def _arrays(self) -> dict[str, CachedArray]:
        return {name: describe(self, name) for name in self.array_names()}

    @functools.cached_property
    def _sequence_arrays(self) -> tuple[CachedArray, ...]:
        return tuple(self._arrays[name] for name in self.sequence_names())

    def array(self, name: str) -> CachedArray:
        """Array ``name`` described: its kind, stream, logit record, dtype, codec and where its rows are, once per
        spec (a name outside the shard's arrays too: a coded layer's error rows, the kept mass)."""
        found = self._arrays.get(name)
        return found if found is not None else self._arrays.setdefault(name, describe(self, name))

    def arrays(self) -> list[CachedArray]:
        """The per-sequence arrays a reader returns and the writer takes (``sequence_names``), described."""
        return list(self._sequence_arrays)

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

    def layers_of(self, kind: str, stream: str = "") -> tuple[int, ...]:
        """The cached layers of ``kind`` ("hidden", "attention", "cross_attention") in ``stream`` (() if none)."""
        return self.layers.get(stream, {}).get(kind, ())

    def layer_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(array group, layers)`` in array order: ``hidden`` / ``encoder/attention`` ... then
        ``cross_attention`` (whose arrays carry no stream prefix: they span both streams)."""
        return [(kind if kind == CROSS else prefixed(stream, kind), layers)
                for stream, kinds in self.layers.items() for kind, layers in kinds.items()]

    @property
    def format_version(self) -> int:
        """Format version of caches written with this spec (one stream or two alike)."""
        return FORMAT_VERSION

    @property
    def streams(self) -> tuple[str, ...]:
        """Token streams: ``("",)`` for a single-stream cache, ``("encoder", "decoder")`` for seq2seq."""
        return tuple(self.layers)

    def stream_layers(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """``(stream, hidden layers, self-attention layers)`` per token stream."""
        return [(stream, kinds["hidden"], kinds["attention"]) for stream, kinds in self.layers.items()]

    def ids_name(self, stream: str = "") -> str:
        """The token-id array of ``stream`` (``input_ids``, ``encoder/input_ids``...)."""
        return prefixed(stream, "input_ids")

    def token_names(self) -> list[str]:
        """Every stream's ids, then every stream's token arrays (``loss_mask``, ``position_ids``...)."""
        names = [self.ids_name(s) for s in self.streams]
        return names + [prefixed(s, a) for s in self.streams for a in self.token_arrays]

    def offsets_name(self, name: str) -> str:
        """The offsets array that locates per-sequence array ``name``'s rows."""
        return self.array(name).offsets

    def by_documents(self, name: str) -> bool:
        """Whether attention array ``name`` is stored per document (self-attention of rows with ``position_ids``,
        packed by document as ``pack_attention`` does)."""
        geometry = self.array(name).geometry
        return geometry is not None and geometry.by_documents

    def offset_arrays(self) -> list[str]:
        """Every offsets array of a shard (token offsets per stream, then attention offsets)."""
        names = [token_offsets_name(s) for s in self.streams]
        maps = (n for n in self.sequence_names() if kind_of(n) in MAP_KINDS)
        return names + list(dict.fromkeys(attention_offsets_name(n) for n in maps))

    @property
    def num_shards(self) -> int:
        """Number of shards; fixed at creation so resumption and rank partitions always agree."""
        return math.ceil(self.num_sequences / self.sequences_per_shard)

    def shard_range(self, index: int) -> tuple[int, int]:
        """Global sequence range ``[start, stop)`` of shard ``index``."""
        start = index * self.sequences_per_shard
        return start, min(start + self.sequences_per_shard, self.num_sequences)

    @property
    def features(self) -> tuple[str, ...]:
        """Target kinds held: "hidden", "attention" (per stream for seq2seq, e.g. "encoder/hidden"),
        "cross_attention", "logits/full" or "logits/topk"."""
        kinds = [*self.layer_groups(), (f"logits/{self.logits}", bool(self.logits))]
        return tuple(name for name, present in kinds if present)

    def sequence_names(self) -> list[str]:
        """Names of the per-sequence arrays a reader returns (and the writer takes), in order."""
        names = self.token_names()
        for group, layers in self.layer_groups():
            stream, kind = split_stream(group)
            kinds = self.attention_layout.kinds if kind == ArrayKind.ATTENTION else (kind,)
            names += [n for j in layers for k in kinds for n in self.with_parts(prefixed(stream, f"{k}/{j}"))]
        return names + self.logit_arrays()

    def logit_arrays(self) -> list[str]:
        """The per-token logit arrays of this cache (a log-prob top-k cache needs no logsumexp)."""
        return [a.name for a in logit_arrays(self)]

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

    def gap_coded(self, name: str) -> bool:
        """Whether ``name`` holds rows non-decreasing along the last axis, stored as the first value and the gaps."""
        return self.array(name).gap_coded

    def array_names(self) -> list[str]:
        """Every array each shard holds (per-sequence names plus the offsets arrays)."""
        names = self.sequence_names()
        offsets = self.offset_arrays()
        if not self.is_encoder_decoder:  # the v1 order: input_ids, offsets, ..., attention_offsets
            return [names[0], offsets[0], *names[1:], *offsets[1:]]
        return names + offsets

    def array_dtype(self, name: str) -> np.dtype:
        """On-disk dtype of array ``name``."""
        return self.array(name).dtype

    def codec_for(self, name: str) -> dict[str, Any]:
        """numcodecs config used to compress array ``name``: the top-k codec for sparse logits."""
        return self.array(name).codec

    def is_lossy_kind(self, name: str) -> bool:
        """Whether ``name`` is an activation (hidden, attention, cross-attention, full logits), bitrounded or not."""
        return self.array(name).lossy

    def check_name(self, name: str) -> None:
        """Raise a typed error unless ``name`` is a per-sequence array of this cache."""
        if name in self.sequence_names():
            return
        groups: dict[str, tuple[int, ...]] = {}
        for group, held in self.layer_groups():
            stream, kind = split_stream(group)
            kinds = self.attention_layout.kinds if kind == ArrayKind.ATTENTION else (kind,)
            groups.update({prefixed(stream, k): held for k in kinds})
        kind, _, layer = name.rpartition("/")
        layers = groups.get(kind)
        if layers is not None and layer.lstrip("-").isdigit():
            raise LayerNotInCacheError(f"{kind} layer {layer} is not in this cache; cached {kind} layers: "
                                       f"{list(layers) or 'none'}")
        raise UnknownFeatureError(f"unknown array or feature {name!r}; this cache holds: "
                                  f"{', '.join(self.sequence_names())}")

    def expand_names(self, names: list[str] | tuple[str, ...] | None) -> list[str]:
        """Expand group names ("hidden", "attention", "logits") and validate the rest; None = all."""
        if names is None:
            return self.sequence_names()
        out: list[str] = []
        for name in names:
            # a group's coded layers bring their companions (hidden_scale/j...), which lie outside "hidden/"
            group = [p for n in self.sequence_names() if n.startswith(name + "/") for p in self.with_parts(n)]
            if not group:
                self.check_name(name)
            out.extend(group or self.with_parts(name))
        # Attention stored per document cannot be unpacked without the row's document boundaries.
        out += [prefixed(split_stream(n)[0], "position_ids") for n in out if self.by_documents(n)]
        return list(dict.fromkeys(out))

    # ---- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists), in the manifest's keys of every format: the layer mapping
        becomes ``hidden_layers`` / ``attention_layers`` for one stream, and for two ``"layout": "seq2seq"`` plus
        one key per stream and kind (``streams.stream_manifest_keys``), so manifests stay byte-identical."""
        out = dataclasses.asdict(self)
        del out["layers"]
        if not self.token_arrays:  # what format-3 writers wrote
            del out["token_arrays"]
        out.update(stream_manifest_keys(self.layers))
        out["hidden_codec"] = self.hidden_codec.record()
        if self.hidden_codec.is_plain(self.dtype):  # the float dtype: what earlier writers wrote
            del out["hidden_codec"]
        if self.attention_layout.default:  # what writers before issue 23 wrote
            del out["attention_source"], out["attention_scores"]
        if self.topk_values == "fp16":  # what earlier writers wrote; a reader that predates logprob refuses those
            del out["topk_values"], out["logprob_step"]
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheSpec:
        """Rebuild a spec from ``to_dict`` output (the manifest's keys, translated to the layer mapping by
        ``streams.stream_layers_of_manifest``); unknown keys are an error (a newer writer wrote them)."""
        known = ({f.name for f in dataclasses.fields(cls)} - {"layers"}) | set(SEQ2SEQ_MANIFEST_KEYS)
        extra = sorted(set(data) - known)
        if extra:
            raise SpecError(f"unknown spec field(s) {extra}; expected only {sorted(known)}")
        values: dict[str, Any] = {k: v for k, v in data.items() if k not in SEQ2SEQ_MANIFEST_KEYS}
        values["layers"] = stream_layers_of_manifest(data) or {}  # {}: hidden_layers / attention_layers build it
        return cls(**values)


def check_spec(spec: CacheSpec) -> None:
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


def describe(spec: CacheSpec, name: str) -> CachedArray:
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


def _dtype(spec: CacheSpec, name: str, kind: str, logit: LogitArray | None, part: str | None,
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


def _codec(spec: CacheSpec, logit: LogitArray | None, codes: bool) -> dict[str, Any]:
    """The compressor: codes and companions get the codes' own where the backend compresses per array, sparse
    logits the top-k codec, everything else the activation codec."""
    if codes and spec.backend_type.codec_per_array:
        return resolve_codec(CODES_CODEC)  # a column-major codec's too (COLUMN_CODES_CODEC is the same)
    activations, sparse = spec.codec_configs
    return sparse if logit is not None and logit.sparse else activations


def _geometry(spec: CacheSpec, kind: str, stream: str) -> Geometry:
    """Cross-attention has decoder queries and encoder keys; only a (decoder) self-attention map can be stored as
    its causal triangle, or per document."""
    if kind == CROSS:
        return Geometry("decoder", "encoder", False, False)
    by_documents = ArrayKind.POSITION_IDS in spec.token_arrays and kind == ArrayKind.ATTENTION
    return Geometry(stream, stream, spec.attention_triangle and stream in ("", "decoder"), by_documents)
