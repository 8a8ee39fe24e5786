"""The rows of a cache, built once and kept as a memory-mapped Arrow file that every rank and every rerun opens.

Tokenizing, rendering chats, masking and packing cost minutes to hours at corpus scale, and their result
depends only on the data, the tokenizer and the row settings, not on the rank, the job-array part or the
attempt. So the first process to need a set of rows builds it under a file lock, into a folder named by the hash
of what the rows depend on (the *row key*); every other process waits on the lock, then opens the finished
file. A rank then touches only the pages of its own shards' rows, so its resident memory does not grow with the
data beyond what the memory map shares with the page cache.

Layout of ``<root>/<key>/``: ``rows.arrow`` (an Arrow IPC file, one ``list<...>`` column per token array:
``input_ids``, ``loss_mask``, ``position_ids``, or ``encoder/input_ids``...), ``rows.json`` (the key, the data
fingerprint, row and token counts) and, written last, ``.kdcache-files.json``: the sealed file table every folder
of a cache carries (``storage.folders``), plus the data fingerprint, so ``kdcache verify`` finds a cache's rows.
Every open checks the table against the files first; a folder without an intact table (an interrupted build, a
flipped byte) is rebuilt with a note, never used. ``<key>.lock`` beside it is an empty ``flock`` handle.

``<root>`` is one folder for every cache, local or in object storage (``rows_root``): the rows are a cache of
the data, not part of any cache, so ``--out`` holds only the cache, and a run refused there leaves it untouched.

pyarrow and datasets (for ``rows_root``) load with this module: stage one imports it, and ``kdcache verify`` (for
``row_problems``), which reads a cache's rows' tables; neither is a path kept free of them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import datasets
import numpy as np
import pyarrow as pa
from filelock import FileLock

from kdcache.storage import (
    TABLE,
    ArrayKind,
    ArraysHash,
    canonical_json,
    hash_json,
    kind_of,
    local_folder_problems,
    read_local_table,
    seal_local_folder,
    split_stream,
)

ROWS_VERSION = 1  # bump when the file layout or the building rules change
_BATCH_ROWS = 4096  # rows per Arrow record batch: a few MiB of tokens, so the writer's memory stays flat
# text / text_end: --record-text's row text (UTF-8 bytes) and token ends (stages.common.cache_texts)
_ARROW_TYPES = {"input_ids": "int32", "loss_mask": "uint8", "position_ids": "int32", "text": "uint8",
                "text_end": "int32"}


class RowColumn(Sequence[np.ndarray]):
    """One token array of every row, read lazily from the memory-mapped file: ``column[i]`` is row ``i``'s
    ``[L_i]`` array, a zero-copy view, and ``column[a:b]`` a list of them; nothing is read until asked for."""

    def __init__(self, chunks: list[Any]) -> None:
        self._offsets = [c.offsets.to_numpy() for c in chunks]  # int32 [n_c + 1] per chunk, into its values
        self._values = [c.values.to_numpy() for c in chunks]
        self._starts = np.cumsum([0] + [len(c) for c in chunks])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _row(self, i: int) -> np.ndarray:
        c = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets, j = self._offsets[c], i - int(self._starts[c])
        return self._values[c][offsets[j]:offsets[j + 1]]

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range 0..{len(self) - 1}")
        return self._row(index % len(self))

    def lengths(self) -> np.ndarray:
        """``[N]`` int64 row lengths (from the offsets alone)."""
        return np.concatenate([np.diff(o).astype(np.int64) for o in self._offsets]) if self._offsets else \
            np.zeros(0, dtype=np.int64)


@dataclass
class RowTable:
    """A finished row folder, opened read-only through a memory map.

    Attributes:
        path: the folder.
        meta: ``rows.json``: ``key``, ``fingerprint`` (the cache's data fingerprint), ``num_rows``, ``tokens`` and
            ``longest`` per stream, ``sum_sq_lengths`` per stream (attention sizes), ``max_id``, ``dropped``
            counts, ``build_seconds``.
        columns: array name -> its rows.
        built: True when this process built the rows, False when it opened what another process built.
    """

    path: Path
    meta: dict[str, Any]
    columns: dict[str, RowColumn]
    built: bool = False

    @classmethod
    def open(cls, path: Path, built: bool = False) -> RowTable:
        meta = json.loads((path / "rows.json").read_text())
        table = pa.ipc.open_file(pa.memory_map(str(path / "rows.arrow"))).read_all()
        return cls(path, meta, {name: RowColumn(table.column(name).chunks) for name in table.column_names}, built)


class RowWriter:
    """Writes rows into ``rows.arrow`` in record batches, hashing each column and counting tokens as they pass.

    Args:
        path: the (temporary) folder to write into.
        names: the token arrays of every row, e.g. ``("input_ids", "loss_mask")``.
    """

    def __init__(self, path: Path, names: Sequence[str]) -> None:
        self.path, self.names = path, tuple(names)
        self._dtypes = {n: np.dtype(_ARROW_TYPES[kind_of(n)]) for n in self.names}
        self._schema = pa.schema([(n, pa.list_(pa.from_numpy_dtype(self._dtypes[n]))) for n in self.names])
        self._sink = pa.OSFile(str(path / "rows.arrow"), "wb")
        self._file = pa.ipc.new_file(self._sink, self._schema)
        self._pending: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
        self.hashes = {n: ArraysHash() for n in self.names}
        self.rows, self.max_id = 0, -1
        # The ids arrays by name, with their stream: each row counts its tokens per stream.
        self._streams = {n: split_stream(n)[0] for n in self.names if kind_of(n) == ArrayKind.INPUT_IDS}
        self.tokens, self.longest, self.sum_sq = ({s: 0 for s in self._streams.values()} for _ in range(3))

    def add(self, row: dict[str, np.ndarray]) -> None:
        """Append one row: every array of ``names``, 1-D, the same length within a stream."""
        for name in self.names:
            value = row[name]
            self._pending[name].append(value)
            self.hashes[name].update(value)
            if name in self._streams:
                self._count(self._streams[name], value)
        self.rows += 1
        if len(self._pending[self.names[0]]) >= _BATCH_ROWS:
            self._flush()

    def _count(self, stream: str, ids: np.ndarray) -> None:
        n = len(ids)
        self.tokens[stream] += n
        self.longest[stream] = max(self.longest[stream], n)
        self.sum_sq[stream] += n * n
        self.max_id = max(self.max_id, int(ids.max()))

    def _flush(self) -> None:
        if not self._pending[self.names[0]]:
            return
        arrays = []
        for name in self.names:
            parts = self._pending[name]
            offsets = np.zeros(len(parts) + 1, dtype=np.int32)
            np.cumsum([len(p) for p in parts], out=offsets[1:])
            values = pa.array(np.concatenate(parts).astype(self._dtypes[name], copy=False))
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), values))
            parts.clear()
        self._file.write_batch(pa.record_batch(arrays, schema=self._schema))

    def finish(self, key: dict[str, Any], fingerprint: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """Close the file and write ``rows.json`` (last: it marks the folder finished)."""
        self._flush()
        self._file.close()
        self._sink.close()
        meta = {"version": ROWS_VERSION, "key": key, "fingerprint": fingerprint, "num_rows": self.rows,
                "tokens": self.tokens, "longest": self.longest, "sum_sq_lengths": self.sum_sq,
                "max_id": self.max_id, **extra}
        (self.path / "rows.json").write_bytes(canonical_json(meta))
        return meta


# Builds the rows into the writer; returns (data fingerprint without the hashes, extra fields for rows.json).
Build = Callable[[RowWriter], tuple[dict[str, Any], dict[str, Any]]]


ROWS_ENV = "KDCACHE_ROWS"


def rows_root() -> Path:
    """Where every cache's rows live: ``$KDCACHE_ROWS``, else ``$HF_DATASETS_CACHE/kdcache-rows``; a local folder
    (memory maps need a local file), the same for local and object-storage caches. Point ``KDCACHE_ROWS`` at a
    shared filesystem for the ranks of several nodes to build the rows once."""
    if os.environ.get(ROWS_ENV):
        return Path(os.environ[ROWS_ENV]).expanduser()
    return Path(datasets.config.HF_DATASETS_CACHE) / "kdcache-rows"


def row_problems(fingerprint: dict[str, Any], root: Path | None = None) -> list[tuple[str, str]]:
    """``(file, problem)`` for each damaged file of the rows whose table names data ``fingerprint`` (a cache's
    ``fingerprints["data"]``), and for each table too damaged to say whose rows it covers."""
    root = rows_root() if root is None else root
    found: list[tuple[str, str]] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and "." not in p.name) if root.is_dir() else ():
        table, problem = read_local_table(folder)
        if table is None:
            found.append((str(folder / TABLE), problem or "damaged"))
        elif table.get("fingerprint") == fingerprint:
            found += [(str(folder), p) for p in local_folder_problems(folder)]
    return found


def open_or_build(root: Path, key: dict[str, Any], names: Sequence[str], hashes: dict[str, str],
                  build: Build) -> RowTable:
    """The finished rows of ``key`` under ``root``, building them first if no process has.

    Args:
        root: the rows folder (``rows_root``).
        key: everything the rows depend on (data identity, tokenizer, template, row settings); hashed into the
            folder's name, so changing any of it builds new rows beside the old ones.
        names: the token arrays of a row.
        hashes: array name -> the data fingerprint's key for that array's hash (``input_ids_hash``...).
        build: fills a ``RowWriter``; called by one process only, under the lock.
    """
    folder = root / hash_json(key)[7:23]
    created = [p for p in (root.parent, root) if not p.exists()]  # removed again if the build fails
    root.mkdir(parents=True, exist_ok=True)
    lock, building = FileLock(str(folder) + ".lock"), False
    try:
        with lock:  # other ranks and parts wait here while one builds
            damaged = local_folder_problems(folder) if folder.is_dir() else None
            if folder.is_dir() and not damaged:
                return RowTable.open(folder)
            if damaged:  # never used: a flipped byte in the ids would cache the wrong tokens
                print(f"kdcache precompute: note: the rows at {folder} are damaged ({'; '.join(damaged)}); "
                      f"building them again", file=sys.stderr)
            building = True
            _build(folder, key, names, hashes, build)
    except BaseException:
        # Refused data leaves nothing behind: no rows folder, and no cache folder this run created. Only the
        # process that built removes the lock file: a waiting one removing it would let a newcomer lock a new
        # file beside the builder's, and build too.
        if building:
            Path(lock.lock_file).unlink(missing_ok=True)
        for path in reversed(created):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise
    return RowTable.open(folder, built=True)


def _build(folder: Path, key: dict[str, Any], names: Sequence[str], hashes: dict[str, str], build: Build) -> None:
    """Build into ``<folder>.tmp`` and rename it into place (under the caller's lock)."""
    tmp = folder.with_name(folder.name + ".tmp")
    for stale in (tmp, folder):  # an interrupted build of an earlier attempt
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    started = time.perf_counter()
    try:
        writer = RowWriter(tmp, names)
        fingerprint, extra = build(writer)
        fingerprint = {**fingerprint, **{field: writer.hashes[name].hexdigest() for name, field in hashes.items()},
                       "num_sequences": writer.rows}
        writer.finish(key, fingerprint, {**extra, "build_seconds": round(time.perf_counter() - started, 3)})
        seal_local_folder(tmp, {"fingerprint": fingerprint})  # last: the folder's commit point
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, folder)
