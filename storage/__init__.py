"""kdcache storage: the cache format, its Zarr v3 and Arrow backends, manifest, fingerprints, checksums.

numpy only: nothing here knows about models, losses or torch. This package is storage's front door: ``stages``
and ``pipeline`` import from ``kdcache.storage`` only, never from its submodules (``tests/test_front_door.py``
reads their source to keep it so), so that storage's file split is not public API. For example::

    from kdcache.storage import CacheSpec, CacheWriter, CacheReader, KdcacheError, compare_fingerprints, verify_cache

Attributes load lazily, so importing one name (``KdcacheError``, done by the CLI at start-up) does not import zarr,
pyarrow or numcodecs; the ``TYPE_CHECKING`` block gives mypy the same names with their types.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kdcache.storage import hidden_codecs as hidden_codecs
    from kdcache.storage.attention_source import (
        DEFAULT_ATTENTION_SOURCE as DEFAULT_ATTENTION_SOURCE,
    )
    from kdcache.storage.attention_source import (
        AttentionLayout as AttentionLayout,
    )
    from kdcache.storage.attention_source import (
        attention_layout as attention_layout,
    )
    from kdcache.storage.attention_source import (
        register_attention_layout as register_attention_layout,
    )
    from kdcache.storage.backends.registry import (
        DEFAULT_BACKEND as DEFAULT_BACKEND,
    )
    from kdcache.storage.backends.registry import (
        backend_names as backend_names,
    )
    from kdcache.storage.buffers import (
        BufferPool as BufferPool,
    )
    from kdcache.storage.buffers import (
        Lease as Lease,
    )
    from kdcache.storage.canonical import (
        canonical_json as canonical_json,
    )
    from kdcache.storage.codecs import (
        describe_codec as describe_codec,
    )
    from kdcache.storage.codecs import (
        resolve_codec as resolve_codec,
    )
    from kdcache.storage.dtypes import (
        check_fp16_range as check_fp16_range,
    )
    from kdcache.storage.dtypes import (
        to_float32 as to_float32,
    )
    from kdcache.storage.encode import (
        encode_shard as encode_shard,
    )
    from kdcache.storage.errors import (
        CacheLockedError as CacheLockedError,
    )
    from kdcache.storage.errors import (
        CacheMismatchError as CacheMismatchError,
    )
    from kdcache.storage.errors import (
        ChecksumError as ChecksumError,
    )
    from kdcache.storage.errors import (
        DiskFullError as DiskFullError,
    )
    from kdcache.storage.errors import (
        FormatVersionError as FormatVersionError,
    )
    from kdcache.storage.errors import (
        Fp16OverflowError as Fp16OverflowError,
    )
    from kdcache.storage.errors import (
        InvalidSequenceError as InvalidSequenceError,
    )
    from kdcache.storage.errors import (
        KdcacheError as KdcacheError,
    )
    from kdcache.storage.errors import (
        LayerNotInCacheError as LayerNotInCacheError,
    )
    from kdcache.storage.errors import (
        ManifestError as ManifestError,
    )
    from kdcache.storage.errors import (
        NonFiniteValueError as NonFiniteValueError,
    )
    from kdcache.storage.errors import (
        PartialCacheError as PartialCacheError,
    )
    from kdcache.storage.errors import (
        ShardError as ShardError,
    )
    from kdcache.storage.errors import (
        SpecError as SpecError,
    )
    from kdcache.storage.errors import (
        StorageError as StorageError,
    )
    from kdcache.storage.errors import (
        UnknownCodecError as UnknownCodecError,
    )
    from kdcache.storage.errors import (
        UnknownFeatureError as UnknownFeatureError,
    )
    from kdcache.storage.files import (
        crc32c as crc32c,
    )
    from kdcache.storage.files import (
        format_bytes as format_bytes,
    )
    from kdcache.storage.files import (
        read_json_object as read_json_object,
    )
    from kdcache.storage.fingerprint import (
        ArraysHash as ArraysHash,
    )
    from kdcache.storage.fingerprint import (
        compare_fingerprints as compare_fingerprints,
    )
    from kdcache.storage.fingerprint import (
        hash_array as hash_array,
    )
    from kdcache.storage.fingerprint import (
        hash_arrays as hash_arrays,
    )
    from kdcache.storage.fingerprint import (
        hash_bytes as hash_bytes,
    )
    from kdcache.storage.fingerprint import (
        hash_file as hash_file,
    )
    from kdcache.storage.fingerprint import (
        hash_json as hash_json,
    )
    from kdcache.storage.folders import (
        CACHE_ENTRIES as CACHE_ENTRIES,
    )
    from kdcache.storage.folders import (
        TABLE as TABLE,
    )
    from kdcache.storage.folders import (
        folder_is_complete as folder_is_complete,
    )
    from kdcache.storage.folders import (
        local_folder_problems as local_folder_problems,
    )
    from kdcache.storage.folders import (
        put_files as put_files,
    )
    from kdcache.storage.folders import (
        put_folder as put_folder,
    )
    from kdcache.storage.folders import (
        read_local_table as read_local_table,
    )
    from kdcache.storage.folders import (
        read_table as read_table,
    )
    from kdcache.storage.folders import (
        seal_local_folder as seal_local_folder,
    )
    from kdcache.storage.formats import (
        FORMAT_VERSION as FORMAT_VERSION,
    )
    from kdcache.storage.hidden_codecs import (
        FP8_MAX as FP8_MAX,
    )
    from kdcache.storage.hidden_codecs import (
        PARTS as PARTS,
    )
    from kdcache.storage.hidden_codecs import (
        applies_to as applies_to,
    )
    from kdcache.storage.hidden_codecs import (
        block_size as block_size,
    )
    from kdcache.storage.hidden_codecs import (
        check_width as check_width,
    )
    from kdcache.storage.hidden_codecs import (
        codec_of as codec_of,
    )
    from kdcache.storage.hidden_codecs import (
        group_count as group_count,
    )
    from kdcache.storage.hidden_codecs import (
        hadamard_matrix as hadamard_matrix,
    )
    from kdcache.storage.hidden_codecs import (
        is_part as is_part,
    )
    from kdcache.storage.hidden_codecs import (
        part_name as part_name,
    )
    from kdcache.storage.hidden_codecs import (
        part_of as part_of,
    )
    from kdcache.storage.hidden_codecs import (
        projected as projected,
    )
    from kdcache.storage.hidden_codecs import (
        rank_of as rank_of,
    )
    from kdcache.storage.hidden_codecs import (
        register_ops as register_ops,
    )
    from kdcache.storage.hidden_codecs import (
        resolve_hidden_codec as resolve_hidden_codec,
    )
    from kdcache.storage.hidden_codecs import (
        rotation_signs as rotation_signs,
    )
    from kdcache.storage.hidden_codecs import (
        row_errors as row_errors,
    )
    from kdcache.storage.logit_layouts import (
        FLOAT as FLOAT,
    )
    from kdcache.storage.logit_layouts import (
        TOPK_MASS as TOPK_MASS,
    )
    from kdcache.storage.logit_layouts import (
        LayoutFields as LayoutFields,
    )
    from kdcache.storage.logit_layouts import (
        LogitFields as LogitFields,
    )
    from kdcache.storage.logit_layouts import (
        exact_arrays as exact_arrays,
    )
    from kdcache.storage.logit_layouts import (
        logit_array as logit_array,
    )
    from kdcache.storage.logit_layouts import (
        logit_arrays as logit_arrays,
    )
    from kdcache.storage.logit_layouts import (
        vocab_id_names as vocab_id_names,
    )
    from kdcache.storage.manifest import (
        Manifest as Manifest,
    )
    from kdcache.storage.manifest import (
        ShardRecord as ShardRecord,
    )
    from kdcache.storage.manifest import (
        cache_exists as cache_exists,
    )
    from kdcache.storage.manifest import (
        load_manifest as load_manifest,
    )
    from kdcache.storage.manifest import (
        read_json as read_json,
    )
    from kdcache.storage.manifest import (
        read_manifest as read_manifest,
    )
    from kdcache.storage.manifest import (
        summarize_arrays as summarize_arrays,
    )
    from kdcache.storage.projection import (
        has_projection as has_projection,
    )
    from kdcache.storage.projection import (
        read_projection as read_projection,
    )
    from kdcache.storage.projection import (
        write_projection as write_projection,
    )
    from kdcache.storage.reader import (
        CacheReader as CacheReader,
    )
    from kdcache.storage.reader import (
        ShardData as ShardData,
    )
    from kdcache.storage.spec import (
        CacheSpec as CacheSpec,
    )
    from kdcache.storage.spec import (
        topk_id_dtype as topk_id_dtype,
    )
    from kdcache.storage.stores import (
        OPTIONS_ENV as OPTIONS_ENV,
    )
    from kdcache.storage.stores import (
        Store as Store,
    )
    from kdcache.storage.stores import (
        default_storage_options as default_storage_options,
    )
    from kdcache.storage.stores import (
        is_url as is_url,
    )
    from kdcache.storage.stores import (
        open_store as open_store,
    )
    from kdcache.storage.stores import (
        parse_storage_options as parse_storage_options,
    )
    from kdcache.storage.streams import (
        CROSS as CROSS,
    )
    from kdcache.storage.streams import (
        kind_of as kind_of,
    )
    from kdcache.storage.streams import (
        prefixed as prefixed,
    )
    from kdcache.storage.streams import (
        ragged_streams as ragged_streams,
    )
    from kdcache.storage.streams import (
        split_stream as split_stream,
    )
    from kdcache.storage.verify import (
        VerifyProblem as VerifyProblem,
    )
    from kdcache.storage.verify import (
        VerifyReport as VerifyReport,
    )
    from kdcache.storage.verify import (
        verify_cache as verify_cache,
    )
    from kdcache.storage.writer import (
        CacheWriter as CacheWriter,
    )
    from kdcache.storage.writer import (
        merge_parts as merge_parts,
    )

_EXPORTS = {  # name -> its module under kdcache.storage
    "AttentionLayout": "attention_source", "DEFAULT_ATTENTION_SOURCE": "attention_source",
    "attention_layout": "attention_source", "register_attention_layout": "attention_source",
    "DEFAULT_BACKEND": "backends.registry", "backend_names": "backends.registry",
    "BufferPool": "buffers", "Lease": "buffers",
    "canonical_json": "canonical",
    "describe_codec": "codecs", "resolve_codec": "codecs",
    "check_fp16_range": "dtypes", "to_float32": "dtypes",
    "encode_shard": "encode",
    "CacheLockedError": "errors", "CacheMismatchError": "errors", "ChecksumError": "errors", "DiskFullError": "errors",
    "FormatVersionError": "errors", "Fp16OverflowError": "errors", "InvalidSequenceError": "errors",
    "KdcacheError": "errors", "LayerNotInCacheError": "errors", "ManifestError": "errors",
    "NonFiniteValueError": "errors", "PartialCacheError": "errors", "ShardError": "errors", "SpecError": "errors",
    "StorageError": "errors", "UnknownCodecError": "errors", "UnknownFeatureError": "errors", "errors": "errors",
    "hidden_codecs": "hidden_codecs", "PARTS": "hidden_codecs", "register_ops": "hidden_codecs",
    "row_errors": "hidden_codecs",
    "format_bytes": "files", "crc32c": "files", "read_json_object": "files",
    "ArraysHash": "fingerprint", "compare_fingerprints": "fingerprint", "hash_array": "fingerprint",
    "hash_arrays": "fingerprint", "hash_bytes": "fingerprint", "hash_file": "fingerprint", "hash_json": "fingerprint",
    "CACHE_ENTRIES": "folders", "TABLE": "folders", "folder_is_complete": "folders", "local_folder_problems": "folders",
    "put_folder": "folders", "put_files": "folders", "read_table": "folders", "read_local_table": "folders",
    "seal_local_folder": "folders",
    "FORMAT_VERSION": "formats",
    "FP8_MAX": "hidden_codecs", "applies_to": "hidden_codecs", "block_size": "hidden_codecs",
    "check_width": "hidden_codecs", "codec_of": "hidden_codecs", "group_count": "hidden_codecs",
    "hadamard_matrix": "hidden_codecs", "is_part": "hidden_codecs", "part_name": "hidden_codecs",
    "part_of": "hidden_codecs", "projected": "hidden_codecs", "rank_of": "hidden_codecs",
    "resolve_hidden_codec": "hidden_codecs", "rotation_signs": "hidden_codecs",
    "FLOAT": "logit_layouts", "LayoutFields": "logit_layouts", "LogitFields": "logit_layouts",
    "TOPK_MASS": "logit_layouts", "exact_arrays": "logit_layouts", "logit_array": "logit_layouts",
    "logit_arrays": "logit_layouts", "vocab_id_names": "logit_layouts",
    "Manifest": "manifest", "ShardRecord": "manifest", "cache_exists": "manifest", "load_manifest": "manifest",
    "read_json": "manifest", "read_manifest": "manifest", "summarize_arrays": "manifest",
    "has_projection": "projection", "read_projection": "projection", "write_projection": "projection",
    "CacheReader": "reader", "ShardData": "reader",
    "CacheSpec": "spec", "topk_id_dtype": "spec",
    "OPTIONS_ENV": "stores", "Store": "stores", "default_storage_options": "stores", "is_url": "stores",
    "open_store": "stores", "parse_storage_options": "stores",
    "CROSS": "streams", "kind_of": "streams", "prefixed": "streams", "ragged_streams": "streams",
    "split_stream": "streams",
    "VerifyProblem": "verify", "VerifyReport": "verify", "verify_cache": "verify",
    "CacheWriter": "writer", "merge_parts": "writer",
}
_MODULES = {"errors", "hidden_codecs"}  # exported as modules: their names are read through them
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
