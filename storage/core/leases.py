"""Locks on object stores: a lease object per writer part, since there is no flock there.

Created with a conditional PUT (``If-None-Match: *``) where the store supports it (S3 and compatible servers), so
two writers that start together cannot both win; elsewhere the owner reads the lease back to confirm it. A lease
left by a writer that died is taken over when its process is gone (same host) or it has not been renewed for
``LEASE_SECONDS`` (the writer renews it after every committed shard).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from kdcache.storage.core.canonical import canonical_json
from kdcache.storage.core.errors import CacheLockedError

LEASE_SECONDS = 30 * 60  # a lease not renewed for this long belongs to a writer that died


class LeaseStore(Protocol):
    """What a lease needs of its store (``storage.core.stores.RemoteStore``, which imports this module)."""

    url: str

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes: ...

    def put(self, key: str, data: bytes) -> None: ...

    def remove(self, key: str) -> None: ...


class RemoteLock:
    """A lease object: who holds a lock (owner id, host, pid, time), renewed while the writer commits shards.

    ``store`` is the ``storage.core.stores.RemoteStore`` holding the lease (``put_if_absent``, ``read``, ``put``,
    ``remove``).
    """

    def __init__(self, store: LeaseStore, key: str, what: str) -> None:
        self.store, self.key, self.what = store, key, what
        self.lease = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        if not self._create():
            held = self._current()
            if held is not None and not _stale(held):
                raise CacheLockedError(
                    f"{what} of {store.url} is held by a running writer (pid {held.get('pid')} on "
                    f"{held.get('host')}, lease {store.url}/{key}, renewed "
                    f"{int(time.time() - float(held.get('time', 0)))} s ago); "
                    f"wait for it, use another part, or delete that object if no writer runs")
            store.remove(key)
            if not self._create():
                raise CacheLockedError(f"{what} of {store.url}: another writer took the lease {key} first")

    def _payload(self) -> bytes:
        return canonical_json({**self.lease, "time": time.time()})

    def _create(self) -> bool:
        """PUT the lease unless one exists; False when another writer's lease is there."""
        if self.store.put_if_absent(self.key, self._payload()):
            return (self._current() or {}).get("owner") == self.lease["owner"]  # read back: racing writers
        return False

    def _current(self) -> dict[str, Any] | None:
        """The lease held now; None when there is none, or it is not a lease this code wrote (taken over)."""
        try:
            held = json.loads(self.store.read(self.key))
            float(held["time"])
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return None
        return held if isinstance(held, dict) else None

    def renew(self) -> None:
        """Refresh the lease's time (the writer calls it after each committed shard)."""
        self.store.put(self.key, self._payload())

    def close(self) -> None:
        if (self._current() or {}).get("owner") == self.lease["owner"]:
            self.store.remove(self.key)


def _stale(lease: Mapping[str, Any]) -> bool:
    """Whether a lease belongs to a writer that is gone."""
    if lease.get("host") == socket.gethostname():
        try:
            os.kill(int(lease.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError):
            pass
    return time.time() - float(lease.get("time", 0)) > LEASE_SECONDS
