"""The direct writer of zarr array files (``shard_file.write_whole``) against zarr's own pipeline: the same bytes
for every compressor kdcache offers, every dtype it stores, a last inner chunk that is short, and the row shuffle
of column-major codes; and what zarr reads back from them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import zarr
import zarr.codecs.numcodecs as zn

from kdcache.storage.backends.shard_file import inner_codec, write_whole
from kdcache.storage.backends.zarr_backend import CHUNK_KEYS, to_zarr_compressors
from kdcache.storage.core.codecs import DEFAULT_CODEC, DEFAULT_TOPK_CODEC

RNG = np.random.default_rng(0)
ARRAYS = {
    "fp16 rows": RNG.standard_normal((3000, 96)).astype(np.float16),
    "uint16 ids": RNG.integers(0, 60000, (2500, 7)).astype(np.uint16),
    "int8 codes": RNG.integers(-100, 100, (5000, 33)).astype(np.int8),
    "float32 lse": RNG.standard_normal(777).astype(np.float32),
    "int64 offsets": np.arange(1001, dtype=np.int64),
    "one row": RNG.standard_normal((1, 5)).astype(np.float16),
}
CODECS = [DEFAULT_CODEC, DEFAULT_TOPK_CODEC, {"id": "zstd", "level": 3}, {"id": "lz4", "acceleration": 1},
          {"id": "blosc", "cname": "zstd", "clevel": 9, "shuffle": 1, "blocksize": 0}, {"id": "zlib", "level": 1}]


def _zarr_file(array: np.ndarray, rows: int, compressors: list) -> tuple[bytes, dict]:
    """zarr's own data file and metadata for ``array`` in kdcache's layout (one shard, inner chunks of rows)."""
    contents: dict = {}
    shard_rows = -(-array.shape[0] // rows) * rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        created = zarr.create_array(zarr.storage.MemoryStore(contents), name="x", data=array,
                                    shards=(shard_rows, *array.shape[1:]), chunks=(rows, *array.shape[1:]),
                                    compressors=[*compressors, zarr.codecs.Crc32cCodec()], filters=None,
                                    chunk_key_encoding=CHUNK_KEYS, zarr_format=3, config={"write_empty_chunks": True})
    key = next(k for k in contents if "/c." in k)
    return contents[key].to_bytes(), created.metadata.to_dict()


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c['id']}-{c.get('cname', '')}")
@pytest.mark.parametrize("name", list(ARRAYS))
def test_write_whole_is_byte_identical_to_zarr(name: str, codec: dict) -> None:
    array = ARRAYS[name]
    rows = max(1, min(len(array), 700))  # several inner chunks, the last one short
    expected, metadata = _zarr_file(array, rows, to_zarr_compressors(codec))
    inner = inner_codec(metadata)
    assert inner is not None
    assert b"".join(write_whole(array, rows, inner, metadata.get("fill_value", 0))) == expected


def test_row_shuffled_codes_are_byte_identical_and_read_back() -> None:
    codes = RNG.integers(-127, 128, (1234, 64)).astype(np.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shuffle = [zn.Shuffle(elementsize=64)]
    expected, metadata = _zarr_file(codes, 500, [*shuffle, *to_zarr_compressors(DEFAULT_TOPK_CODEC)])
    inner = inner_codec(metadata)
    assert inner is not None and b"".join(write_whole(codes, 500, inner)) == expected
    contents: dict = {}
    store = zarr.storage.MemoryStore(contents)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        created = zarr.create_array(store, name="x", data=codes, shards=(1500, 64), chunks=(500, 64),
                                    compressors=[*shuffle, *to_zarr_compressors(DEFAULT_TOPK_CODEC),
                                                 zarr.codecs.Crc32cCodec()], filters=None,
                                    chunk_key_encoding=CHUNK_KEYS, zarr_format=3)
    store._store_dict["x/c.0.0"] = zarr.core.buffer.cpu.Buffer.from_bytes(b"".join(write_whole(codes, 500, inner)))
    np.testing.assert_array_equal(created[...], codes)


def test_an_unknown_compressor_is_left_to_zarr() -> None:
    metadata = {"codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [4], "codecs": [{"name": "bytes"}, {"name": "someday"}, {"name": "crc32c"}],
        "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}], "index_location": "end"}}],
        "chunk_grid": {"configuration": {"chunk_shape": [8]}}, "shape": [8]}
    assert inner_codec(metadata) is None
