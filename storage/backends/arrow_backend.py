"""Arrow backend: ONE Arrow IPC stream per shard (``shards/shard-000000.arrow``), one row per sequence.

Every per-sequence array is a ``large_list`` column: ``input_ids`` is ``large_list<int32>``; a 2-D target such as
``hidden/3 [L, d]`` is ``large_list<fixed_size_list<float16, d>>``. An Arrow list is a flat values buffer plus an
offsets buffer, so the bytes on disk are the same token-major layout as the zarr backend. The ``offsets`` and
``attention_offsets`` arrays are not columns: they are the list offsets of ``input_ids`` and of the attention
columns. IPC buffer compression (LZ4 frame or ZSTD) applies to the whole file, so the file uses the activation
codec when the cache has activations, else the top-k codec.

Format 3 writes the IPC *stream* format, which Hugging Face ``datasets.Dataset.from_file`` opens directly (format
1-2 wrote the IPC *file* format; both are read). Arrow IPC has no checksums of its own, so kdcache records, from
the bytes in memory at write time: a crc32c of the header (schema and record-batch metadata, checked when the
shard is opened), a crc32c per column over its decoded offsets and values (checked whenever the column is
decoded, so reading one column never reads another), and the file's size and crc32c (checked by ``verify``).
"""

from __future__ import annotations

import json
import struct
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from kdcache.storage.backends.base import Backend, PackedShard, ShardHandle, verify_file_table
from kdcache.storage.core.codecs import ARROW_DEFAULT_CODEC, to_arrow_compression
from kdcache.storage.core.files import crc32c
from kdcache.storage.core.formats import CacheFormat, Problem, arrow_file_problem, value_crc32
from kdcache.storage.core.store_base import Store
from kdcache.storage.core.streams import is_offsets
from kdcache.storage.schema.manifest import ShardRecord, shard_name
from kdcache.storage.schema.spec import CacheSpec

IpcReader: TypeAlias = "ipc.RecordBatchFileReader | ipc.RecordBatchStreamReader"  # format 1-2 files, 3+ streams


def file_codec(spec: CacheSpec) -> tuple[str, int | None]:
    """IPC compression of a shard file: the activation codec if any activation is stored, else the one its logit
    layout names (``LogitLayout.file_sparse``: top-k's)."""
    sparse = spec.logit_layout is not None and spec.logit_layout.file_sparse
    activations, top_k = spec.codec_configs
    has_activations = any(spec.is_lossy_kind(n) for n in spec.sequence_names())
    return to_arrow_compression(top_k if sparse and not has_activations else activations)


def _column(flat: np.ndarray, offsets: np.ndarray) -> pa.Array:
    flat_1d = np.ascontiguousarray(flat).reshape(-1)
    # Zero-copy wrap: pa.array() converts float16 element by element, which dominated write time.
    values = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat_1d.size, [None, pa.py_buffer(flat_1d)])
    if flat.ndim == 2:
        values = pa.FixedSizeListArray.from_arrays(values, flat.shape[1])
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def column_crc(offsets: np.ndarray, flat: np.ndarray) -> int:
    """crc32c over a column's int64 list offsets (rebased to 0), then its token-major values."""
    return crc32c(flat, crc32c(np.ascontiguousarray(offsets, np.int64)))


def _table_field(data: bytes, table: int, slot: int) -> int | None:
    """Absolute position of field ``slot`` of the flatbuffer table at ``table`` (None when absent)."""
    vtable = table - struct.unpack_from("<i", data, table)[0]
    if 4 + 2 * slot >= struct.unpack_from("<H", data, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", data, vtable + 4 + 2 * slot)[0]
    return table + offset if offset else None


def _present(position: int | None) -> int:
    if position is None:  # pyarrow always writes these fields; a stream without them is not one of ours
        raise ValueError("Arrow IPC message without a record batch header")
    return position


def _ref(data: bytes, position: int) -> int:
    offset: int = struct.unpack_from("<I", data, position)[0]
    return position + offset


def message_layout(stream: pa.Buffer | bytes) -> tuple[int, list[tuple[int, int]]]:
    """``(header length, [(offset in body, length)] per body buffer)`` of an IPC stream with one record batch.

    pyarrow reports no per-column stored sizes, so the record batch's flatbuffer metadata (Message.header ->
    RecordBatch.buffers, per the Arrow IPC spec) is read for them: each compressed buffer's length is what it
    costs on disk. The header (schema message + record-batch metadata) precedes the body.
    """
    schema_end = 8 + struct.unpack_from("<i", stream, 4)[0]
    meta_len = struct.unpack_from("<i", stream, schema_end + 4)[0]
    meta = bytes(stream[schema_end + 8: schema_end + 8 + meta_len])
    batch = _ref(meta, _present(_table_field(meta, _ref(meta, 0), 2)))  # Message.header: the RecordBatch table
    buffers = _ref(meta, _present(_table_field(meta, batch, 2)))  # RecordBatch.buffers: [Buffer{offset, length}]
    count = struct.unpack_from("<I", meta, buffers)[0]
    spans = [struct.unpack_from("<qq", meta, buffers + 4 + 16 * i) for i in range(count)]
    return schema_end + 8 + meta_len, spans


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


def _open(source: pa.NativeFile, options: ipc.IpcReadOptions | None = None) -> IpcReader:
    """A reader of either IPC flavour: the stream (format 3) or the file with its footer (format 1-2)."""
    if source.read(6) == b"ARROW1":
        source.seek(0)
        return ipc.open_file(source, options=options)
    source.seek(0)
    return ipc.open_stream(source, options=options)


class ArrowShard(ShardHandle):
    """An open Arrow shard; a column is decoded once (only the columns asked for), checked, and cached.

    A local file is memory-mapped, so decoding one column touches only its pages; a shard in an object store is
    fetched whole, once, and decoded from memory.
    """

    def __init__(self, store: Store, record: ShardRecord, spec: CacheSpec, cache_format: CacheFormat) -> None:
        super().__init__(store, record, spec, cache_format)  # formats 1-2: a crc32 per column and one per file
        self._columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._remote: pa.Buffer | None = None
        self._fields: dict[str, int] | None = None  # column positions, from the header parsed once

    def _source(self) -> pa.NativeFile:
        local = self.store.local_path(self.key)
        if local is not None:
            return pa.memory_map(str(local))
        with self._lock:  # one GET for the whole shard, whichever column asks first
            if self._remote is None:
                self._remote = pa.py_buffer(self.store.read(self.key))
        return pa.BufferReader(self._remote)

    def decode(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Decompress one column only (the others' pages are never touched): ``(offsets, flat values)``."""
        with self._source() as source:
            if self._fields is None:
                self._fields = {n: i for i, n in enumerate(_open(source).schema.names)}  # the header only
                source.seek(0)
            if name not in self._fields:
                raise KeyError(f"column {name!r} missing from {self.key}")
            options = ipc.IpcReadOptions(included_fields=[self._fields[name]])
            reader = _open(source, options)
            batch = reader.get_batch(0) if isinstance(reader, ipc.RecordBatchFileReader) else reader.read_next_batch()
            return _split(batch.column(0))

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            cached = self._columns.get(name)
        if cached is not None:
            return cached
        # Decoding runs outside the lock, so the reader's pool decompresses a shard's columns in parallel.
        try:
            offsets, flat = self.decode(name)
        except (pa.ArrowException, OSError, ValueError, KeyError) as exc:  # damaged bytes, not a bug
            raise self.fail(name, f"cannot decode: {exc}") from None
        if self.file_table and column_crc(offsets, flat) != self.record.arrays[name]["crc32c"]:
            raise self.fail(name, "decoded values differ from those written (crc32c mismatch)")
        with self._lock:
            self._columns[name] = offsets, flat
        return offsets, flat

    def check(self) -> list[Problem]:
        if not self.file_table:
            problem = arrow_file_problem(self.store, self.key, self.record.extra["file_crc32"])
            return [] if problem is None else (locate(self) or [problem])
        try:
            header = self.store.read(self.key, 0, self.record.extra["header_bytes"])
        except OSError as exc:
            return [("(file)", f"cannot read: {exc}")]
        if crc32c(header) != self.record.extra["header_crc32c"]:
            return [("(file)", "the schema or record-batch header does not match its crc32c")]
        return []

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        if is_offsets(name):  # offsets are not stored twice: the list offsets of a column they locate
            source = next(n for n in self.spec.sequence_names() if self.spec.offsets_name(n) == name)
            return self.column(source)[0][slice(start, stop)]
        return self.column(name)[1][slice(start, stop)]


def locate(handle: ArrowShard) -> list[Problem]:
    """Decode every column afresh and compare its checksum: names the damaged arrays of a damaged file."""
    problems = []
    table = handle.file_table  # else formats 1-2's crc32 over the same offsets and values
    for name, info in handle.record.arrays.items():
        if is_offsets(name):
            continue
        try:
            offsets, flat = handle.decode(name)
        except Exception as exc:  # noqa: BLE001 - a decode failure is a finding
            problems.append((name, f"cannot decode: {type(exc).__name__}: {exc}"))
            continue
        crc = column_crc(offsets, flat) if table else value_crc32(offsets, flat)
        if crc != info["crc32c" if table else "value_crc32"] or list(flat.shape) != info["shape"]:
            problems.append((name, "decoded values differ from those written (checksum mismatch)"))
    return problems


class ArrowBackend(Backend):
    """One Arrow IPC stream per shard."""

    name = "arrow"
    handle = ArrowShard
    suffix = ".arrow"
    codec_per_array = False
    reads_row_ranges = False  # ArrowShard.column decodes a whole column, kept by the open handle
    # Arrow IPC has no bitshuffle and one codec per file, and its plain LZ4 barely shrinks fp16 activations (ratio
    # ~1.01, measured in benchmarks/RESULTS.md), so Arrow defaults to zstd, which reaches ~1.12.
    default_codecs = ARROW_DEFAULT_CODEC, ARROW_DEFAULT_CODEC

    check_codec = staticmethod(to_arrow_compression)

    def pack(self, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> PackedShard:
        codec, level = file_codec(spec)
        columns, fields, info = [], [], {}
        path = f"{shard_name(index)}{self.suffix}"
        for array in spec.arrays():
            name, logits = array.name, array.logit
            offsets = arrays[array.offsets]
            columns.append(_column(arrays[name], offsets))
            # the float dtype of activations and of sorted top-k logits (not of other float logit arrays)
            is_float = array.lossy or (logits is not None and logits.descending)
            # tells plain users uint16 means bf16 (a bf16 hidden codec's, whatever spec.dtype); codes name their codec
            meta = {"kdcache_dtype": spec.float_dtype(name)} if is_float and not array.coded else None
            if array.coded:
                meta = {"kdcache_hidden_codec": spec.hidden_codec.name}
            if logits is not None and logits.logprob:  # and that these are gaps of -log-prob / step
                meta = {"kdcache_logprob_step": str(spec.logprob_step)}
            fields.append(pa.field(name, columns[-1].type, nullable=False, metadata=meta))
            info[name] = {"shape": list(arrays[name].shape), "dtype": arrays[name].dtype.name, "files": [path],
                          "decoded_bytes": int(arrays[name].nbytes), "crc32c": column_crc(offsets, arrays[name])}
        header = {"kdcache_format_version": spec.format_version, "shard": index, "dtype": spec.dtype}
        schema = pa.schema(fields, metadata={"kdcache": json.dumps(header)})
        sink = pa.BufferOutputStream()
        options = ipc.IpcWriteOptions(compression=pa.Codec(codec, level) if level is not None else codec)
        with ipc.new_stream(sink, schema, options=options) as writer:
            writer.write_batch(pa.record_batch(columns, schema=schema))
        data = sink.getvalue()
        header_bytes, spans = message_layout(data)
        lengths = [length for _, length in spans]
        counts = [len(column.buffers()) for column in columns]  # IPC writes buffers in schema order, depth first
        assert sum(counts) == len(lengths), (counts, len(lengths))
        edges = np.cumsum([0, *counts])
        for name, begin, end in zip(spec.sequence_names(), edges[:-1], edges[1:]):
            info[name]["stored_bytes"] = int(sum(lengths[begin:end]))
        for name in spec.offset_arrays():  # implicit in the list offsets: no bytes of their own
            info[name] = {"shape": list(arrays[name].shape), "dtype": "int64", "stored_bytes": 0, "files": [],
                          "decoded_bytes": int(arrays[name].nbytes)}
        extra = {"header_bytes": header_bytes, "header_crc32c": crc32c(data[:header_bytes]), "compression": codec}
        return PackedShard({path: data}, info, extra)

    def verify(self, store: Store, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        handle = ArrowShard(store, record, spec, self.format)
        if not self.format.file_table:
            problem = arrow_file_problem(store, record.path, record.extra["file_crc32"])
            problems = locate(handle)  # format 1-2 verify always decoded every column
            return problems + [problem] if problem is not None and not problems else problems
        problems = verify_file_table(store, record)
        return problems + (handle.check() + locate(handle) if problems else [])  # name what a decode shows
