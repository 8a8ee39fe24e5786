"""Reading data files into a per-thread buffer: the same bytes as a plain read, one buffer per thread, grown as
needed, and shard reads through it decode as before."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kdcache.storage import CacheReader, CacheSpec, CacheWriter
from kdcache.storage.core import files
from kdcache.storage.core.files import read_reused
from kdcache.storage.core.stores import LocalStore


def _base(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]


def test_the_bytes_are_the_files_and_the_buffer_is_reused_and_grown(tmp_path: Path) -> None:
    small, large, empty = tmp_path / "small", tmp_path / "large", tmp_path / "empty"
    small.write_bytes(b"abc" * 1000)
    large.write_bytes(bytes(range(256)) * 4000)
    empty.write_bytes(b"")
    first = read_reused(small)
    assert bytes(first) == small.read_bytes()
    address = _base(first)
    assert bytes(read_reused(small)) == small.read_bytes() and _base(read_reused(small)) == address  # reused
    assert bytes(read_reused(large)) == large.read_bytes()  # grown
    again = read_reused(small)
    assert bytes(again) == small.read_bytes() and _base(again) == _base(read_reused(large))  # kept at its size
    assert bytes(read_reused(empty)) == b""
    assert bytes(LocalStore(tmp_path).read_transient("large")) == large.read_bytes()


def test_a_file_over_the_kept_size_gets_a_buffer_of_its_own(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "small").write_bytes(b"s" * 100)
    (tmp_path / "big").write_bytes(b"b" * 5000)
    monkeypatch.setattr(files, "KEPT_BUFFER", 1000)
    kept = _base(read_reused(tmp_path / "small"))
    assert bytes(read_reused(tmp_path / "big")) == b"b" * 5000
    assert _base(read_reused(tmp_path / "small")) == kept  # the big file's buffer was not kept


def test_each_thread_has_its_own_buffer(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 5000)
    mine = _base(read_reused(tmp_path / "f"))
    theirs: list[int] = []
    thread = threading.Thread(target=lambda: theirs.append(_base(read_reused(tmp_path / "f"))))
    thread.start()
    thread.join()
    assert theirs and theirs[0] != mine


def test_shards_read_through_the_buffer_decode_every_array(tmp_path: Path) -> None:
    spec = CacheSpec(num_sequences=4, hidden_layers=(1, 2), sequences_per_shard=2, dtype="fp16", logits=None)
    rng = np.random.default_rng(0)
    items = [{"input_ids": rng.integers(0, 100, n), "hidden/1": rng.standard_normal((n, 8)).astype(np.float16),
              "hidden/2": rng.standard_normal((n, 8)).astype(np.float16)} for n in (5, 7, 3, 9)]
    with CacheWriter(tmp_path / "c", spec, {}) as writer:
        for k in range(2):
            writer.write_shard(k, items[2 * k:2 * k + 2])
        writer.finalize()
    reader = CacheReader(tmp_path / "c", decode_threads=2)
    for k in range(2):  # both shards in turn, every array through the same threads' buffers
        shard = reader.read_shard(k)
        for i in range(2):
            got = shard.sequence(i)
            for name in ("input_ids", "hidden/1", "hidden/2"):
                np.testing.assert_array_equal(got[name], items[2 * k + i][name])
