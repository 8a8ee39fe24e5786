"""Durable local files: a shard's in-memory files to disk, small files written atomically, crc32c, disk-full errors.

Backends never touch the disk: they pack a shard into ``{relative path: bytes}`` in memory, and this module
writes those bytes. Checksums are therefore taken from the very bytes written, never by reading files back.

Durability costs one ``fsync`` per file and per directory, run in a thread pool (fsync releases the GIL and a
device overlaps many flushes), and nothing per array beyond that: a format-3 zarr shard is two files per array.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np

from kdcache.storage.core.errors import DiskFullError

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
BytesLike = bytes | bytearray | memoryview | np.ndarray  # what the checksums and writes below take
# One file's bytes: whole, or the pieces it is written from in order. Pieces spare a copy into one large buffer,
# whose release (munmap, 10-18 ms per 67 MB here) would hold the GIL while the thread feeding the device waits.
FileData = BytesLike | list[BytesLike]
_IO_THREADS = 8  # fsyncs in flight; beyond a handful the device queue, not the thread count, sets the pace


def crc32c(data: FileData, start: int = 0) -> int:
    """crc32c (Castagnoli, as zarr's ``crc32c`` codec) of a bytes-like object (or of pieces one after the other),
    continuing from ``start``.

    The sum runs without the GIL (for buffers over 32 KiB), so writer and reader threads checksumming shards do not
    stall the thread that feeds the device (``benchmarks/bench_gil.py``)."""
    if isinstance(data, list):
        for piece in data:
            start = crc32c(piece, start)
        return start
    flat = np.ascontiguousarray(data).reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return int(_crc32c.crc32c(flat.view(np.uint8).data, start))


def _view(data: BytesLike) -> memoryview:
    """A memoryview of the bytes, numpy arrays included (C-contiguous, as every buffer written here is)."""
    return data.data if isinstance(data, np.ndarray) else memoryview(data)


def file_size(data: FileData) -> int:
    """Bytes in a file's data, whole or in pieces."""
    return sum(_view(p).nbytes for p in data) if isinstance(data, list) else _view(data).nbytes


def joined(data: FileData) -> bytes:
    """A file's data as one ``bytes`` (for an object store's PUT)."""
    return b"".join(_view(p) for p in data) if isinstance(data, list) else bytes(_view(data))


_SCRATCH = threading.local()  # per thread: the buffer read_reused fills
KEPT_BUFFER = 256 << 20  # larger files get a buffer of their own, released after use: none is kept beyond this


def read_reused(path: Path | str) -> memoryview:
    """A whole file read into a buffer this thread reuses: valid until the thread's next call, so decode it first.

    A fresh ``bytes`` per file costs its allocation and, worse, its release: 9-18 ms per 67 MB here, spent in
    ``munmap`` with the GIL held, when the thread feeding the device cannot run. The buffer grows to the largest
    file a thread has read, up to ``KEPT_BUFFER``, and stays.
    """
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        buffer = getattr(_SCRATCH, "buffer", None)
        if buffer is None or buffer.size < size:
            buffer = np.empty(max(size, 1), np.uint8)  # not zeroed: the read fills it
            if size <= KEPT_BUFFER:
                _SCRATCH.buffer = buffer
        view, got = buffer.data[:size], 0
        while got < size and (count := handle.readinto(view[got:])):  # the reads release the GIL
            got += count
    return view[:got]


def fsync_path(path: Path | str) -> None:
    """fsync a file, or a directory (POSIX needs the directory synced to make an entry inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: FileData) -> None:
    # os.open with 0o666 lets the umask decide the mode, like any file a user creates (mkstemp would force 0600).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for piece in data if isinstance(data, list) else [data]:
            view = _view(piece).cast("B")
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tree(root: Path, files: Mapping[str, Any]) -> None:
    """Create ``root`` and write every ``{relative path: bytes}`` under it, durably (files, then directories).

    Raises:
        OSError: as raised by the file system (callers turn a full disk into ``DiskFullError``).
    """
    paths = {os.path.join(root, rel): data for rel, data in files.items()}
    dirs = sorted({str(root)} | {os.path.dirname(p) for p in paths})
    for directory in dirs:
        os.makedirs(directory, exist_ok=True)
    with ThreadPoolExecutor(min(_IO_THREADS, max(1, len(paths)))) as pool:
        list(pool.map(lambda item: _write_file(*item), paths.items()))
        list(pool.map(fsync_path, dirs))


def write_bytes_atomic(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write to a temp file beside ``path``, fsync it, ``os.replace`` it over ``path``, fsync the directory."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        _write_file(str(tmp), data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree; absent is fine."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_json_object(path: Path | str) -> dict[str, Any]:
    """A JSON object from a local file, or ``{}`` when it is missing, unreadable or not an object (run folders are
    read while their runs still write them)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def format_bytes(count: float) -> str:
    """Binary units, labelled: ``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def disk_full_error(exc: OSError, root: Path | None, needed: int, what: str) -> Exception:
    """The error to raise for ``exc``: where the local folder ``root`` (None: an object store) is full or the user's
    quota spent, a ``DiskFullError`` naming the cache, what was being written, the bytes it needs and the free
    space; else ``exc`` itself."""
    if root is None or exc.errno not in FULL_DISK_ERRNOS:
        return exc
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = 0
    return DiskFullError(
        f"disk full while writing {what} of the cache at {root}: it needs about {format_bytes(needed)} and "
        f"{format_bytes(free)} is free there. Nothing half-written was kept. Free at least {format_bytes(needed)} "
        f"more (or move the cache) and rerun the same command: committed shards are reused, and the cache ends "
        f"identical to an uninterrupted run.", needed=needed, free=free)
