"""What a ``CacheSpec`` refuses at construction, and the per-token vocabulary those checks read.

Kept apart from ``spec`` so that the spec module holds what a cache is and how its arrays are named, and this one
what makes a spec invalid: every check runs once, in ``CacheSpec.__post_init__`` (a bad spec fails where it is
made, not at the first shard).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kdcache.storage.core.attention_source import AttentionLayout, check_attention_source
from kdcache.storage.core.backend_registry import BackendClass
from kdcache.storage.core.codecs import CompressorConfig
from kdcache.storage.core.dtypes import STORAGE_DTYPES, storage_dtype
from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.logit_layouts import LogitFields, validate_logits
from kdcache.storage.core.streams import ArrayKind
from kdcache.storage.hidden_codecs import HiddenCodec

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


class SpecFields(LogitFields, Protocol):
    """The ``CacheSpec`` fields and derived values the checks read: a Protocol, so that this module sits below
    ``spec`` (which calls ``check_spec`` on itself) rather than importing it back."""

    @property
    def num_sequences(self) -> int: ...
    @property
    def sequences_per_shard(self) -> int: ...
    @property
    def backend_type(self) -> BackendClass: ...  # the class registered as ``backend``
    @property
    def dtype(self) -> str: ...
    @property
    def bitround(self) -> int | None: ...
    @property
    def hidden_codec(self) -> HiddenCodec: ...
    @property
    def attention_heads(self) -> tuple[int, ...] | None: ...
    @property
    def attention_layers(self) -> tuple[int, ...]: ...
    @property
    def attention_triangle(self) -> bool: ...
    @property
    def attention_scores(self) -> dict[str, Any] | None: ...
    @property
    def attention_layout(self) -> AttentionLayout: ...
    @property
    def token_arrays(self) -> tuple[str, ...]: ...
    @property
    def codec_configs(self) -> tuple[CompressorConfig, CompressorConfig]: ...
    @property
    def is_encoder_decoder(self) -> bool: ...
    def float_dtype(self, name: str) -> str:
        """The float dtype array ``name`` is computed in (``CacheSpec.float_dtype``)."""


def check_spec(spec: SpecFields) -> None:
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
