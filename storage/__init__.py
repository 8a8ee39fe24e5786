"""kdcache storage: the cache format, its Zarr v3 and Arrow backends, manifest, fingerprints, checksums.

numpy only: nothing here knows about models, losses or torch. This package is storage's front door: ``stages``
and ``pipeline`` import from ``kdcache.storage`` only, never from its submodules (``tests/test_source_rules.py``
reads their source to keep it so), so that storage's file split is not public API. For example::

    from kdcache.storage import CacheSpec, CacheWriter, CacheReader, KdcacheError, compare_fingerprints, verify_cache

Its folders are floors, each importing only those below it: ``core`` (errors, registries, names, files, stores),
``hidden_codecs``, ``schema`` (spec and manifest), ``backends``, and on top the modules here that encode, write,
read and verify a cache.

Attributes load lazily, so importing one name (``KdcacheError``, done by the CLI at start-up) does not import zarr,
pyarrow or numcodecs; the ``TYPE_CHECKING`` block lists them once: mypy reads their types there, and ``attach``
(``kdcache.lazy_exports``) reads which module holds each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.storage import hidden_codecs as hidden_codecs
    from kdcache.storage.buffers import BufferPool as BufferPool, Lease as Lease
    from kdcache.storage.core import errors as errors
    from kdcache.storage.core.attention_source import (
        DEFAULT_ATTENTION_SOURCE as DEFAULT_ATTENTION_SOURCE,
        MAPS_LAYOUT as MAPS_LAYOUT,
        QK_LAYOUT as QK_LAYOUT,
        QKV_LAYOUT as QKV_LAYOUT,
        AttentionLayout as AttentionLayout,
        register_attention_layout as register_attention_layout,
    )
    from kdcache.storage.core.backend_registry import DEFAULT_BACKEND as DEFAULT_BACKEND, backend_names as backend_names
    from kdcache.storage.core.canonical import canonical_json as canonical_json
    from kdcache.storage.core.codecs import describe_codec as describe_codec, resolve_codec as resolve_codec
    from kdcache.storage.core.dtypes import check_fp16_range as check_fp16_range, to_float32 as to_float32
    from kdcache.storage.core.errors import (
        CacheLockedError as CacheLockedError,
        CacheMismatchError as CacheMismatchError,
        ChecksumError as ChecksumError,
        DiskFullError as DiskFullError,
        FormatVersionError as FormatVersionError,
        Fp16OverflowError as Fp16OverflowError,
        InvalidSequenceError as InvalidSequenceError,
        KdcacheError as KdcacheError,
        LayerNotInCacheError as LayerNotInCacheError,
        ManifestError as ManifestError,
        NonFiniteValueError as NonFiniteValueError,
        PartialCacheError as PartialCacheError,
        ShardError as ShardError,
        SpecError as SpecError,
        StorageError as StorageError,
        UnknownCodecError as UnknownCodecError,
        UnknownFeatureError as UnknownFeatureError,
    )
    from kdcache.storage.core.files import (
        crc32c as crc32c,
        format_bytes as format_bytes,
        read_json_object as read_json_object,
    )
    from kdcache.storage.core.formats import FORMAT_VERSION as FORMAT_VERSION
    from kdcache.storage.core.logit_layouts import (
        FLOAT as FLOAT,
        FULL_LAYOUT as FULL_LAYOUT,
        HEAD_LAYOUT as HEAD_LAYOUT,
        SAMPLED_LAYOUT as SAMPLED_LAYOUT,
        TOPK_LAYOUT as TOPK_LAYOUT,
        TOPK_MASS as TOPK_MASS,
        LayoutFields as LayoutFields,
        LogitArray as LogitArray,
        LogitFields as LogitFields,
        LogitLayout as LogitLayout,
        SamplingFields as SamplingFields,
        exact_arrays as exact_arrays,
        layout_named as layout_named,
        logit_array as logit_array,
        logit_arrays as logit_arrays,
        register_layout as register_layout,
        vocab_id_names as vocab_id_names,
        vocab_row_names as vocab_row_names,
    )
    from kdcache.storage.core.registry import Registry as Registry, import_members as import_members
    from kdcache.storage.core.store_base import Store as Store
    from kdcache.storage.core.stores import (
        OPTIONS_ENV as OPTIONS_ENV,
        default_storage_options as default_storage_options,
        is_url as is_url,
        open_store as open_store,
        parse_storage_options as parse_storage_options,
    )
    from kdcache.storage.core.streams import (
        CROSS as CROSS,
        MAP_KINDS as MAP_KINDS,
        ArrayKind as ArrayKind,
        kind_of as kind_of,
        prefixed as prefixed,
        ragged_streams as ragged_streams,
        split_stream as split_stream,
    )
    from kdcache.storage.encode import encode_shard as encode_shard
    from kdcache.storage.fingerprint import (
        ArraysHash as ArraysHash,
        StreamHash as StreamHash,
        compare_fingerprints as compare_fingerprints,
        hash_arrays as hash_arrays,
        hash_bytes as hash_bytes,
        hash_json as hash_json,
    )
    from kdcache.storage.folders import (
        CACHE_ENTRIES as CACHE_ENTRIES,
        TABLE as TABLE,
        folder_is_complete as folder_is_complete,
        local_folder_problems as local_folder_problems,
        put_files as put_files,
        put_folder as put_folder,
        read_local_table as read_local_table,
        read_table as read_table,
        seal_local_folder as seal_local_folder,
    )
    from kdcache.storage.hidden_codecs import (
        FP8_MAX as FP8_MAX,
        PARTS as PARTS,
        HiddenCodec as HiddenCodec,
        applies_to as applies_to,
        hidden_codec_of as hidden_codec_of,
        is_part as is_part,
        part_name as part_name,
        part_of as part_of,
        projected as projected,
        register_ops as register_ops,
        resolve_hidden_codec as resolve_hidden_codec,
        row_errors as row_errors,
    )
    from kdcache.storage.projection import (
        has_projection as has_projection,
        read_projection as read_projection,
        write_projection as write_projection,
    )
    from kdcache.storage.reader import CacheReader as CacheReader, ShardData as ShardData
    from kdcache.storage.schema.arrays import CachedArray as CachedArray
    from kdcache.storage.schema.manifest import (
        Manifest as Manifest,
        ShardRecord as ShardRecord,
        cache_exists as cache_exists,
        load_manifest as load_manifest,
        read_json as read_json,
        read_manifest as read_manifest,
        summarize_arrays as summarize_arrays,
    )
    from kdcache.storage.schema.spec import CacheSpec as CacheSpec
    from kdcache.storage.verify import (
        VerifyProblem as VerifyProblem,
        VerifyReport as VerifyReport,
        verify_cache as verify_cache,
    )
    from kdcache.storage.writer import (
        CacheWriter as CacheWriter,
        ShardCommitter as ShardCommitter,
        merge_parts as merge_parts,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
