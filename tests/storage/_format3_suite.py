"""Format 3 promises, mixed into the shared backend suite (tests/storage/test_storage_backends.py), so each test
runs once per backend: every stored byte is checked where it is read, reads cost what they read, files follow
the umask, a full disk loses nothing, Arrow shards open in ``datasets``, format 1 caches still read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kdcache.storage import CacheReader, CacheWriter, verify_cache
from kdcache.storage.core.errors import ChecksumError, DiskFullError, FormatVersionError

FORMAT1 = Path(__file__).resolve().parents[1] / "data" / "format1"


def flip(path: Path, offset: int) -> bytes:
    """Flip one bit of ``path`` at ``offset``; returns the original bytes."""
    original = path.read_bytes()
    path.write_bytes(original[:offset] + bytes([original[offset] ^ 0x10]) + original[offset + 1:])
    return original


def file_table(root: Path, shard: int) -> dict[str, list[int]]:
    return json.loads((root / "shards" / f"shard-{shard:06d}.json").read_text())["extra"]["files"]


class Format3Suite:
    backend: str

    def owner(self, root: Path, shard: int, path: str) -> str | None:
        """The array whose reads use file ``path`` (None: group metadata, read only by plain zarr users)."""
        record = json.loads((root / "shards" / f"shard-{shard:06d}.json").read_text())
        owners = [name for name, info in record["arrays"].items() if path in info["files"]]
        return owners[0] if len(owners) == 1 else None

    def test_a_flipped_bit_in_any_file_is_caught(self, tmp_path):
        spec = self.spec(logits="topk", attention_layers=(1,))
        seqs = self.build(tmp_path, spec, lengths=[6] * 7)
        reader = CacheReader(tmp_path, decode_threads=1)
        clean = reader.read_shard(1).arrays
        for path, (size, _) in file_table(tmp_path, 1).items():
            for offset in sorted({0, size // 3, size // 2, size - 5, size - 1}):
                original = flip(tmp_path / "shards" / path, offset)
                try:
                    self.assert_caught(tmp_path, path, clean)
                finally:
                    (tmp_path / "shards" / path).write_bytes(original)
        assert verify_cache(tmp_path).ok and len(seqs) == 7

    def assert_caught(self, root: Path, path: str, clean: dict) -> None:
        report = verify_cache(root)
        assert not report.ok and {p.shard for p in report.problems} == {1}, (path, report.problems)
        owner = self.owner(root, 1, path)
        if owner is not None:
            assert (1, owner) in report.bad_arrays, (path, report.problems)
        else:
            assert any(path in p.message or p.array == path for p in report.problems), (path, report.problems)
        try:
            data = CacheReader(root).read_shard(1).arrays
        except ChecksumError as caught:
            assert caught.shard == 1 and "shard 1" in str(caught)
            assert owner is None or caught.array in (owner, "(file)"), (path, caught)
            return
        # Not raised: the byte was not read (zarr group metadata, Arrow padding or end marker) and the
        # values are exactly those written; a wrong value must never come back.
        # (Arrow lists one file for every array, so its owner is None: per-array attribution there is the job
        # of test_reading_one_array_never_touches_another.)
        assert owner is None, (path, "a damaged array read without an error")
        for name, want in clean.items():
            np.testing.assert_array_equal(data[name], want, err_msg=f"{path}: {name} read wrong values")

    def test_reading_one_array_never_touches_another(self, tmp_path):
        spec = self.spec(logits="topk", attention_layers=(1,))
        self.build(tmp_path, spec, lengths=[6] * 7)
        clean = CacheReader(tmp_path).read_shard(0, ["logits"]).arrays
        shards = tmp_path / "shards"
        if self.backend == "zarr":  # damage every byte of hidden/0's data
            data = next(p for p in file_table(tmp_path, 0) if p.startswith("shard-000000/hidden/0/c"))
            (shards / data).write_bytes(bytes(len((shards / data).read_bytes())))
        else:  # damage hidden/0's values buffer inside the one file
            from kdcache.storage.backends.arrow_backend import message_layout

            raw = bytearray((shards / "shard-000000.arrow").read_bytes())
            header, spans = message_layout(bytes(raw))
            offset, length = spans[4 + 4]  # input_ids: 4 buffers; hidden/0: validity, offsets, validity, validity, values
            raw[header + offset: header + offset + length] = bytes(length)
            (shards / "shard-000000.arrow").write_bytes(bytes(raw))
        reader = CacheReader(tmp_path)
        got = reader.read_shard(0, ["logits"]).arrays
        for name in clean:
            np.testing.assert_array_equal(got[name], clean[name])
        with pytest.raises(ChecksumError) as caught:
            reader.read_shard(0, ["hidden/0"])
        assert (caught.value.shard, caught.value.array) == (0, "hidden/0")

    def test_whole_array_reads_equal_zarrs_own(self, tmp_path, monkeypatch):
        if self.backend != "zarr":
            pytest.skip("zarr layout only")
        import zarr

        from kdcache.storage.backends import zarr_backend

        monkeypatch.setattr(zarr_backend, "CHUNK_BYTES", 256)  # many inner chunks, the last one partial
        spec = self.spec(num_sequences=40, sequences_per_shard=40, logits="full", dtype="bf16")
        self.build(tmp_path, spec, lengths=[(i * 7) % 23 + 1 for i in range(40)])
        shard = CacheReader(tmp_path, decode_threads=1).read_shard(0)
        group = zarr.open_group(str(tmp_path / "shards" / "shard-000000"), mode="r")
        for name, array in {**shard.arrays, **shard.all_offsets}.items():
            want = np.asarray(group[name][:])
            assert array.dtype == want.dtype and array.shape == want.shape, name
            np.testing.assert_array_equal(array, want, err_msg=name)
        meta = json.loads((tmp_path / "shards" / "shard-000000" / "hidden" / "2" / "zarr.json").read_text())
        rows, total = meta["codecs"][0]["configuration"]["chunk_shape"][0], meta["shape"][0]
        assert total > rows and total % rows, (total, rows)  # several inner chunks, the last one partial

    def test_files_follow_the_umask(self, tmp_path):
        previous = os.umask(0o027)  # not the usual 022: hard-coded modes would not pass
        try:
            self.build(tmp_path / "cache", self.spec())
        finally:
            os.umask(previous)
        for path in [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]:
            want = 0o750 if path.is_dir() else 0o640
            assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))

    def test_a_full_disk_exits_cleanly_and_resumes_identically(self, tmp_path, small_tmpfs):
        spec = self.spec(num_sequences=12, sequences_per_shard=2, hidden_layers=(0, 1, 2, 3), logits="full")
        lengths = [40] * 12
        whole = tmp_path / "whole"
        seqs = self.build(whole, spec, lengths)
        filler = small_tmpfs / "filler"
        filler.write_bytes(bytes(max(0, shutil.disk_usage(small_tmpfs).free - 200_000)))  # room for ~3 shards
        cache = small_tmpfs / "cache"
        with CacheWriter(cache, spec, self.fingerprints) as writer:
            with pytest.raises(DiskFullError, match=rf"disk full while writing shard \d+ of the cache at {cache}"):
                for k in range(spec.num_shards):
                    writer.write_shard(k, seqs[2 * k: 2 * k + 2])
        failed = k
        assert 0 < failed < spec.num_shards
        leftovers = [p.name for p in (cache / "shards").iterdir() if p.name.startswith(".")]
        assert leftovers == [] and not (cache / writer.backend.shard_key(failed)).exists()
        filler.unlink()
        with CacheWriter(cache, spec, self.fingerprints) as writer:
            assert writer.committed_shards() == set(range(failed))
            for k in range(failed, spec.num_shards):
                writer.write_shard(k, seqs[2 * k: 2 * k + 2])
            assert writer.finalize().status == "complete"
        for k in range(spec.num_shards):
            assert file_table(cache, k) == file_table(whole, k)
        assert verify_cache(cache).ok

    def test_arrow_shards_open_with_datasets(self, tmp_path):
        if self.backend != "arrow":
            pytest.skip("zarr shards are zarr groups")
        import datasets

        spec = self.spec()
        seqs = self.build(tmp_path, spec)
        table = datasets.Dataset.from_file(str(tmp_path / "shards" / "shard-000001.arrow")).with_format("numpy")
        assert len(table) == 3 and table.column_names[:2] == ["input_ids", "hidden/0"]
        np.testing.assert_array_equal(table[1]["input_ids"], seqs[4]["input_ids"])
        np.testing.assert_array_equal(table[1]["hidden/2"], seqs[4]["hidden/2"].astype(np.float16))

    def test_format1_caches_still_read_and_verify(self, tmp_path):
        source = FORMAT1 / f"cache-{self.backend}"
        report = verify_cache(source)
        assert report.ok and report.shards_checked == 2, report.problems
        reader = CacheReader(source)
        assert reader.manifest.format_version == 1
        sequences = list(reader.iter_sequences())
        assert len(sequences) == 12 and sequences[3]["attention/2"].shape[1:] == (len(sequences[3]["input_ids"]),) * 2
        copy = tmp_path / "copy"
        shutil.copytree(source, copy)
        with pytest.raises(FormatVersionError, match="format 1 cache.*cannot add shards"):
            CacheWriter(copy, reader.spec, reader.fingerprints)
        victim = (copy / "shards" / "shard-000001.arrow" if self.backend == "arrow"
                  else copy / "shards" / "shard-000001" / "hidden" / "2" / "c" / "0" / "0")
        flip(victim, victim.stat().st_size // 2)
        assert not verify_cache(copy).ok
