"""Zarr v3 backend: one zarr group per shard (``shards/shard-000000/``), one array per name.

``hidden/3`` becomes the array at ``shard-000000/hidden/3`` inside implicit ``hidden`` group, so plain
``zarr.open_group(shard)["hidden/3"]`` works. Chunks run along the token (row) axis only, so reading one
sequence decodes a few chunks, and a row never straddles two chunks.
"""

from __future__ import annotations

import os
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from storage.backends.base import Backend, Problem, ShardHandle
from storage.codecs import to_zarr_compressors
from storage.manifest import ShardRecord, fsync_path
from storage.spec import CacheSpec
from storage.streams import split_stream

CHUNK_BYTES = 1 << 20  # decoded bytes per chunk: blosc splits it into blocks anyway; small keeps random reads cheap
_DIMENSIONS = {"input_ids": ("token",), "offsets": ("sequence_edge",), "attention_offsets": ("sequence_edge",),
               "logits/lse": ("token",), "hidden": ("token", "feature"), "attention": ("query_key", "head"),
               "logits": ("token", "rank"), "cross_attention": ("query_key", "head"),
               "cross_attention_offsets": ("sequence_edge",)}


def _zarr():
    import zarr

    return zarr


def chunk_rows(array: np.ndarray) -> int:
    """Rows per chunk so that one chunk holds about ``CHUNK_BYTES`` decoded bytes."""
    row_bytes = max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    return int(max(1, min(max(array.shape[0], 1), CHUNK_BYTES // row_bytes)))


def _dimension_names(name: str) -> tuple[str, ...]:
    name = split_stream(name)[1]  # encoder/hidden/3 has the dimensions of hidden/3
    names = _DIMENSIONS.get(name) or _DIMENSIONS[name.split("/")[0]]
    return ("token", "vocab") if name == "logits/full" else names


def array_files(shard: Path, name: str) -> list[Path]:
    """Every file of array ``name`` (its zarr.json and c/... chunks), sorted by relative path.

    Arrays never nest inside each other, so everything under the array's directory is its own.
    """
    base = shard / name
    return sorted((p for p in base.rglob("*") if p.is_file()), key=lambda p: p.as_posix())


def array_crc(shard: Path, name: str) -> tuple[int, int]:
    """``(crc32, stored bytes)`` over the array's files: relative path then contents, in sorted order."""
    crc, size = 0, 0
    for path in array_files(shard, name):
        data = path.read_bytes()
        crc = zlib.crc32(data, zlib.crc32(path.relative_to(shard).as_posix().encode(), crc))
        size += len(data)
    return crc, size


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory, of a shard (in threads: fsync releases the GIL, and the
    device can overlap many small flushes)."""
    files, dirs = [], []
    for dirpath, _, names in os.walk(root):
        dirs.append(dirpath)
        files.extend(os.path.join(dirpath, name) for name in names)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fsync_path, files))
        list(pool.map(fsync_path, dirs))


class ZarrShard(ShardHandle):
    """An open zarr shard; arrays are opened lazily and cached."""

    def __init__(self, path: Path, record: ShardRecord) -> None:
        self.path, self.record = path, record
        self._arrays: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _array(self, name: str) -> Any:
        with self._lock:
            if name not in self._arrays:
                with warnings.catch_warnings():  # numcodecs-in-zarr3 codecs warn again on open
                    warnings.simplefilter("ignore")
                    self._arrays[name] = _zarr().open_array(str(self.path / name), mode="r")
            return self._arrays[name]

    def check(self) -> list[Problem]:
        problems = []
        for name, info in self.record.arrays.items():
            crc, _ = array_crc(self.path, name)
            if crc != info["crc32"]:
                problems.append((name, f"stored bytes changed (crc32 {crc:08x}, recorded {info['crc32']:08x})"))
        return problems

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        return np.asarray(self._array(name)[slice(start, stop)])


class ZarrBackend(Backend):
    """Zarr v3 directory per shard."""

    name = "zarr"
    suffix = ""

    def write(self, path: Path, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        zarr = _zarr()
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        group.attrs.update({"kdcache_format_version": spec.format_version, "shard": index,
                            "dtype": spec.dtype, "array_names": list(arrays)})
        info: dict[str, dict[str, Any]] = {}
        with warnings.catch_warnings():  # numcodecs-in-zarr3 codecs warn on every use; the choice is deliberate
            warnings.simplefilter("ignore")
            for name, array in arrays.items():
                zarr.create_array(str(path), name=name, data=array, chunks=(chunk_rows(array), *array.shape[1:]),
                                  compressors=to_zarr_compressors(spec.codec_for(name)), filters=None,
                                  dimension_names=_dimension_names(name), zarr_format=3)
        _fsync_tree(path)
        for name, array in arrays.items():
            crc, stored = array_crc(path, name)
            info[name] = {"shape": list(array.shape), "dtype": array.dtype.name, "stored_bytes": stored,
                          "decoded_bytes": int(array.nbytes), "crc32": crc}
        return info, {}

    def open(self, path: Path, record: ShardRecord, spec: CacheSpec) -> ShardHandle:
        return ZarrShard(path, record)

    def verify(self, path: Path, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        handle = ZarrShard(path, record)
        problems = handle.check()
        for name, info in record.arrays.items():
            try:
                decoded = handle.read(name)  # decodes every chunk
            except Exception as exc:  # noqa: BLE001 - any decode failure is a finding, not a crash
                problems.append((name, f"cannot decode: {type(exc).__name__}: {exc}"))
                continue
            if list(decoded.shape) != info["shape"] or decoded.dtype.name != info["dtype"]:
                problems.append((name, f"decodes as {decoded.dtype} {list(decoded.shape)}, "
                                       f"recorded {info['dtype']} {info['shape']}"))
        return problems
