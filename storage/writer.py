"""CacheWriter: encode a shard (pure), flush it under a temp name, then commit it atomically.

Commit protocol for shard k:

1. ``encode_shard`` builds the flat arrays in memory and runs every check (nothing touches disk before that);
2. the backend packs them into the shard's files, still in memory; each file's size and crc32c are taken there;
3. the files are written under ``shards/.tmp-shard-k-...`` and fsynced (files, then their folders);
4. ``os.replace`` renames the temp to ``shards/shard-k`` (atomic), then ``shards/`` is fsynced;
5. the sidecar ``shards/shard-k.json`` (range, tokens, bytes, file table) is written atomically: the commit point.

``finalize`` / ``merge_parts`` fold every sidecar into ``manifest.json``, written last. A writer killed at any
step leaves either a temp (ignored, cleaned on retry) or a committed shard, and the manifest still says
"writing", so readers refuse the cache unless told to accept a partial one. A full disk at any step removes the
shard in flight and raises ``DiskFullError``; the next run resumes as if nothing had happened.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from storage.backends.base import Backend
from storage.backends.registry import get_backend
from storage.encode import EncodedShard, encode_shard
from storage.errors import CacheLockedError, CacheMismatchError, FormatVersionError, ManifestError, ShardError
from storage.files import disk_full_error, fsync_path, is_disk_full, remove_path, write_json_atomic, write_tree
from storage.fingerprint import compare_fingerprints
from storage.manifest import (MANIFEST_NAME, SHARDS_DIR, Manifest, ShardRecord, read_manifest, read_sidecars,
                              shard_checksum, shard_name, sidecar_path, summarize_arrays, write_manifest)
from storage.spec import FORMAT_VERSION, CacheSpec

LOCKS_DIR = "locks"


@contextmanager
def _manifest_lock(root: Path) -> Iterator[None]:
    """Serialise manifest creation and merges between processes (blocking; held for milliseconds)."""
    (root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
    with open(root / LOCKS_DIR / "manifest.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def spec_differences(cached: CacheSpec, wanted: CacheSpec) -> list[str]:
    """One sentence per spec field that differs between an existing cache and a new writer."""
    a, b = cached.to_dict(), wanted.to_dict()
    keys = list(dict.fromkeys([*a, *b]))  # a seq2seq spec has keys a single-stream one leaves out
    return [f"spec {key} differs: the cache has {a.get(key)!r}, this writer has {b.get(key)!r}"
            for key in keys if a.get(key) != b.get(key)]


class CacheWriter:
    """Writes one part of a cache; see docs/architecture.md for the contract.

    Args:
        path: cache directory (created if needed).
        spec: what the cache holds.
        fingerprints: teacher/tokenizer/data/settings fingerprints (JSON-ready dict).
        part: ``(index, count)`` of a job array; this writer owns shards with ``k % count == index``.

    Raises:
        CacheMismatchError: ``path`` holds a cache with another spec or other fingerprints.
        CacheLockedError: another live writer holds the same part.
    """

    def __init__(self, path: str | os.PathLike[str], spec: CacheSpec, fingerprints: Mapping[str, Any], *,
                 part: tuple[int, int] = (0, 1)) -> None:
        index, count = part
        if not (count >= 1 and 0 <= index < count):
            raise ShardError(f"part {part} is invalid; expected (index, count) with 0 <= index < count")
        self.root, self.spec, self.part = Path(path), spec, (index, count)
        self.fingerprints = dict(fingerprints)
        self.backend: Backend = get_backend(spec.backend)
        (self.root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire_part_lock()
        try:
            with _manifest_lock(self.root):
                self._open_manifest()
        except BaseException:
            self.close()
            raise

    def _acquire_part_lock(self) -> Any:
        (self.root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
        lock_path = self.root / LOCKS_DIR / f"part-{self.part[0]:05d}-of-{self.part[1]:05d}.lock"
        handle = open(lock_path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if the process dies
        except BlockingIOError:
            handle.close()
            raise CacheLockedError(f"part {self.part[0]} of {self.part[1]} of {self.root} is locked by another "
                                   f"running writer ({lock_path}); wait for it or use another part") from None
        return handle

    def _open_manifest(self) -> None:
        """Create the "writing" manifest, or check that an existing cache is the same cache."""
        if not (self.root / MANIFEST_NAME).exists():
            write_manifest(self.root, Manifest(self.spec, self.fingerprints, "writing"))
            return
        existing = read_manifest(self.root)
        if existing.format_version != FORMAT_VERSION:
            raise FormatVersionError(f"{self.root} is a format {existing.format_version} cache; this kdcache reads it "
                                     f"but writes format {FORMAT_VERSION} only, so it cannot add shards to it. "
                                     f"Write to a new directory.")
        differences = spec_differences(existing.spec, self.spec)
        differences += compare_fingerprints(existing.fingerprints, self.fingerprints, strict=True)
        if differences:
            raise CacheMismatchError(f"{self.root} already holds a different cache:\n  - " + "\n  - ".join(differences)
                                     + "\nUse a new directory, or the same spec and fingerprints to resume.",
                                     differences=differences)
        if existing.status != "complete":  # a resumed writer makes the cache visibly in progress again
            existing.status = "writing"
            write_manifest(self.root, existing)

    # ---- writing -------------------------------------------------------------------------------------
    def owns(self, index: int) -> bool:
        """Whether shard ``index`` belongs to this writer's part."""
        return index % self.part[1] == self.part[0]

    def committed_shards(self) -> set[int]:
        """Shards committed so far by any part (sidecar present and data in place)."""
        return {k for k in read_sidecars(self.root) if self.backend.final_path(self.root, k).exists()}

    def write_shard(self, index: int, sequences: Sequence[Mapping[str, Any]]) -> ShardRecord:
        """Encode and atomically commit shard ``index`` (see ``storage.encode.encode_shard`` for ``sequences``)."""
        if not self.owns(index):
            raise ShardError(f"shard {index} belongs to part {index % self.part[1]} of {self.part[1]}, "
                             f"not to this writer's part {self.part[0]}")
        if sidecar_path(self.root, index).exists() and self.backend.final_path(self.root, index).exists():
            raise ShardError(f"shard {index} is already committed; skip writer.committed_shards() when resuming")
        return self.commit(encode_shard(self.spec, index, sequences))

    def commit(self, encoded: EncodedShard) -> ShardRecord:
        """Pack an encoded shard in memory, write it under a temp name, rename it into place, write its sidecar.

        Raises:
            DiskFullError: the file system filled up; nothing of this shard is left behind.
        """
        index = encoded.index
        self._clear_stale(index)
        packed = self.backend.pack(encoded.arrays, self.spec, index)
        files = packed.file_table()
        record = ShardRecord(
            index=index, seq_start=encoded.seq_start, seq_stop=encoded.seq_stop, num_tokens=encoded.num_tokens,
            path=self.backend.final_path(self.root, index).relative_to(self.root).as_posix(),
            stored_bytes=sum(size for size, _ in files.values()),
            decoded_bytes=sum(a["decoded_bytes"] for a in packed.arrays.values()), checksum=shard_checksum(files),
            arrays=packed.arrays, lossy=encoded.lossy, extra={**packed.extra, "files": files})
        try:
            self._flush(index, packed.files)
            write_json_atomic(sidecar_path(self.root, index), asdict(record))
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            remove_path(self.backend.final_path(self.root, index))
            raise disk_full_error(self.root, record.stored_bytes, f"shard {index}") from None
        return record

    def _flush(self, index: int, files: Mapping[str, Any]) -> None:
        """Write a packed shard's files under a temp name, durably, then rename the temp into place."""
        tmp, final = self.backend.temp_path(self.root, index), self.backend.final_path(self.root, index)
        shards = self.root / SHARDS_DIR
        try:  # the packed paths start with the final name; they are written under the temp name first
            write_tree(shards, {tmp.name + path[len(final.name):]: data for path, data in files.items()})
            os.replace(tmp, final)
        except BaseException:
            remove_path(tmp)
            raise
        fsync_path(shards)

    def _clear_stale(self, index: int) -> None:
        """Remove leftovers of a writer of this shard that died: temps, and data whose sidecar never landed."""
        for stale in (self.root / SHARDS_DIR).glob(f".tmp-{shard_name(index)}-*"):
            remove_path(stale)
        if not sidecar_path(self.root, index).exists():
            remove_path(self.backend.final_path(self.root, index))

    def finalize(self) -> Manifest:
        """Fold every committed shard into manifest.json; status "complete" once every shard is present."""
        return merge_parts(self.root)

    def close(self) -> None:
        """Release this part's lock (also released if the process dies)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _valid_records(root: Path, manifest: Manifest, backend: Backend) -> list[ShardRecord]:
    records = []
    for index, record in sorted(read_sidecars(root).items()):
        if not 0 <= index < manifest.spec.num_shards or (record.seq_start, record.seq_stop) != manifest.spec.shard_range(index):
            raise ManifestError(f"sidecar of shard {index} covers [{record.seq_start}, {record.seq_stop}); "
                                f"this cache's shard {index} is {manifest.spec.shard_range(index)}")
        if set(record.arrays) != set(manifest.spec.array_names()):
            raise ManifestError(f"shard {index} holds arrays {sorted(record.arrays)}, expected "
                                f"{sorted(manifest.spec.array_names())}")
        if backend.final_path(root, index).exists():
            records.append(record)
    return records


def merge_parts(path: str | os.PathLike[str]) -> Manifest:
    """Merge every part's committed shards into manifest.json (written last, atomically).

    Safe to call from any process, any number of times (``kdcache merge``).

    Returns:
        The new manifest; its status is "complete" when every shard is present, else "partial".
    """
    root = Path(path)
    with _manifest_lock(root):
        manifest = read_manifest(root)
        backend = get_backend(manifest.spec.backend)
        manifest.shards = _valid_records(root, manifest, backend)
        manifest.arrays = summarize_arrays(manifest.spec, manifest.shards)
        complete = len(manifest.shards) == manifest.spec.num_shards
        manifest.status = "complete" if complete else "partial"
        if complete:  # no writer can still need a temp: every shard is committed
            for stale in (root / SHARDS_DIR).glob(".tmp-*"):
                remove_path(stale)
        try:
            write_manifest(root, manifest)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            raise disk_full_error(root, len(json.dumps(manifest.to_dict())), "manifest.json") from None
    return manifest
