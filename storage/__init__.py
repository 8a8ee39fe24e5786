"""kdcache storage: the cache format (v1), its Zarr v3 and Arrow backends, manifest, fingerprints, checksums.

numpy only: nothing here knows about models, losses or torch. Public API (docs/architecture.md)::

    from storage import CacheSpec, CacheWriter, CacheReader, compare_fingerprints, verify_cache, errors

Attributes load lazily, so ``import storage.errors`` (done by the CLI at start-up) does not import zarr or
pyarrow.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CacheSpec": "storage.spec", "FORMAT_VERSION": "storage.spec", "topk_id_dtype": "storage.spec",
    "CacheWriter": "storage.writer", "merge_parts": "storage.writer",
    "CacheReader": "storage.reader", "ShardData": "storage.reader",
    "Manifest": "storage.manifest", "ShardRecord": "storage.manifest", "read_manifest": "storage.manifest",
    "cache_exists": "storage.manifest", "open_store": "storage.stores",
    "compare_fingerprints": "storage.fingerprint", "hash_bytes": "storage.fingerprint",
    "hash_json": "storage.fingerprint", "hash_array": "storage.fingerprint", "hash_arrays": "storage.fingerprint",
    "hash_file": "storage.fingerprint",
    "verify_cache": "storage.verify", "VerifyReport": "storage.verify",
    "check_fp16_range": "storage.dtypes", "to_float32": "storage.dtypes",
    "encode_shard": "storage.encode",
    "errors": "storage.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if name == "errors" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
