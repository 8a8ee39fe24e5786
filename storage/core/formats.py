"""The one place that knows the cache's format versions: every older cache is read through this adapter.

Format history (docs/cache-format.md):

1. single-stream caches: one zarr group per shard (chunk files ``c/0/0``) or an Arrow IPC *file*; a zlib crc32
   per zarr array over its files, per Arrow column over its values and over the whole Arrow file;
2. the same, plus seq2seq caches (two token streams, ``layout="seq2seq"``);
3. one sharded file per zarr array with a crc32c per inner chunk, Arrow IPC *streams*, and a size and crc32c per
   file in each shard record (its file table); caches written since the index seals also seal ``manifest.json``
   and every sidecar with their own crc32c and list the files beside the shards (``manifest.json["files"]``);
4. token arrays (loss masks, document positions) beside the ids.

Everything else reads the current structures. ``read_format`` turns a raw ``manifest.json`` into a
``CacheFormat``, chosen once when a cache is opened: its version, and as data what that format's bytes let a
reader check (``features``). The backends take it when they are built (``backends.base.get_backend``) and
read an older shard through the checks below; ``verify`` takes its note from it. This code writes only
``FORMAT_VERSION``; resuming an older cache is refused (``CacheFormat.refusal``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kdcache.storage.core.errors import FormatVersionError, ManifestError, StorageError
from kdcache.storage.core.store_base import Store

FORMAT_VERSION = 4  # what this code writes
READABLE_FORMAT_VERSION = 4  # the newest format this code reads
FIRST_FILE_TABLE = 3  # the first format whose shard records list every file's size and crc32c

# What a format lets a reader check, beyond decoding what it reads.
FILE_TABLE = "file_table"  # each shard file's size and crc32c (3+): reads check the bytes they read, where read
SEALED_INDEX = "sealed_index"  # manifest.json and sidecars carry their own crc32c; the folders beside are listed
WRITABLE = "writable"  # this code can add shards to it (its own format only)

Problem = tuple[str, str]  # (array, or a file path where the bytes belong to no single array; what is wrong)


@dataclass(frozen=True)
class CacheFormat:
    """One cache's on-disk format as a reader sees it.

    Attributes:
        version: ``format_version`` from its ``manifest.json``.
        features: the checks its bytes allow (``FILE_TABLE``, ``SEALED_INDEX``) and ``WRITABLE``.
    """

    version: int
    features: frozenset[str]

    @property
    def file_table(self) -> bool:
        """Whether shard records hold a per-file table (else per-array zlib crc32s, checked when opened)."""
        return FILE_TABLE in self.features

    @property
    def sealed_index(self) -> bool:
        """Whether the index files carry their own crc32c and the folders beside the shards are listed."""
        return SEALED_INDEX in self.features

    def refusal(self, root: str) -> str | None:
        """Why a writer cannot add shards to this cache (keeping the cache's format), or None when it can."""
        if WRITABLE in self.features:
            return None
        return (f"{root} is a format {self.version} cache; this kdcache reads it but writes format "
                f"{FORMAT_VERSION} only, so it cannot add shards to it. Write to a new directory.")

    def note(self, folders: list[str]) -> str | None:
        """What ``verify`` cannot have checked in a cache of this format (``folders``: those beside the shards)."""
        if self.sealed_index:
            return None
        return (f"this cache was written before kdcache checksummed its index files (format {self.version}, "
                f"no 'files' in manifest.json): manifest.json and the shard sidecars carry no crc32c of their own"
                + (f", and {', '.join(folders)} {'is' if len(folders) == 1 else 'are'} not checked" if folders else "")
                + "; their values are still cross-checked against the data")


@cache
def cache_format(version: int, sealed: bool) -> CacheFormat:
    """The ``CacheFormat`` of a readable ``version`` (``sealed``: its manifest lists the files beside the shards,
    which every cache written since the seals does)."""
    features = {FILE_TABLE} if version >= FIRST_FILE_TABLE else set()
    features |= {SEALED_INDEX} if sealed else set()
    features |= {WRITABLE} if version == FORMAT_VERSION else set()
    return CacheFormat(version, frozenset(features))


CURRENT = cache_format(FORMAT_VERSION, True)  # what this code writes


def read_format(data: Mapping[str, Any], where: str) -> CacheFormat:
    """The format of a raw ``manifest.json`` object, checked before anything else in it is read.

    Raises:
        ManifestError: no integer ``format_version`` (not a kdcache cache).
        FormatVersionError: written by a newer format than this code reads.
    """
    version = data.get("format_version")
    if not isinstance(version, int):
        raise ManifestError(f"{where} has no integer format_version (got {version!r}); not a kdcache cache?")
    if version > READABLE_FORMAT_VERSION:
        raise FormatVersionError(f"{where} has format_version {version}; this code reads versions up to "
                                 f"{READABLE_FORMAT_VERSION}. Upgrade kdcache to read this cache.")
    return cache_format(version, data.get("files") is not None)


# ---- reading shards without a file table (formats 1-2) ------------------------------------------------------
# Those formats checked a shard by reading every byte of it when it was first opened; they were only ever
# written to local folders.


def legacy_path(store: Store, key: str) -> Path:
    """The local path of a format 1-2 shard."""
    path = store.local_path(key)
    if path is None:
        raise StorageError(f"{store.url}: caches of format 1-2 are read from local folders only; copy it to one")
    return path


def zarr_problems(store: Store, key: str, arrays: Mapping[str, Mapping[str, Any]]) -> list[Problem]:
    """Every array of a format 1-2 zarr shard (``arrays``: its record's) whose files changed."""
    shard = legacy_path(store, key)
    problems = []
    for name, info in arrays.items():
        # crc32 over the array's files (relative path, then bytes, in sorted path order), as format 1 recorded it
        crc = 0
        for path in sorted((p for p in (shard / name).rglob("*") if p.is_file()), key=lambda p: p.as_posix()):
            crc = zlib.crc32(path.read_bytes(), zlib.crc32(path.relative_to(shard).as_posix().encode(), crc))
        if crc != info["crc32"]:
            problems.append((name, f"stored bytes changed (crc32 {crc:08x}, recorded {info['crc32']:08x})"))
    return problems


def value_crc32(offsets: np.ndarray, flat: np.ndarray) -> int:
    """Format 1-2 Arrow per-column checksum: crc32 over the int64 list offsets, then the values."""
    return zlib.crc32(np.ascontiguousarray(flat).data, zlib.crc32(np.ascontiguousarray(offsets, np.int64).data))


def arrow_file_problem(store: Store, key: str, recorded: int) -> Problem | None:
    """The whole-file crc32 of a format 1-2 Arrow shard against ``recorded``, or None when it matches."""
    try:
        crc = zlib.crc32(legacy_path(store, key).read_bytes())
    except OSError as exc:
        return ("(file)", f"cannot read: {exc}")
    if crc == recorded:
        return None
    return ("(file)", f"file bytes changed (crc32 {crc:08x}) outside any column's data")
