"""The interface both backends implement, and the file-table checks they share.

A backend is a pure packer and a reader. ``pack`` turns one encoded shard (flat numpy arrays) into the shard's
files, in memory; the writer hands those bytes to the cache's store (a local folder or an object store, see
``storage.core.stores``) and records each file's size and crc32c, taken from the same bytes. ``open`` reads a
committed shard back, checking what it reads; ``verify`` checks every file against that table. Commit (temp
name, rename, sidecar) and the manifest belong to the writer.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdcache.storage.core.errors import ChecksumError
from kdcache.storage.core.files import FileData, crc32c
from kdcache.storage.core.formats import CURRENT, CacheFormat, Problem
from kdcache.storage.core.store_base import Store
from kdcache.storage.schema.manifest import SHARDS_DIR, ShardRecord, shard_name
from kdcache.storage.schema.spec import CacheSpec


@dataclass
class PackedShard:
    """One shard's files, in memory, ready to write.

    Attributes:
        files: path relative to ``shards/`` (``shard-000003/hidden/2/c.0.0``, ``shard-000003.arrow``) -> its
            bytes, whole or in pieces (``files.FileData``).
        arrays: per array ``{"shape", "dtype", "stored_bytes", "decoded_bytes", "files", ...}``.
        extra: backend-level facts for the shard record (e.g. the Arrow header's length and crc32c).
    """

    files: dict[str, FileData]
    arrays: dict[str, dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)


class ShardHandle(ABC):
    """An open, committed shard (``record.path`` of ``store``), read as ``cache_format`` says. Reads are
    thread-safe."""

    def __init__(self, store: Store, record: ShardRecord, spec: CacheSpec, cache_format: CacheFormat) -> None:
        self.store, self.key, self.record, self.spec = store, record.path, record, spec
        self.file_table = cache_format.file_table  # else formats 1-2: the checksums each backend kept then
        self._lock = threading.Lock()

    def fail(self, name: str, message: str) -> ChecksumError:
        """The error naming array ``name`` of this shard, the shard and its file, and what is wrong."""
        return ChecksumError(f"shard {self.record.index}, array {name}: {message} ({self.store.url}/{self.key})",
                             shard=self.record.index, array=name)

    @abstractmethod
    def check(self) -> list[Problem]:
        """Checks due when the shard is opened (with a file table: only the bytes the open itself reads)."""

    def prefetch(self, names: list[str]) -> None:
        """Fetch what reading ``names`` will need, in one round of requests where that helps (object stores).

        Does nothing by default: a local file is read when it is needed."""
        return None

    @abstractmethod
    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Decode array ``name`` (rows ``[start, stop)`` along the first axis, or all of it).

        Raises:
            ChecksumError: the bytes read do not match what was written.
        """


class Backend(ABC):
    """One storage backend: how a shard lives on disk."""

    name: str = ""
    handle: type[ShardHandle]  # what ``open`` returns
    suffix: str = ""  # "" for a directory per shard, ".arrow" for one file per shard
    # Each array compressed with its own codec (a hidden codec's codes with storage.core.codecs.CODES_CODEC); False:
    # one codec per shard file.
    codec_per_array: bool = True
    # Whether a handle decodes rows [start, stop) of an array without decoding the rest of it (zarr's inner chunks);
    # False: a first read decodes the whole column and the handle keeps it (Arrow).
    reads_row_ranges: bool = True
    # (activation codec, top-k codec) of a spec that names none (numcodecs configurations; the spec copies them)
    default_codecs: tuple[dict[str, Any], dict[str, Any]]
    # Raises ``UnknownCodecError`` unless this backend can store with the numcodecs configuration it is given: the
    # backend's own translation of a configuration (its result is not needed to check it).
    check_codec: Callable[[dict[str, Any]], object]

    def __init__(self, cache_format: CacheFormat = CURRENT) -> None:
        # How the cache's shards are checked (storage.core.formats): chosen once, when the cache is opened.
        self.format = cache_format

    def shard_key(self, index: int) -> str:
        """Where committed shard ``index`` lives, relative to the cache root (``shards/shard-000003[.arrow]``)."""
        return f"{SHARDS_DIR}/{shard_name(index)}{self.suffix}"

    @abstractmethod
    def pack(self, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> PackedShard:
        """Compress one shard into its files, in memory (no I/O).

        Args:
            arrays: name -> flat array, as produced by ``storage.encode.encode_shard``.
            spec: the cache spec (codecs, dtypes).
            index: shard number (names the files, and is recorded in the shard's own metadata).
        """

    def open(self, store: Store, record: ShardRecord, spec: CacheSpec) -> ShardHandle:
        """Open committed shard ``record.path`` of ``store`` for reading."""
        return self.handle(store, record, spec, self.format)

    @abstractmethod
    def verify(self, store: Store, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        """Check every stored byte of a shard; never raises for corruption."""


def owner_of(record: ShardRecord, path: str) -> str:
    """The array a file belongs to, or the file's own path for shared files (group metadata, an Arrow file)."""
    owners = [name for name, info in record.arrays.items() if path in info.get("files", ())]
    return owners[0] if len(owners) == 1 else path


def check_file(store: Store, path: str, size: int, crc: int, *, read: bool = True,
               under: str = SHARDS_DIR) -> str | None:
    """What is wrong with one file of the table (``path`` under ``under``, ``shards/`` by default); None: nothing.
    ``read=False`` checks its size only."""
    key = f"{under}/{path}" if under else path
    try:
        actual = store.size(key)
        if actual is None:
            return f"file {path} is missing"
        if actual != size:
            return f"file {path} has {actual} bytes, {size} were written"
        if read and crc32c(store.read(key)) != crc:
            return f"file {path} does not match the crc32c recorded when it was written"
    except OSError as exc:
        return f"cannot read file {path}: {exc.strerror or exc}"
    return None


def verify_file_table(store: Store, record: ShardRecord) -> list[Problem]:
    """Every file of a shard with a file table (storage.core.formats.FILE_TABLE) against its recorded size and
    crc32c."""
    problems = []
    for path, (size, crc) in sorted(record.extra["files"].items()):
        message = check_file(store, path, size, crc)
        if message:
            problems.append((owner_of(record, path), message))
    return problems


def get_backend(spec: CacheSpec, cache_format: CacheFormat = CURRENT) -> Backend:
    """The backend of ``spec`` (``CacheSpec.backend_type``, the class registered as its ``backend``), reading
    shards of ``cache_format`` (an open cache's ``manifest.format``; the current format by default, the only one
    written)."""
    cls: type[Backend] = spec.backend_type  # type: ignore[assignment]  # registered classes are Backends
    return cls(cache_format)
