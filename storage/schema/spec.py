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
from typing import Any

import numpy as np

from kdcache.storage.core.errors import LayerNotInCacheError, SpecError, UnknownFeatureError
from kdcache.storage.core.formats import FORMAT_VERSION
from kdcache.storage.core.logit_layouts import logit_arrays
from kdcache.storage.core.streams import (
    CROSS,
    MAP_KINDS,
    SEQ2SEQ_MANIFEST_KEYS,
    ArrayKind,
    attention_offsets_name,
    kind_of,
    prefixed,
    split_stream,
    stream_layers_of_manifest,
    stream_manifest_keys,
    token_offsets_name,
)
from kdcache.storage.schema.arrays import CachedArray
from kdcache.storage.schema.spec_fields import CacheSpecFields, describe


class CacheSpec(CacheSpecFields):
    """What a cache holds and how. Frozen; round-trips through JSON via ``to_dict`` / ``from_dict``.

    Layers are stored sorted and de-duplicated; codecs are stored as full numcodecs config dicts.
    ``bitround`` (keepbits) applies to activations (hidden, attention, full logits), never to top-k.

    ``layers`` is the one record of the cached layers: ``{stream: {kind: layers}}`` (``storage.core.streams``), e.g.
    ``{"": {"hidden": (2, 4), "attention": (4,)}}``, or ``{"encoder": {...}, "decoder": {"hidden": ...,
    "attention": ..., "cross_attention": ...}}``. ``hidden_layers`` / ``attention_layers`` are a one-stream
    convenience: given instead of ``layers`` they build stream ``""``; afterwards they mirror that stream (empty
    for two streams).
    """

    # Each array of a shard with its name read once (``spec_fields.describe``), built on first use.
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

    # ---- derived streams -----------------------------------------------------------------------------
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

