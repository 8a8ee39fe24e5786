"""kdcache storage: the cache format (v1), its Zarr v3 and Arrow backends, manifest, fingerprints, checksums.

numpy only: nothing here knows about models, losses or torch. Public API (docs/architecture.md)::

    from kdcache.storage import CacheSpec, CacheWriter, CacheReader, compare_fingerprints, verify_cache, errors

Attributes load lazily, so ``import kdcache.storage.errors`` (done by the CLI at start-up) does not import zarr or
pyarrow.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {  # name -> its module under kdcache.storage
    "CacheSpec": "spec", "FORMAT_VERSION": "formats", "topk_id_dtype": "spec",
    "CacheWriter": "writer", "merge_parts": "writer",
    "CacheReader": "reader", "ShardData": "reader",
    "Manifest": "manifest", "ShardRecord": "manifest", "read_manifest": "manifest", "cache_exists": "manifest",
    "open_store": "stores",
    "compare_fingerprints": "fingerprint", "hash_bytes": "fingerprint", "hash_json": "fingerprint",
    "hash_array": "fingerprint", "hash_arrays": "fingerprint", "hash_file": "fingerprint",
    "verify_cache": "verify", "VerifyReport": "verify",
    "check_fp16_range": "dtypes", "to_float32": "dtypes",
    "encode_shard": "encode",
    "errors": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = module if name == "errors" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
