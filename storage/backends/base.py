"""The Store-like interface both backends implement.

A backend knows how to put one encoded shard (flat numpy arrays) onto disk at a temporary path, durably, and
how to read arrays or slices back. It reports, per array, the stored (compressed) bytes and a crc32 the reader
checks later. Commit (rename, sidecar) and the manifest belong to the writer, not to backends.
"""

from __future__ import annotations

import os
import shutil
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from storage.manifest import SHARDS_DIR, ShardRecord, shard_name
from storage.spec import CacheSpec

# (array name, what is wrong); array "(file)" means bytes that belong to no single array.
Problem = tuple[str, str]


class ShardHandle(ABC):
    """An open, committed shard. Reads are thread-safe."""

    @abstractmethod
    def check(self) -> list[Problem]:
        """Compare stored bytes with the recorded checksums (cheap: no decode where avoidable)."""

    @abstractmethod
    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Decode array ``name`` (rows ``[start, stop)`` along the first axis, or all of it)."""


class Backend(ABC):
    """One storage backend: how a shard lives on disk."""

    name: str = ""
    suffix: str = ""  # "" for a directory per shard, ".arrow" for one file per shard

    def final_path(self, root: Path, index: int) -> Path:
        """Where committed shard ``index`` lives."""
        return Path(root) / SHARDS_DIR / f"{shard_name(index)}{self.suffix}"

    def temp_path(self, root: Path, index: int) -> Path:
        """A fresh temporary path for shard ``index``; the leading dot keeps it out of globs of shards."""
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return Path(root) / SHARDS_DIR / f".tmp-{shard_name(index)}-{tag}{self.suffix}"

    @abstractmethod
    def write(self, path: Path, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Write and fsync one shard at ``path``.

        Args:
            path: temporary path (from ``temp_path``).
            arrays: name -> flat array, as produced by ``storage.encode.encode_shard``.
            spec: the cache spec (codecs, dtypes).
            index: shard number (recorded in the shard's own metadata for plain-tool users).

        Returns:
            ``(arrays_info, extra)``: per array ``{"shape", "dtype", "stored_bytes", "decoded_bytes", "crc32"}``,
            and backend-level extras to keep in the shard record.
        """

    @abstractmethod
    def open(self, path: Path, record: ShardRecord, spec: CacheSpec) -> ShardHandle:
        """Open committed shard at ``path`` for reading."""

    @abstractmethod
    def verify(self, path: Path, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        """Re-read and decode every chunk of every array; never raises for corruption."""

    def remove(self, path: Path) -> None:
        """Delete a (temporary or stale) shard, file or directory."""
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` ("zarr" or "arrow")."""
    from storage.backends.arrow_backend import ArrowBackend
    from storage.backends.zarr_backend import ZarrBackend
    from storage.errors import SpecError

    backends: dict[str, type[Backend]] = {"zarr": ZarrBackend, "arrow": ArrowBackend}
    if name not in backends:
        raise SpecError(f"unknown backend {name!r}; expected one of {sorted(backends)}")
    return backends[name]()
