"""Zarr v3 backend: one zarr group per shard (``shards/shard-000000/``), one sharded array per name.

``hidden/3`` is the array at ``shard-000000/hidden/3`` inside the implicit ``hidden`` group, so plain
``zarr.open_group(shard)["hidden/3"]`` works. Each array is ONE zarr shard (the v3 ``sharding_indexed`` codec)
in one file, ``hidden/3/c.0.0``: inner chunks of about ``CHUNK_BYTES`` decoded bytes along the token axis, so a
sequence decodes a few inner chunks, and every inner chunk, like the shard index, ends in a crc32c that zarr
checks on every decode. The ``zarr.json`` files are covered by the shard record's file table, checked when an
array is opened. Whole-array reads (training's) decode through ``shard_file``, which checks the same crc32c
without zarr's two copies per chunk; slices go through zarr.
"""

from __future__ import annotations

import atexit
import json
import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numcodecs
import numpy as np
import zarr
import zarr.abc.codec
import zarr.codecs
import zarr.codecs.numcodecs as zn
from zarr.core import sync as zarr_sync

from kdcache.storage.backends.base import (
    Backend,
    PackedShard,
    ShardHandle,
    check_file,
    verify_file_table,
)
from kdcache.storage.backends.shard_file import (
    ShardFileError,
    ShuffledCodec,
    inner_codec,
    plain_layout,
    read_whole,
    write_whole,
)
from kdcache.storage.core.codecs import DEFAULT_CODEC, DEFAULT_TOPK_CODEC, SHUFFLE_NAMES
from kdcache.storage.core.errors import UnknownCodecError
from kdcache.storage.core.files import crc32c, file_size
from kdcache.storage.core.formats import CacheFormat, Problem, zarr_problems
from kdcache.storage.core.store_base import Store
from kdcache.storage.core.streams import split_stream
from kdcache.storage.hidden_codecs import CODED_KINDS
from kdcache.storage.schema.manifest import ShardRecord, shard_name
from kdcache.storage.schema.spec import CacheSpec

# zarr loads with this module, which the backend registry imports only when a cache names the zarr backend
# (``storage.core.backend_registry``): importing storage, and reading an Arrow cache, stay without it.
STOP_SECONDS = 30.0  # longer than any IO zarr has in flight at exit; the thread is a daemon, so exit is not blocked


def stop_zarr_io(timeout: float = STOP_SECONDS) -> None:
    """Stop zarr's IO event loop and wait for its thread; nothing when zarr never started one.

    zarr's own exit handler stops the loop, waits only 0.2 s for its thread, then closes the loop: on a loaded
    machine the thread has not stopped yet, and ``RuntimeError: Cannot close a running event loop`` is printed
    after a run that succeeded. Exit handlers run last-registered first, so this one, registered after zarr's (on
    import), has stopped the loop before zarr's closes it.
    """
    loop, thread = zarr_sync.loop[0], zarr_sync.iothread[0]
    if loop is None or thread is None or not thread.is_alive() or loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)


atexit.register(stop_zarr_io)

CHUNK_BYTES = 4 << 20  # decoded bytes per inner chunk: a sequence decodes one or two; bigger ones barely read faster
# c.0.0 beside zarr.json: no c/0/ folders
CHUNK_KEYS: dict[str, Any] = {"name": "default", "configuration": {"separator": "."}}
_DIMENSIONS = {"input_ids": ("token",), "loss_mask": ("token",), "position_ids": ("token",),
               "offsets": ("sequence_edge",), "attention_offsets": ("sequence_edge",),
               "hidden": ("token", "feature"), "attention": ("query_key", "head"),
               "cross_attention": ("query_key", "head"),
               "cross_attention_offsets": ("sequence_edge",), "attention_q": ("token", "head_feature"),
               "attention_k": ("token", "head_feature"), "attention_v": ("token", "head_feature"),
               **{f"{kind}_{part}": ("token", dim) for kind in CODED_KINDS
                  for part, dim in (("scale", "group"), ("outliers", "outlier"), ("outlier_ids", "outlier"))}}


def chunk_rows(array: np.ndarray) -> int:
    """Rows per inner chunk so that one chunk holds about ``CHUNK_BYTES`` decoded bytes."""
    row_bytes = max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    return int(max(1, min(max(array.shape[0], 1), CHUNK_BYTES // row_bytes)))


def _dimension_names(spec: CacheSpec, name: str) -> tuple[str, ...]:
    """zarr's ``dimension_names`` of an array: a logit array's from its layout record ([T], [T, V] or [T, k]
    ranks), any other's from its kind (encoder/hidden/3 has the dimensions of hidden/3)."""
    array = spec.array(name).logit
    if array is not None:
        return ("token",) if array.width is None else ("token", "vocab" if array.width == "vocab_size" else "rank")
    name = split_stream(name)[1]
    return _DIMENSIONS.get(name) or _DIMENSIONS[name.split("/")[0]]


def _create_array(store: zarr.storage.MemoryStore, name: str, array: np.ndarray,
                  spec: CacheSpec) -> list[bytes] | None:
    """One array as a single zarr shard whose inner chunks carry a crc32c each: zarr writes its ``zarr.json``, and
    ``shard_file.write_whole`` its data file, returned (zarr writes that too for a layout or codec it does not
    know, or an empty array, and None is returned)."""
    rows = chunk_rows(array)
    shard_rows = -(-max(array.shape[0], 1) // rows) * rows  # a whole number of inner chunks covering the array
    compressors = [*_row_shuffle(spec, name, array), *to_zarr_compressors(spec.codec_for(name)),
                   zarr.codecs.Crc32cCodec()]
    with warnings.catch_warnings():  # numcodecs-in-zarr3 codecs warn on every use; the choice is deliberate
        warnings.simplefilter("ignore")
        created = zarr.create_array(store, name=name, shape=array.shape, dtype=array.dtype,
                                    shards=(shard_rows, *array.shape[1:]), chunks=(rows, *array.shape[1:]),
                                    compressors=compressors, filters=None, chunk_key_encoding=CHUNK_KEYS,
                                    dimension_names=_dimension_names(spec, name), zarr_format=3,
                                    # skips an all-equal scan of every chunk; the ignore: mypy reads zarr's TypedDict
                                    # (ArrayConfigParams) with every key required, though zarr marks them NotRequired
                                    config={"write_empty_chunks": True})  # type: ignore[arg-type]
        metadata = created.metadata.to_dict()
        codec = inner_codec(metadata) if array.size else None
        if codec is None:
            created[...] = array
            return None
    return write_whole(array, rows, codec, metadata.get("fill_value", 0))


def to_zarr_compressors(config: dict[str, Any]) -> list[Any]:
    """zarr v3 bytes-to-bytes codecs for a numcodecs config (a one-element list).

    Raises:
        UnknownCodecError: the codec is not a compressor (e.g. ``delta`` or ``bitround`` transform arrays).
    """
    name, params = config["id"], {k: v for k, v in config.items() if k != "id"}
    if name == "blosc":
        shuffle = SHUFFLE_NAMES.get(params.get("shuffle", -1))  # None lets zarr pick from the dtype
        return [zarr.codecs.BloscCodec(cname=params["cname"], clevel=params["clevel"], shuffle=shuffle,
                                       blocksize=params.get("blocksize", 0))]
    if name == "zstd":
        return [zarr.codecs.ZstdCodec(level=params.get("level", 0), checksum=bool(params.get("checksum", False)))]
    if name == "gzip":
        return [zarr.codecs.GzipCodec(level=params.get("level", 5))]
    cls = next((c for c in vars(zn).values() if getattr(c, "codec_name", None) == f"numcodecs.{name}"), None)
    if cls is None or not issubclass(cls, zarr.abc.codec.BytesBytesCodec):
        raise UnknownCodecError(f"codec {name!r} cannot compress zarr chunks; expected a bytes-to-bytes codec "
                                f"such as blosc, zstd, lz4, zlib, gzip, bz2 or lzma")
    with warnings.catch_warnings():  # "numcodecs codecs are not in the zarr v3 spec": chosen knowingly
        warnings.simplefilter("ignore")
        return [cls(**params)]


def _row_shuffle(spec: CacheSpec, name: str, array: np.ndarray) -> list[Any]:
    """A column-major codec's codes ``[T, d]``: numcodecs' byte shuffle with one row as its element, so that the
    compressor sees the codes direction by direction (column 0 of every row, then column 1, ...); else none."""
    if not (spec.coded(name) and spec.hidden_codec.column_major):
        return []
    with warnings.catch_warnings():  # "numcodecs codecs are not in the zarr v3 spec": chosen knowingly
        warnings.simplefilter("ignore")
        return [zn.Shuffle(elementsize=max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))))]


class ZarrShard(ShardHandle):
    """An open zarr shard; an array's metadata is checked on first use, and whole-array reads skip zarr's copies.

    Slices of a local shard go through zarr; an object store's shard is read whole (one GET per array) and sliced
    in memory, since training reads whole shards anyway.
    """

    def __init__(self, store: Store, record: ShardRecord, spec: CacheSpec, cache_format: CacheFormat) -> None:
        super().__init__(store, record, spec, cache_format)  # formats 1-2: per-array crc32s, checked when opened
        self._arrays: dict[str, zarr.Array[Any]] = {}
        self._decoded: dict[str, np.ndarray] = {}  # object stores only: whole arrays that slices were cut from
        self._metadata: dict[str, dict[str, Any]] = {}
        self._fetched: dict[str, bytes] = {}  # an object store's files, fetched together by prefetch()

    def _files(self, name: str) -> list[str]:
        """Keys (from the cache root) of an array's files: its zarr.json and its data file."""
        base = self.key.rsplit("/", 1)[0]
        return [f"{base}/{path}" for path in self.record.arrays[name]["files"]]

    def prefetch(self, names: list[str]) -> None:
        """Fetch the files of ``names`` from an object store in one round of concurrent requests."""
        if self.store.is_local or not self.file_table:
            return
        keys = [k for name in names for k in self._files(name) if k not in self._fetched]
        if keys:
            fetched = self.store.read_many(keys)
            with self._lock:
                self._fetched.update(fetched)

    def _read_file(self, key: str, read: Callable[[str], bytes | memoryview] | None = None) -> bytes | memoryview:
        """A file's bytes: fetched ahead from an object store, else ``read(key)`` now (``Store.read``; a data file
        decoded at once passes ``Store.read_transient``, the thread's reused buffer in a folder)."""
        with self._lock:
            data = self._fetched.pop(key, None)  # used once: the decoded array is what stays
        return (read or self.store.read)(key) if data is None else data

    def metadata(self, name: str) -> dict[str, Any]:
        """An array's ``zarr.json``, checked against the crc32c recorded when it was written."""
        with self._lock:
            cached = self._metadata.get(name)
        if cached is None:
            table, base = self.record.extra["files"], self.key.rsplit("/", 1)[-1]
            try:
                raw = self._read_file(f"{self.key}/{name}/zarr.json")
            except FileNotFoundError:
                raise self.fail(name, "its zarr.json is missing") from None
            if crc32c(raw) != table[f"{base}/{name}/zarr.json"][1]:
                raise self.fail(name, "zarr.json does not match the crc32c recorded when it was written")
            cached = json.loads(bytes(raw))  # bytes already: no copy
            with self._lock:
                self._metadata[name] = cached
        return cached

    def _array(self, name: str) -> zarr.Array[Any]:
        with self._lock:
            if name in self._arrays:
                return self._arrays[name]
        if self.file_table:
            self.metadata(name)
            for path in self.record.arrays[name]["files"]:  # zarr reads a missing chunk as zeros: refuse that
                message = check_file(self.store, path, *self.record.extra["files"][path], read=False)
                if message:
                    raise self.fail(name, message)
        with self._lock:
            if name not in self._arrays:
                with warnings.catch_warnings():  # numcodecs-in-zarr3 codecs warn again on open
                    warnings.simplefilter("ignore")
                    self._arrays[name] = zarr.open_array(str(self.store.local_path(f"{self.key}/{name}")),
                                                            mode="r")
            return self._arrays[name]

    def _read_whole(self, name: str) -> np.ndarray | None:
        """The whole array through ``shard_file`` (None when the layout is not the one kdcache writes)."""
        layout = plain_layout(self.metadata(name))
        data = [p for p in self.record.arrays[name]["files"] if not p.endswith("zarr.json")]
        if layout is None or len(data) != 1:
            return None
        codec = numcodecs.get_codec(self.spec.codec_for(name))
        if layout["shuffle"]:  # a column-major codec's codes: unshuffled after the compressor
            codec = ShuffledCodec(codec, numcodecs.Shuffle(elementsize=layout["shuffle"]))
        size = self.record.extra["files"][data[0]][0]
        try:
            raw = self._read_file(f"{self.key.rsplit('/', 1)[0]}/{data[0]}", self.store.read_transient)
            if len(raw) != size:
                raise ShardFileError(f"file {data[0]} has {len(raw)} bytes, {size} were written")
            return read_whole(raw, self.metadata(name), codec, layout["rows"])
        except FileNotFoundError:
            raise self.fail(name, f"file {data[0]} is missing") from None
        except ShardFileError as exc:
            raise self.fail(name, f"stored bytes do not decode ({exc})") from None

    def check(self) -> list[Problem]:
        return [] if self.file_table else zarr_problems(self.store, self.key, self.record.arrays)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        whole_read = start is None and stop is None
        remote = self.store.local_path(self.key) is None
        if self.file_table and (whole_read or remote):
            with self._lock:
                whole = self._decoded.get(name)
            whole = self._read_whole(name) if whole is None else whole
            if whole is not None:
                if remote and not whole_read:
                    with self._lock:
                        self._decoded[name] = whole
                return whole[slice(start, stop)]
        array = self._array(name)
        try:
            return np.asarray(array[slice(start, stop)])
        except (ValueError, RuntimeError) as exc:  # zarr's crc32c mismatch is a ValueError, blosc's a RuntimeError
            raise self.fail(name, f"stored bytes do not decode ({exc})") from None


class ZarrBackend(Backend):
    """Zarr v3 directory per shard, one sharded array file per name."""

    name = "zarr"
    handle = ZarrShard
    suffix = ""
    default_codecs = DEFAULT_CODEC, DEFAULT_TOPK_CODEC  # blosc with bitshuffle: lz4 for activations, zstd for top-k

    check_codec = staticmethod(to_zarr_compressors)

    def pack(self, arrays: dict[str, np.ndarray], spec: CacheSpec, index: int) -> PackedShard:
        contents: dict[str, Any] = {}
        store = zarr.storage.MemoryStore(contents)
        group = zarr.open_group(store, mode="w", zarr_format=3,
                                attributes={"kdcache_format_version": spec.format_version, "shard": index,
                                            "dtype": spec.dtype, "array_names": list(arrays)})
        for parent in sorted({name.rpartition("/")[0] for name in arrays} - {""}):
            group.require_group(parent)  # implicit groups first: concurrent arrays would race to create them
        # Arrays compress concurrently: blosc and crc32c release the GIL.
        with ThreadPoolExecutor(max(1, min(len(arrays), os.cpu_count() or 1))) as pool:
            data = dict(zip(arrays, pool.map(lambda name: _create_array(store, name, arrays[name], spec), arrays)))
        base = shard_name(index)
        files: dict[str, Any] = {f"{base}/{key}": buffer.as_numpy_array() for key, buffer in contents.items()}
        for name, raw in data.items():
            if raw is not None:
                files[f"{base}/{name}/c.{'.'.join('0' * arrays[name].ndim)}"] = raw
        info = {}
        for name, array in arrays.items():
            own = sorted(path for path in files if path.startswith(f"{base}/{name}/"))
            info[name] = {"shape": list(array.shape), "dtype": array.dtype.name, "files": own,
                          "stored_bytes": sum(file_size(files[path]) for path in own),
                          "decoded_bytes": int(array.nbytes)}
        return PackedShard(files, info)

    def verify(self, store: Store, record: ShardRecord, spec: CacheSpec) -> list[Problem]:
        if self.format.file_table:
            return verify_file_table(store, record)
        handle = self.open(store, record, spec)
        problems = handle.check()
        for name, info in record.arrays.items():
            try:
                decoded = handle.read(name)  # format 1-2: decode every chunk as well
            except Exception as exc:  # noqa: BLE001 - any decode failure is a finding, not a crash
                problems.append((name, f"cannot decode: {type(exc).__name__}: {exc}"))
                continue
            if list(decoded.shape) != info["shape"] or decoded.dtype.name != info["dtype"]:
                problems.append((name, f"decodes as {decoded.dtype} {list(decoded.shape)}, "
                                       f"recorded {info['dtype']} {info['shape']}"))
        return problems
