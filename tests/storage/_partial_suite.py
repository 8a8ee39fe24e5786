"""Partial caches, mixed into the shared backend suite (tests/storage/test_storage_backends.py): a writer that
died leaves a cache readers refuse (and read with ``allow_partial``) and a rerun finishes; verify says how to
finish a killed precompute; data without its sidecar is not committed; parts write in parallel and merge."""

from __future__ import annotations

import pytest

from kdcache.storage import CacheReader, CacheWriter, merge_parts, verify_cache
from kdcache.storage.core.errors import CacheLockedError, PartialCacheError
from kdcache.storage.core.stores import open_store
from kdcache.storage.folders import put_files
from tests.storage._cache_data import FINGERPRINTS, expected, make_sequences


class PartialSuite:
    """The partial-cache tests of one backend; the suite that mixes this in gives ``spec``, ``build`` and
    ``assert_same``."""

    def test_writer_that_died_leaves_a_refused_partial_cache(self, tmp_path):
        spec = self.spec()
        seqs = self.build(tmp_path, spec, shards=[0, 2], finalize=False)  # "died" before shard 1 and finalize
        temp = tmp_path / "shards" / f".tmp-shard-000001-4242-dead{'.arrow' if spec.backend == 'arrow' else ''}"
        temp.mkdir() if spec.backend == "zarr" else temp.write_bytes(b"half a shard")
        sidecar_temp = tmp_path / "shards" / ".shard-000001.json.4242-deadbeef.tmp"  # killed while sealing it
        sidecar_temp.write_bytes(b'{"index": 1')
        with pytest.raises(PartialCacheError, match="status 'writing'.*2 of 3 shards") as refused:
            CacheReader(tmp_path)
        assert "Rerun the same `kdcache precompute` command" in str(refused.value)  # the next step, as a user types it
        assert "`kdcache train --allow-partial`" in str(refused.value)
        assert "`kdcache.open_cache(path, allow_partial=True)`" in str(refused.value)  # the way that works in Python
        reader = CacheReader(tmp_path, allow_partial=True)
        assert reader.committed_shards == [0, 2]
        self.assert_same(reader[6], expected(spec, seqs[6]))
        with pytest.raises(PartialCacheError):
            reader[3]
        assert not verify_cache(tmp_path).ok
        with CacheWriter(tmp_path, spec, FINGERPRINTS) as writer:  # resume: same spec and fingerprints
            assert writer.committed_shards() == {0, 2}
            writer.write_shard(1, seqs[3:6])
            assert writer.finalize().status == "complete"
        assert not temp.exists() and not sidecar_temp.exists() and verify_cache(tmp_path).ok
        assert [p.name for p in (tmp_path / "shards").glob(".*")] == []
        self.assert_same(CacheReader(tmp_path)[4], expected(spec, seqs[4]))

    def test_verify_on_a_killed_precompute_says_it_is_unfinished_and_how_to_finish(self, tmp_path):
        """Killed after its tokenizer folder and one shard: the manifest lists no folder file yet (the shards'
        merge does that), so verify checks the folder against its own table and says how to go on."""
        self.build(tmp_path, self.spec(), shards=[0], finalize=False)
        put_files(open_store(tmp_path), "tokenizer", {"tokenizer.json": b"{}", "vocab.txt": b"a\nb\n"})
        report = verify_cache(tmp_path)
        assert [str(p) for p in report.problems] == [
            "cache: cache is not complete (status 'writing', 1 of 3 shards committed): its precompute stopped (or "
            "is still running); rerun the same `kdcache precompute` command to finish it, keeping the committed "
            "shards (`kdcache merge` joins a job array's parts)"]
        (tmp_path / "tokenizer" / "vocab.txt").write_bytes(b"a\nc\n")  # the folder's own table still guards it
        assert "file tokenizer/vocab.txt does not match the crc32c" in str(verify_cache(tmp_path).problems)
        early = tmp_path / "early"  # killed before its manifest: only the tokenizer folder landed
        put_files(open_store(early), "tokenizer", {"tokenizer.json": b"{}"})
        assert [str(p) for p in verify_cache(early).problems] == [
            f"cache: no manifest.json in {open_store(early).url}: a precompute stopped before writing it (the "
            "folder holds tokenizer); rerun the same `kdcache precompute` command"]

    def test_data_without_sidecar_is_not_committed(self, tmp_path):
        spec = self.spec()
        self.build(tmp_path, spec, finalize=False)
        (tmp_path / "shards" / "shard-000001.json").unlink()  # died between rename and sidecar
        manifest = merge_parts(tmp_path)
        assert manifest.status == "partial" and manifest.committed == [0, 2]
        with pytest.raises(PartialCacheError, match="status 'partial'"):
            CacheReader(tmp_path)

    def test_parts_write_in_parallel_and_merge(self, tmp_path):
        spec = self.spec(num_sequences=10, sequences_per_shard=2)
        seqs = make_sequences(spec, [3] * 10)
        first = CacheWriter(tmp_path, spec, FINGERPRINTS, part=(0, 2))
        second = CacheWriter(tmp_path, spec, FINGERPRINTS, part=(1, 2))
        with pytest.raises(CacheLockedError, match="part 1 of 2"):
            CacheWriter(tmp_path, spec, FINGERPRINTS, part=(1, 2))
        for k in range(spec.num_shards):
            (first if first.owns(k) else second).write_shard(k, seqs[2 * k:2 * k + 2])
        first.close(), second.close()
        assert merge_parts(tmp_path).status == "complete"
        self.assert_same(CacheReader(tmp_path)[9], expected(spec, seqs[9]))

