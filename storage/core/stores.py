"""Where a cache's bytes live: a local folder, or any fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``...).

A store speaks in keys relative to the cache root (``manifest.json``, ``shards/shard-000003.json``). Both kinds
keep the same commit protocol, "a shard is visible only once complete", by their own means:

- ``LocalStore``: a shard's files go under a temp name, are fsynced, and the temp is renamed into place; small
  objects are written to a temp file and renamed; locks are ``flock``s, released by the kernel if a writer dies.
- ``RemoteStore``: an object store has no rename, but a PUT is atomic. A shard's data objects are PUT at their
  final keys, then its sidecar object: the sidecar is the commit point, so data without a sidecar is never read
  and a rerun overwrites it. Locks are lease objects created with a conditional PUT where the store has one.

Credentials and endpoints come from the environment as each fsspec backend reads them (``AWS_*`` for s3fs,
``AWS_ENDPOINT_URL`` for an S3-compatible server), plus ``storage_options`` (``--storage-option key=value``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from kdcache.storage.core.canonical import canonical_json
from kdcache.storage.core.errors import CacheLockedError, StorageError
from kdcache.storage.core.files import fsync_path, joined, read_reused, remove_path, write_bytes_atomic, write_tree
from kdcache.storage.core.store_base import Store, WriterLock

OPTIONS_ENV = "KDCACHE_STORAGE_OPTIONS"
_BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                     "abfss": "adlfs", "hf": "huggingface_hub"}


class LocalStore(Store):
    """A cache in a local (or POSIX-mounted shared) folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        with open(self.root / key, "rb") as handle:
            handle.seek(start or 0)
            return handle.read() if stop is None else handle.read(stop - (start or 0))

    def read_transient(self, key: str) -> memoryview:
        return read_reused(self.root / key)

    def size(self, key: str) -> int | None:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def list(self, prefix: str) -> list[str]:
        try:
            return os.listdir(self.root / prefix)
        except FileNotFoundError:
            return []

    def put(self, key: str, data: bytes) -> None:
        (self.root / key).parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.root / key, data)

    def put_shard(self, key: str, files: Mapping[str, Any]) -> None:
        final = self.root / key
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:  # written under the temp name first; the rename makes the shard appear whole
            write_tree(final.parent, {tmp.name + path[len(final.name):]: data for path, data in files.items()})
            os.replace(tmp, final)
        except BaseException:
            remove_path(tmp)
            raise
        fsync_path(final.parent)

    def remove(self, key: str) -> None:
        remove_path(self.root / key)

    def remove_temps(self, prefix: str = "") -> None:
        shards = self.root / "shards"
        # A shard's data is written as .tmp-{name}-... (put_shard), its sidecar as .{name}.json.{pid}-{id}.tmp
        # (files.write_bytes_atomic): a writer killed in either leaves one behind.
        for stale in [*shards.glob(f".tmp-{prefix}*"), *shards.glob(f".{prefix}*.tmp")]:
            remove_path(stale)

    def lock(self, name: str, what: str) -> WriterLock:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        handle = open(self.root / "locks" / name, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if the process dies
        except BlockingIOError:
            handle.close()
            raise CacheLockedError(f"{what} of {self.url} is locked by another running writer "
                                   f"({self.root / 'locks' / name}); wait for it or use another part") from None
        return _FileLock(handle)

    def put_folder(self, key: str, files: Mapping[str, bytes], last: str) -> None:
        final = self.root / key
        tmp = final.parent / f".{final.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        write_tree(tmp, files)  # os.makedirs and 0o666 files: the umask decides every mode, as for shards
        try:
            if final.exists() and not (final / last).exists():
                remove_path(final)  # left incomplete by a writer that died
            os.rename(tmp, final)
        except OSError:
            remove_path(tmp)
            if not (final / last).exists():  # not another rank's identical copy landing first: a real failure
                raise
        fsync_path(final.parent)

    def fetch_folder(self, key: str, scratch: Path) -> Path | None:
        return self.root / key if (self.root / key).is_dir() else None

    @contextlib.contextmanager
    def merge_lock(self) -> Iterator[None]:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        with open(self.root / "locks" / "manifest.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # blocking; held for milliseconds
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def local_path(self, key: str) -> Path | None:
        return self.root / key


class _FileLock:
    """An flock held through an open file; nothing to renew (the kernel drops it when the process dies)."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle

    def renew(self) -> None:
        pass

    def close(self) -> None:
        self.handle.close()


class RemoteStore(Store):
    """A cache under an fsspec URL; every operation is one or a few requests to the store."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec  # an object store only: `kdcache inspect` of a local cache stays without it

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **dict(storage_options or {}))
        except ImportError:
            scheme = url.split("://", 1)[0]
            package = _BACKEND_PACKAGES.get(scheme, f"the fsspec backend for {scheme}://")
            raise StorageError(f"{url}: reading or writing {scheme}:// needs {package}; install it "
                               f"(pip install {package.split()[0]})") from None
        except ValueError as exc:  # fsspec: "Protocol not known"
            raise StorageError(f"{url}: unknown storage scheme ({exc}); use a local path or an fsspec URL "
                               f"such as s3://bucket/cache, gs://bucket/cache or file:///path") from None

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=start, end=stop))

    def read_many(self, keys: list[str]) -> dict[str, bytes]:
        fetched = self.fs.cat([self._path(key) for key in keys])  # s3fs: all requests in flight at once
        return {key: bytes(fetched[self._path(key)]) for key in keys}

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.info(self._path(key))["size"])
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def list(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(self._path(prefix))  # other processes write here too
        try:
            return [name.rstrip("/").rsplit("/", 1)[-1] for name in self.fs.ls(self._path(prefix), detail=False)]
        except FileNotFoundError:
            return []

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create an object unless one exists (a conditional PUT where the store has one); False if it existed."""
        try:
            self.fs.pipe_file(self._path(key), bytes(data), mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):  # no conditional PUT here: check, then put
            if self.exists(key):
                return False
            self.put(key, data)
            return True

    def put_shard(self, key: str, files: Mapping[str, Any]) -> None:
        # One batch of PUTs (s3fs sends them concurrently); nothing refers to them until the sidecar lands.
        base = key.rsplit("/", 1)[0]
        self.fs.pipe({self._path(f"{base}/{path}"): joined(data) for path, data in files.items()})

    def remove(self, key: str) -> None:
        try:
            self.fs.rm(self._path(key), recursive=True)
        except FileNotFoundError:
            pass

    def put_folder(self, key: str, files: Mapping[str, bytes], last: str) -> None:
        if self.exists(f"{key}/{last}"):
            return
        self.fs.pipe({self._path(f"{key}/{path}"): bytes(data) for path, data in files.items() if path != last})
        self.put(f"{key}/{last}", files[last])  # the commit point, as a sidecar is a shard's

    def fetch_folder(self, key: str, scratch: Path) -> Path | None:
        if not self.exists(key):
            return None
        dest = scratch / key.replace("/", "_")
        self.fs.get(self._path(key) + "/", str(dest) + "/", recursive=True)
        return dest

    def lock(self, name: str, what: str) -> WriterLock:
        return RemoteLock(self, f"locks/{name}", what)

    def check(self) -> None:
        """One request to the bucket (or top-level container), so a wrong URL fails with one clear line.

        Raises:
            StorageError: no such bucket, access denied (credentials), or the endpoint cannot be reached.
        """
        top = self.root.split("/", 1)[0]
        try:
            self.fs.info(top)
        except FileNotFoundError:
            raise StorageError(f"{self.url}: the bucket {top!r} does not exist (or is not visible with these "
                               f"credentials); create it first") from None
        except PermissionError as exc:
            raise StorageError(f"{self.url}: access denied ({exc}); check the credentials (AWS_ACCESS_KEY_ID, "
                               f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or --storage-option)") from None
        except Exception as exc:  # noqa: BLE001 - each backend has its own connection errors
            raise StorageError(f"{self.url}: cannot reach the store ({type(exc).__name__}: {exc}); check the "
                               f"endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...)") from None


LEASE_SECONDS = 30 * 60  # a lease not renewed for this long belongs to a writer that died


class RemoteLock:
    """A lock on an object store, which has no flock: a lease object per writer part saying who holds it (owner
    id, host, pid, time), renewed while the writer commits shards.

    Created with a conditional PUT (``If-None-Match: *``) where the store supports it (S3 and compatible servers), so
    two writers that start together cannot both win; elsewhere the owner reads the lease back to confirm it. A lease
    left by a writer that died is taken over when its process is gone (same host) or it has not been renewed for
    ``LEASE_SECONDS`` (the writer renews it after every committed shard).
    """

    def __init__(self, store: RemoteStore, key: str, what: str) -> None:
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


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a store by URL (``scheme://...``) rather than a local folder."""
    return "://" in str(path)


def default_storage_options() -> dict[str, Any]:
    """fsspec options from ``KDCACHE_STORAGE_OPTIONS`` (JSON), which ``--storage-option`` sets for this process
    and every process it starts (torchrun ranks, sweep runs)."""
    text = os.environ.get(OPTIONS_ENV, "")
    try:
        options = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise StorageError(f"{OPTIONS_ENV} is not valid JSON ({exc}): {text[:100]!r}") from None
    if not isinstance(options, dict):
        raise StorageError(f"{OPTIONS_ENV} must be a JSON object of fsspec options, got {text[:100]!r}")
    return options


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``["endpoint_url=http://...", "anon=false"]`` -> ``{"endpoint_url": "http://...", "anon": False}``.

    Values are JSON where they parse as JSON (numbers, booleans), else strings.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StorageError(f"--storage-option {pair!r}: expected key=value, e.g. endpoint_url=http://host:9000")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


_OPENED: dict[str, Store] = {}  # remote stores already checked, per URL and options


def open_store(path: str | os.PathLike[str] | Store, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a local path or a URL (``file://`` URLs are local folders, with local durability).

    Raises:
        StorageError: unknown scheme, missing fsspec backend, no such bucket, access denied, unreachable.
    """
    if isinstance(path, Store):
        return path
    text = str(path)
    if text.startswith("file://"):
        return LocalStore(text[len("file://"):])
    if not is_url(text):
        return LocalStore(os.path.expanduser(text))
    options = {**default_storage_options(), **dict(storage_options or {})}
    cache_key = json.dumps([text.rstrip("/"), options], sort_keys=True, default=str)
    if cache_key not in _OPENED:
        store = RemoteStore(text, options)
        store.check()
        _OPENED[cache_key] = store
    return _OPENED[cache_key]
