"""Checks of format 1-2 shards (read-only): a zlib crc32 per zarr array over its files, a crc32 per Arrow file.

Those formats checked a shard by reading every byte of it when it was first opened. Format 3 checks bytes where
they are read instead (storage/backends/base.py); these functions keep older caches readable and verifiable.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from kdcache.storage.backends.base import Problem
from kdcache.storage.errors import StorageError
from kdcache.storage.manifest import ShardRecord
from kdcache.storage.stores import Store


def legacy_path(store: Store, key: str) -> Path:
    """The local path of a format 1-2 shard: those formats were only ever written to local folders."""
    path = store.local_path(key)
    if path is None:
        raise StorageError(f"{store.url}: caches of format 1-2 are read from local folders only; copy it to one")
    return path


def zarr_array_crc(shard: Path, name: str) -> int:
    """crc32 over an array's files (relative path, then bytes, in sorted path order), as format 1 recorded it."""
    crc = 0
    files = sorted((p for p in (shard / name).rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    for path in files:
        crc = zlib.crc32(path.read_bytes(), zlib.crc32(path.relative_to(shard).as_posix().encode(), crc))
    return crc


def zarr_problems(shard: Path, record: ShardRecord) -> list[Problem]:
    """Every array of a format 1-2 zarr shard whose files changed."""
    problems = []
    for name, info in record.arrays.items():
        crc = zarr_array_crc(shard, name)
        if crc != info["crc32"]:
            problems.append((name, f"stored bytes changed (crc32 {crc:08x}, recorded {info['crc32']:08x})"))
    return problems


def value_crc32(offsets: np.ndarray, flat: np.ndarray) -> int:
    """Format 1-2 Arrow per-column checksum: crc32 over the int64 list offsets, then the values."""
    return zlib.crc32(np.ascontiguousarray(flat).data, zlib.crc32(np.ascontiguousarray(offsets, np.int64).data))


def arrow_file_problem(store: Store, key: str, record: ShardRecord) -> Problem | None:
    """The whole-file crc32 of a format 1-2 Arrow shard, or None when it matches."""
    try:
        crc = zlib.crc32(legacy_path(store, key).read_bytes())
    except OSError as exc:
        return ("(file)", f"cannot read: {exc}")
    if crc == record.extra["file_crc32"]:
        return None
    return ("(file)", f"file bytes changed (crc32 {crc:08x}) outside any column's data")
