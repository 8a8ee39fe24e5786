"""Every file of a cache checked, mixed into the shared backend suite (tests/storage/test_storage_backends.py):
a flipped bit anywhere (data, sidecars, manifest, tokenizer, teacher head) and an edited sidecar field are
reported naming the file; folders follow the umask; older caches verify with a note.

Files excepted from the flips: ``locks/*``. A local cache's lock files are empty (``flock`` handles whose content
is never read; asserted below), so no bit of theirs can change what is read; an object store's lease objects
say who writes (owner, host, pid, time) and are deleted when the writer closes, so a finished cache has none.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from kdcache.storage import verify_cache
from kdcache.storage.core.canonical import canonical_json, sealed
from kdcache.storage.core.stores import open_store
from kdcache.storage.folders import TABLE, put_folder
from kdcache.storage.schema.manifest import SIDECAR_SEAL
from kdcache.storage.writer import merge_parts

FORMATS = Path(__file__).resolve().parents[1] / "data"
SIDECAR_FIELDS = (("index",), ("seq_start",), ("seq_stop",), ("num_tokens",), ("stored_bytes",), ("decoded_bytes",),
                  ("arrays", "hidden/0", "decoded_bytes"), ("arrays", "input_ids", "shape", 0),
                  ("arrays", "hidden/0", "stored_bytes"))


def add_folders(root: Path, scratch: Path) -> None:
    """A tokenizer and a teacher head beside the shards, as stage one saves them (contents are opaque here)."""
    rng = np.random.default_rng(3)
    contents = {"tokenizer": {"tokenizer.json": b'{"model": {"vocab": {"a": 0, "b": 1}}}\n',
                              "tokenizer_config.json": b'{"model_max_length": 12}\n'},
                "teacher_head": {"head.safetensors": rng.bytes(4096), "head.json": canonical_json({"layer": 2})}}
    for key, files in contents.items():
        source = scratch / key
        source.mkdir(parents=True)
        for name, data in files.items():
            (source / name).write_bytes(data)
        put_folder(open_store(root), key, source)


def flip(path: Path, offset: int, mask: int) -> bytes:
    """Flip the bits ``mask`` of the byte at ``offset``; returns the original bytes."""
    original = path.read_bytes()
    path.write_bytes(original[:offset] + bytes([original[offset] ^ mask]) + original[offset + 1:])
    return original


def edit_sidecar(root: Path, shard: int, key: tuple, delta: int, reseal: bool) -> None:
    """Add ``delta`` to one (nested) field of a sidecar, keeping it canonical; ``reseal``: as a tool that rewrote
    it would."""
    path = root / "shards" / f"shard-{shard:06d}.json"
    data = json.loads(path.read_text())
    holder = data
    for part in key[:-1]:
        holder = holder[part]
    holder[key[-1]] += delta
    path.write_bytes(canonical_json(sealed(data, SIDECAR_SEAL) if reseal else data))


def run_cli(*argv: str) -> tuple[int, str]:
    from tests.storage._cache_data import run_cli as run

    return run(*argv)


class IntegritySuite:
    backend: str

    def finished(self, root: Path, scratch: Path) -> None:
        """A complete cache of 3 shards with a tokenizer and a teacher head."""
        self.build(root, self.spec(logits="topk", attention_layers=(1,)), finalize=False)
        add_folders(root, scratch)
        merge_parts(root)

    def test_a_flipped_bit_in_every_file_is_reported_naming_it(self, tmp_path):
        root = tmp_path / "cache"
        self.finished(root, tmp_path / "scratch")
        assert verify_cache(root).ok
        locks = [p for p in (root / "locks").rglob("*") if p.is_file()]
        assert locks and all(p.stat().st_size == 0 for p in locks)  # why locks/ is excepted
        files = sorted(p for p in root.rglob("*") if p.is_file() and "locks" not in p.relative_to(root).parts)
        names = {p.relative_to(root).as_posix() for p in files}
        assert {"manifest.json", "shards/shard-000001.json", "tokenizer/tokenizer.json", f"tokenizer/{TABLE}",
                "teacher_head/head.safetensors", "teacher_head/head.json"} <= names
        for path in files:
            rel = path.relative_to(root).as_posix()
            size = path.stat().st_size
            for offset, mask in sorted({(0, 0x10), (size // 3, 0x01), (size // 2, 0x20), (size - 2, 0x04)}):
                original = flip(path, offset, mask)
                try:
                    report = verify_cache(root)
                finally:
                    path.write_bytes(original)
                assert not report.ok, (rel, offset)
                self.assert_named(rel, report)
        assert verify_cache(root).ok

    def assert_named(self, rel: str, report) -> None:
        """The report names the damaged file, or for a shard's data file the shard (its array, per
        Format3Suite.test_a_flipped_bit_in_any_file_is_caught)."""
        text = "\n".join(str(p) for p in report.problems)
        parts = rel.split("/")
        if parts[0] == "shards" and not parts[1].endswith(".json"):
            shard = int(parts[1][len("shard-"):len("shard-") + 6])
            assert {p.shard for p in report.problems} == {shard}, (rel, text)
        else:
            assert rel.split("/", 1)[-1] in text or rel in text, (rel, text)

    def test_each_numeric_field_of_a_sidecar_edited_is_reported(self, tmp_path):
        root = tmp_path / "cache"
        self.finished(root, tmp_path / "scratch")
        partial = tmp_path / "partial"  # no manifest record to compare with: the data alone must tell
        self.build(partial, self.spec(logits="topk", attention_layers=(1,)), finalize=False)
        for cache in (root, partial):
            for key in SIDECAR_FIELDS:
                for reseal in (False, True):
                    if reseal and cache is partial and key[-1] == "stored_bytes" and len(key) > 1 and \
                            self.backend == "arrow":
                        continue  # an Arrow column's share of the one file: caught by the seal and the manifest
                    path = cache / "shards" / "shard-000001.json"
                    original = path.read_bytes()
                    edit_sidecar(cache, 1, key, 1, reseal)
                    try:
                        report = verify_cache(cache)
                    finally:
                        path.write_bytes(original)
                    named = [p for p in report.problems if p.array == "shard-000001.json"]
                    assert named, (cache.name, key, reseal, [str(p) for p in report.problems])
                    if reseal:  # the cross-checks name the field itself
                        assert any(str(key[-1 if cache is partial else 0]) in p.message or
                                   (key[-1] == 0 and "shape" in p.message) for p in named), \
                            (cache.name, key, [str(p) for p in named])
        assert verify_cache(root).ok

    def test_folders_are_listed_and_follow_the_umask(self, tmp_path):
        previous = os.umask(0o027)
        try:
            self.finished(tmp_path / "cache", tmp_path / "scratch")
        finally:
            os.umask(previous)
        manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
        assert set(manifest["files"]) == {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                                          "teacher_head/head.safetensors", "teacher_head/head.json"}
        for path in [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]:
            want = 0o750 if path.is_dir() else 0o640
            assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))
        extra = tmp_path / "cache" / "tokenizer" / "added.txt"
        extra.write_text("not written by kdcache")
        report = verify_cache(tmp_path / "cache")
        assert not report.ok and any("tokenizer/added.txt" in str(p) for p in report.problems)

    def test_older_caches_verify_with_a_note(self, tmp_path):
        for source in (FORMATS / "format1" / f"cache-{self.backend}", FORMATS / "format2-seq2seq" /
                       f"cache-{self.backend}"):
            report = verify_cache(source)
            assert report.ok, report.problems
            assert len(report.notes) == 1 and "sidecars carry no crc32c" in report.notes[0]
            assert "tokenizer/ is not checked" in report.notes[0]
            code, out = run_cli("verify", str(source))
            assert code == 0 and out.startswith("note: this cache was written before") and "\nok: 2 shards" in out
            copy = tmp_path / source.parent.name
            shutil.copytree(source, copy)
            sidecar = json.loads((copy / "shards" / "shard-000001.json").read_text())
            sidecar["num_tokens"] += 1  # an old sidecar has no seal: the offsets still tell
            (copy / "shards" / "shard-000001.json").write_text(json.dumps(sidecar))
            report = verify_cache(copy)
            assert any(p.array == "shard-000001.json" and "num_tokens" in p.message for p in report.problems), \
                [str(p) for p in report.problems]
