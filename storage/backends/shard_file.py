"""Whole-array reads and writes of a format-3 zarr array file, straight from and into numpy arrays.

Every kdcache zarr array is ONE zarr shard (``sharding_indexed``): inner chunks, each ``bytes -> compressor ->
crc32c``, then an index of ``(offset, nbytes)`` uint64 pairs that ends in its own crc32c, at the end of the file
(zarr v3 sharding spec). zarr decodes such a file through its generic pipeline, which copies every inner chunk
twice (into a shard buffer, then into the result) on its one event-loop thread: measured at 0.6-0.7x the speed
of an unsharded read (benchmarks/RESULTS.md). Reading a *whole* array, which is what training does, needs none
of that: this module takes the file's bytes (one read, or one GET from an object store), checks the index's and
every chunk's crc32c exactly as zarr's ``crc32c`` codec does, and decodes each chunk with the same numcodecs codec
directly into its rows of the result.
Anything else (a slice, a layout this code did not write) goes through zarr.

Writing is the mirror image (``write_whole``): zarr writes the array's ``zarr.json``, and this module the data
file, byte for byte what zarr's pipeline would write (a test compares them for every codec and dtype kdcache
uses), but compressing each inner chunk straight from the rows of the input array, without zarr's copies of
every chunk into its buffers and of the buffers into the file.
"""

from __future__ import annotations

from typing import Any

import numcodecs
import numpy as np

from kdcache.storage.core.files import crc32c

_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}

_NO_CHUNK = np.iinfo(np.uint64).max  # offset and nbytes of an inner chunk that was never written


class ShardFileError(ValueError):
    """The bytes of a shard file do not match their crc32c, or its index points outside the file."""


def plain_layout(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The inner chunk rows and compressor of a sharded array as kdcache writes it, or None for any other layout.

    kdcache writes ``[sharding_indexed(chunk_shape, [bytes(little), COMPRESSOR, crc32c], index [bytes, crc32c],
    end)]`` with one shard covering the whole array (a column-major codec's codes with ``numcodecs.shuffle``
    before the compressor: ``"shuffle"`` is then its element size); only that is read here.
    """
    codecs = metadata.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        return None
    config = codecs[0]["configuration"]
    inner = [c.get("name") for c in config["codecs"]]
    shuffle = None  # a column-major codec's codes: [bytes, numcodecs.shuffle(row bytes), COMPRESSOR, crc32c]
    if len(inner) == 4 and inner[1] == "numcodecs.shuffle":
        shuffle = int(config["codecs"][1].get("configuration", {}).get("elementsize") or 0) or None
        if shuffle is None:
            return None
        inner = [inner[0], *inner[2:]]
    index = [c.get("name") for c in config["index_codecs"]]
    grid = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    if (len(inner) != 3 or inner[0] != "bytes" or inner[2] != "crc32c" or index != ["bytes", "crc32c"]
            or config.get("index_location", "end") != "end" or grid[0] < metadata["shape"][0]
            or list(grid[1:]) != list(metadata["shape"][1:])):
        return None
    return {"rows": int(config["chunk_shape"][0]), "compressor": config["codecs"][-2], "shuffle": shuffle}


class ShuffledCodec(numcodecs.abc.Codec):  # type: ignore[misc]
    """Decode-only pair for ``read_whole``: the compressor's bytes, then numcodecs' unshuffle into ``out``."""

    codec_id = "kdcache.shuffled"

    def __init__(self, compressor: numcodecs.abc.Codec, shuffle: numcodecs.abc.Codec) -> None:
        self.compressor, self.shuffle = compressor, shuffle

    def encode(self, buf: object) -> object:
        return self.compressor.encode(self.shuffle.encode(buf))

    def decode(self, buf: object, out: object = None) -> object:
        return self.shuffle.decode(self.compressor.decode(buf), out=out)


def _chunk_index(data: memoryview, count: int) -> np.ndarray:
    """The ``[count, 2]`` (offset, nbytes) table at the end of the file, after checking its crc32c."""
    size = 16 * count
    if len(data) < size + 4:
        raise ShardFileError(f"file of {len(data)} bytes cannot hold an index of {count} chunks")
    table = data[len(data) - size - 4: len(data) - 4]
    if crc32c(table) != int.from_bytes(data[len(data) - 4:], "little"):
        raise ShardFileError("shard index does not match its crc32c")
    return np.frombuffer(table, "<u8").reshape(count, 2)


def read_whole(raw: bytes | memoryview, metadata: dict[str, Any], codec: numcodecs.abc.Codec, rows: int) -> np.ndarray:
    """Decode every row of a one-shard array file.

    Args:
        raw: the bytes of the array's data file (``.../hidden/3/c.0.0``), read in one request.
        metadata: its parsed ``zarr.json``.
        codec: the numcodecs codec of the inner chunks (zarr's native blosc/zstd/gzip write the same frames).
        rows: rows per inner chunk.

    Returns:
        ``[shape]`` array of the metadata's dtype.

    Raises:
        ShardFileError: a crc32c mismatch, or an index pointing outside the file.
    """
    shape, dtype = tuple(metadata["shape"]), np.dtype(metadata["data_type"])
    out = np.empty(shape, dtype)
    count = -(-shape[0] // rows) if shape[0] else 0
    data = memoryview(raw)
    index = _chunk_index(data, count)
    for k, (offset, nbytes) in enumerate(index.tolist()):
        rows_k = out[k * rows: (k + 1) * rows]
        if offset == _NO_CHUNK:  # never written: zarr's fill value
            rows_k[...] = metadata.get("fill_value", 0)
            continue
        if offset + nbytes > len(data) - 16 * count - 4 or nbytes < 4:
            raise ShardFileError(f"inner chunk {k} lies outside the file")
        chunk = data[offset: offset + nbytes - 4]
        if crc32c(chunk) != int.from_bytes(data[offset + nbytes - 4: offset + nbytes], "little"):
            raise ShardFileError(f"inner chunk {k} does not match its crc32c")
        _decode_into(codec, chunk, rows_k, rows)
    return out


def _decode_into(codec: numcodecs.abc.Codec, chunk: memoryview, target: np.ndarray, rows: int) -> None:
    """Decode one inner chunk into ``target`` (its rows of the result; the last chunk may be shorter)."""
    if len(target) == rows:
        codec.decode(chunk, out=target)
        return
    full = np.empty((rows, *target.shape[1:]), target.dtype)  # zarr pads the last inner chunk to full size
    codec.decode(chunk, out=full)
    target[...] = full[: len(target)]


def inner_codec(metadata: dict[str, Any]) -> numcodecs.abc.Codec | None:
    """The numcodecs codec that writes the same inner chunks as a ``plain_layout`` array's zarr codecs (its
    compressor as zarr configured it for the dtype, after the row shuffle if any), or None for a compressor this
    module does not know (zarr then writes the data too)."""
    layout = plain_layout(metadata)
    if layout is None:
        return None
    name, config = layout["compressor"]["name"], dict(layout["compressor"].get("configuration", {}))
    if name == "blosc":
        codec = numcodecs.Blosc.from_config({**config, "shuffle": _SHUFFLES[config["shuffle"]]})
    elif name == "zstd":
        codec = numcodecs.Zstd(level=config.get("level", 0), checksum=bool(config.get("checksum", False)))
    elif name.startswith("numcodecs."):
        codec = numcodecs.get_codec({"id": name.removeprefix("numcodecs."), **config})
    else:
        return None
    shuffle = layout["shuffle"]
    return ShuffledCodec(codec, numcodecs.Shuffle(elementsize=shuffle)) if shuffle else codec


def write_whole(array: np.ndarray, rows: int, codec: numcodecs.abc.Codec, fill_value: object = 0) -> list[bytes]:
    """The data file of a one-shard array: its inner chunks of ``rows`` rows (the last padded with
    ``fill_value`` to full size, as zarr does), each compressed and followed by its crc32c, then the
    ``(offset, nbytes)`` index and the index's crc32c.

    Args:
        array: ``[T, ...]`` little-endian, T >= 1.
        rows: rows per inner chunk.
        codec: from ``inner_codec``.

    Returns:
        the file's bytes as the pieces it is written from (``files.FileData``): joining them into one buffer
        would copy the file (``bytes.join`` holds the GIL throughout: 59 ms per 67 MB) and release that buffer
        later (``munmap``, with the GIL held too).
    """
    count = -(-array.shape[0] // rows)
    pieces: list[bytes] = []
    index = np.zeros((count, 2), "<u8")
    offset = 0
    for k in range(count):
        chunk = array[k * rows: (k + 1) * rows]
        if len(chunk) < rows:
            chunk = np.concatenate([chunk, np.full((rows - len(chunk), *array.shape[1:]), fill_value, array.dtype)])
        encoded = bytes(codec.encode(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)))  # bytes: no copy
        pieces += [encoded, crc32c(encoded).to_bytes(4, "little")]
        index[k] = (offset, len(encoded) + 4)
        offset += len(encoded) + 4
    table = index.tobytes()
    return [*pieces, table, crc32c(table).to_bytes(4, "little")]
