"""The contract of where a cache's bytes live: ``Store``, the operations a cache needs, and ``WriterLock``, the
handle of a writer's exclusive lock. Its two kinds, a folder and an fsspec URL, are in ``storage.core.stores``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kdcache.storage.core.canonical import canonical_json


class WriterLock(Protocol):
    """A writer's exclusive lock (``Store.lock``): an flock, or a lease on an object store."""

    def renew(self) -> None:
        """Show that the holder is alive (an object-store lease expires otherwise)."""

    def close(self) -> None:
        """Release the lock."""


class Store(ABC):
    """The few operations a cache needs from where it lives."""

    url: str

    @abstractmethod
    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of an object (all of it by default). Raises FileNotFoundError."""

    def read_many(self, keys: list[str]) -> dict[str, bytes]:
        """Several whole objects; an object store fetches them concurrently. Raises FileNotFoundError."""
        return {key: self.read(key) for key in keys}

    def read_transient(self, key: str) -> bytes | memoryview:
        """A whole object to decode at once: a folder reads it into a buffer the calling thread reuses
        (``files.read_reused``), an object store returns ``read``'s bytes."""
        return self.read(key)

    @property
    def is_local(self) -> bool:
        """Whether reads are file reads (cheap to issue one by one) rather than requests."""
        return self.local_path("") is not None

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size of an object in bytes, or None when it does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object, or any object under ``key/``, exists."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (objects and sub-prefixes), unsorted."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write one small object atomically (readers see the old one or the new one)."""

    @abstractmethod
    def put_shard(self, key: str, files: Mapping[str, Any]) -> None:
        """Make shard ``key`` (``shards/shard-000003[.arrow]``) hold ``files`` (paths under ``shards/``), durably."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Delete an object or everything under a prefix; absent is fine."""

    def remove_temps(self, prefix: str = "") -> None:
        """Remove leftovers of writers that died mid-shard (``shards/.tmp-{prefix}*``, and a sidecar's
        ``shards/.{prefix}*.tmp``). Only a folder has temps: an object store writes at final keys."""
        return None

    @abstractmethod
    def lock(self, name: str, what: str) -> WriterLock:
        """Take the exclusive lock ``locks/{name}`` without waiting; the handle has ``renew()`` and ``close()``.

        Raises:
            CacheLockedError: another live writer holds it.
        """

    def merge_lock(self) -> contextlib.AbstractContextManager[None]:
        """Serialises manifest merges between processes, where the store can (a context manager)."""
        return contextlib.nullcontext()

    @abstractmethod
    def put_folder(self, key: str, files: Mapping[str, bytes], last: str) -> None:
        """Make folder ``key`` hold ``files`` (relative paths -> bytes), appearing whole; ``last`` (one of them)
        lands last, so a folder holding ``last`` is complete. A complete ``key`` is kept (another rank wrote it);
        an incomplete one (its writer died) is replaced."""

    @abstractmethod
    def fetch_folder(self, key: str, scratch: Path) -> Path | None:
        """A local folder holding ``key``'s files (downloaded under ``scratch`` if needed); None if absent."""

    def local_path(self, key: str) -> Path | None:
        """The file behind ``key`` when the store is a local folder (for memory maps), else None."""
        return None

    def put_json(self, key: str, obj: object) -> None:
        """Write ``obj`` as canonical JSON (storage.core.canonical), so equal values are equal bytes."""
        self.put(key, canonical_json(obj))
