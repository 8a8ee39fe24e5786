"""Arrow backend: ONE Arrow IPC file per shard (``shards/shard-000000.arrow``), one row per sequence.

Every per-sequence array is a ``large_list`` column: ``input_ids`` is ``large_list<int32>``; a 2-D target such as
``hidden/3 [L, d]`` is ``large_list<fixed_size_list<float16, d>>``. An Arrow list is a flat values buffer plus an
offsets buffer, so the bytes on disk are the same token-major layout as the zarr backend. The ``offsets`` and
``attention_offsets`` arrays are not columns: they are the list offsets of ``input_ids`` and of the attention
columns. IPC buffer compression (LZ4 frame or ZSTD) applies to the whole file, so the file uses the activation
codec when the cache has activations, else the top-k codec.

Checksums: crc32 of the whole file (cheap, checked on first open), plus a crc32 per column over its decoded list
offsets and values, so that a corrupt file can be traced to the array it damaged.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from storage.backends.base import Backend, Problem, ShardHandle
from storage.codecs import to_arrow_compression
from storage.manifest import ShardRecord
from storage.spec import CacheSpec
from storage.streams import is_offsets


def file_codec(spec: CacheSpec) -> tuple[str, int | None]:
    """IPC compression of a shard file: the activation codec if any activation is stored, else top-k's."""
    return to_arrow_compression(spec.codec if spec.has_activations or spec.logits != "topk" else spec.topk_codec)


def offsets_source(spec: CacheSpec, offsets_name: str) -> str:
    """The column whose list offsets are the offsets array ``offsets_name`` (offsets are not stored twice)."""
    return next(n for n in spec.sequence_names() if spec.offsets_name(n) == offsets_name)


def _column(flat: np.ndarray, offsets: np.ndarray) -> pa.Array:
    flat_1d = np.ascontiguousarray(flat).reshape(-1)
    # Zero-copy wrap: pa.array() converts float16 element by element, which dominated write time.
    values = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat_1d.size, [None, pa.py_buffer(flat_1d)])
    if flat.ndim == 2:
        values = pa.FixedSizeListArray.from_arrays(values, flat.shape[1])
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def _value_crc(offsets: np.ndarray, flat: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(flat).data, zlib.crc32(np.ascontiguousarray(offsets, np.int64).data))


def _compressed_size(array: pa.Array, codec: pa.Codec) -> int:
    """Bytes the IPC writer stores for ``array``: each buffer compressed (or kept raw if that is smaller),
    plus its 8-byte length prefix. Arrow does not report per-column sizes, so we measure them, with the file's
    own codec and level so the figure matches what lands on disk."""
    total = 0
    for buf in array.buffers():
        if buf is not None and buf.size:
            total += min(codec.compress(buf, asbytes=False).size, buf.size) + 8
    return total


def _split(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [S+1] int64, flat values [rows, *tail])`` of a large_list column."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    inner = column.flatten()
    if pa.types.is_fixed_size_list(inner.type):
        width = inner.type.list_size
        flat = inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    else:
        flat = inner.to_numpy(zero_copy_only=False)
    return offsets, flat


class ArrowShard(ShardHandle):
    """An open Arrow shard; a column is decoded once (only the columns asked for) and cached."""

    def __init__(self, path: Path, record: ShardRecord, spec: CacheSpec) -> None:
        self.path, self.record, self.spec = path, record, spec
        self._columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _decode(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        with pa.memory_map(str(self.path)) as source:
            index = ipc.open_file(source).schema.get_field_index(name)  # reads only the footer
            if index < 0:
                raise KeyError(f"column {name!r} missing from {self.path.name}")
            options = ipc.IpcReadOptions(included_fields=[index])  # decompress only this column
            return _split(ipc.open_file(source, options=options).get_batch(0).column(0))

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if name not in self._columns:
                self._columns[name] = self._decode(name)
            return self._columns[name]

    def check(self) -> list[Problem]:
        crc = zlib.crc32(self.path.read_bytes())
        if crc == self.record.extra["file_crc32"]:
            return []
        return _locate(self) or [("(file)", f"file bytes changed (crc32 {crc:08x}) outside any column's data")]

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        if is_offsets(name):
            return self.column(offsets_source(self.spec, name))[0][slice(start, stop)]
        return self.column(name)[1][slice(start, stop)]


def _locate(handle: ArrowShard) -> list[Problem]:
    """Decode every column afresh and compare its value checksum: names the damaged arrays."""
    problems = []
    for name, info in handle.record.arrays.items():
        if "value_crc32" not in info:
            continue
        try:
            offsets, flat = handle._decode(name)
        except Exception as exc:  # noqa: BLE001 - a decode failure is a finding
            problems.append((name, f"cannot decode: {type(exc).__name__}: {exc}"))
            continue
        if _value_crc(offsets, flat) != info["value_crc32"] or list(flat.shape) != info["shape"]:
            problems.append((name, "decoded values differ from those written (checksum mismatch)"))
    return problems


class ArrowBackend(Backend):
    """One Arrow IPC file per shard."""

    name = "arrow"
    suffix = ".arrow"

    def write(self, path: Path, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        codec, level = file_codec(spec)
        compressor = pa.Codec(codec, level) if level is not None else pa.Codec(codec)
        columns, fields, info = [], [], {}
        for name in spec.sequence_names():
            offsets = arrays[spec.offsets_name(name)]
            column = _column(arrays[name], offsets)
            is_float = spec.is_lossy_kind(name) or name == "logits/topk_values"
            meta = {"kdcache_dtype": spec.dtype} if is_float else None  # tells plain users uint16 means bf16
            columns.append(column)
            fields.append(pa.field(name, column.type, nullable=False, metadata=meta))
            info[name] = {"shape": list(arrays[name].shape), "dtype": arrays[name].dtype.name,
                          "stored_bytes": _compressed_size(column, compressor), "decoded_bytes": int(arrays[name].nbytes),
                          "value_crc32": _value_crc(offsets, arrays[name])}
        header = {"kdcache_format_version": spec.format_version, "shard": index, "dtype": spec.dtype}
        schema = pa.schema(fields, metadata={"kdcache": json.dumps(header)})
        sink = pa.BufferOutputStream()
        options = ipc.IpcWriteOptions(compression=compressor)
        with ipc.new_file(sink, schema, options=options) as writer:
            writer.write_batch(pa.record_batch(columns, schema=schema))
        data = sink.getvalue()
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        for name in spec.offset_arrays():
            if name in arrays:  # implicit in the list offsets: no bytes of their own
                info[name] = {"shape": list(arrays[name].shape), "dtype": "int64", "stored_bytes": 0,
                              "decoded_bytes": int(arrays[name].nbytes), "crc32": 0}
        for entry in info.values():
            entry.setdefault("crc32", entry.get("value_crc32", 0))
        return info, {"file_crc32": zlib.crc32(data), "file_bytes": data.size, "compression": codec}

    def open(self, path: Path, record: ShardRecord, spec: CacheSpec) -> ShardHandle:
        return ArrowShard(path, record, spec)

    def verify(self, path: Path, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        handle = ArrowShard(path, record, spec)
        try:
            crc = zlib.crc32(path.read_bytes())
        except OSError as exc:
            return [("(file)", f"cannot read: {exc}")]
        problems = _locate(handle)  # verify always decodes every column
        if crc != record.extra["file_crc32"] and not problems:
            problems.append(("(file)", f"file bytes changed (crc32 {crc:08x}) outside any column's data"))
        return problems
