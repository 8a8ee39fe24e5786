"""CacheWriter: encode a shard (pure), flush it under a temp name, then commit it atomically.

Commit protocol for shard k:

1. ``encode_shard`` builds the flat arrays in memory and runs every check (nothing touches disk before that);
2. the backend packs them into the shard's files, still in memory; each file's size and crc32c are taken there;
3. the store makes them visible whole: a local folder writes them under ``shards/.tmp-shard-k-...``, fsyncs
   them and renames the temp to ``shards/shard-k``; an object store PUTs them at their final keys, where
   nothing refers to them yet (storage/core/stores.py);
4. the sidecar ``shards/shard-k.json`` (range, tokens, bytes, file table) is written atomically: the commit point.

``finalize`` / ``merge_parts`` fold every sidecar into ``manifest.json``, written last. A writer killed at any
step leaves either a temp (ignored, cleaned on retry) or a committed shard, and the manifest still says
"writing", so readers refuse the cache unless told to accept a partial one. A full disk at any step removes the
shard in flight and raises ``DiskFullError``; the next run resumes as if nothing had happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kdcache.storage.backends.base import Backend, get_backend
from kdcache.storage.buffers import BufferPool
from kdcache.storage.core.errors import CacheMismatchError, FormatVersionError, ManifestError, ShardError
from kdcache.storage.core.files import crc32c, disk_full_error, file_size
from kdcache.storage.core.store_base import Store, WriterLock
from kdcache.storage.core.stores import open_store
from kdcache.storage.encode import EncodedShard, encode_shard
from kdcache.storage.fingerprint import Difference, fingerprint_differences, same_values
from kdcache.storage.folders import folder_tables
from kdcache.storage.schema.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardRecord,
    range_problem,
    read_manifest,
    read_sidecars,
    shard_checksum,
    shard_name,
    sidecar_key,
    summarize_arrays,
    write_manifest,
    write_sidecar,
)
from kdcache.storage.schema.spec import CacheSpec


def cache_differences(existing: Manifest, spec: CacheSpec, fingerprints: dict[str, Any]) -> list[str]:
    """Everything that makes an existing cache another cache than the one a writer would write, each change once:
    a fingerprint that says again what a spec field already says (the layers, the sequence count) is left out."""
    old, new = existing.spec.to_dict(), spec.to_dict()
    keys = list(dict.fromkeys([*old, *new]))  # a seq2seq spec has keys a single-stream one leaves out
    spec_said: list[Difference] = [
        (f"spec {key} differs: the cache has {old.get(key)!r}, this writer has {new.get(key)!r}", old.get(key),
         new.get(key)) for key in keys if old.get(key) != new.get(key)]
    pairs = [(a, b) for _, a, b in spec_said]
    said = fingerprint_differences(existing.fingerprints, fingerprints, strict=True)
    return [s for s, _, _ in spec_said] + [
        s for s, a, b in said if a is None or not any(same_values(a, x) and same_values(b, y) for x, y in pairs)]


class ShardCommitter:
    """Encodes and commits shards of one cache: pure encode, pack, the files handed to the store, the sidecar last
    (the commit point). What a writer does per shard, without the part's lock or the manifest, so that a process
    that does not hold the part (stage one's writer processes) commits the shards of the one that does."""

    _lock: WriterLock | None = None  # a part's lock (CacheWriter); a writer process commits without it

    def __init__(self, store: Store, spec: CacheSpec) -> None:
        self.store, self.spec = store, spec
        self.backend: Backend = get_backend(spec)
        self._buffers = BufferPool()

    def write_shard(self, index: int, sequences: Sequence[Mapping[str, Any]], *,
                    finite: frozenset[str] = frozenset()) -> ShardRecord:
        """Encode and atomically commit shard ``index`` (see ``storage.encode.encode_shard`` for ``sequences``;
        ``finite`` names float arrays whose producer already checked every value finite on its device)."""
        # The shard's flat arrays live in reused buffers until it is committed (storage/buffers.py).
        with self._buffers.lease() as lease:
            return self.commit(encode_shard(self.spec, index, sequences, finite=finite,
                                            concatenate=lease.concatenate))

    def commit(self, encoded: EncodedShard) -> ShardRecord:
        """Pack an encoded shard in memory, hand its files to the store, then write its sidecar (the commit point),
        and renew the part's lease.

        Raises:
            DiskFullError: the local file system filled up; nothing of this shard is left behind.
        """
        index, key = encoded.index, self.backend.shard_key(encoded.index)
        self._clear_stale(index)
        packed = self.backend.pack(encoded.arrays, self.spec, index)
        files = {path: [file_size(data), crc32c(data)] for path, data in packed.files.items()}  # from memory
        record = ShardRecord(
            index=index, seq_start=encoded.seq_start, seq_stop=encoded.seq_stop, num_tokens=encoded.num_tokens,
            path=key, stored_bytes=sum(size for size, _ in files.values()),
            decoded_bytes=sum(a["decoded_bytes"] for a in packed.arrays.values()), checksum=shard_checksum(files),
            arrays=packed.arrays, lossy=encoded.lossy, extra={**packed.extra, "files": files})
        try:
            self.store.put_shard(key, packed.files)
            write_sidecar(self.store, record)
        except OSError as exc:
            self.store.remove(key)  # data without its sidecar is never read; do not leave it to fill the disk
            raise disk_full_error(exc, self.store.local_path(""), record.stored_bytes, f"shard {index}") from None
        self.renew()
        return record

    def renew(self) -> None:
        """Show that this writer is alive: an object-store lease is renewed after each shard, wherever the shard
        was committed (this process, or a writer process of stage one)."""
        if self._lock is not None:
            self._lock.renew()

    def _clear_stale(self, index: int) -> None:
        """Remove leftovers of a writer of this shard that died: temps, and data whose sidecar never landed."""
        self.store.remove_temps(shard_name(index))
        if self.store.size(sidecar_key(index)) is None:
            self.store.remove(self.backend.shard_key(index))


class CacheWriter(ShardCommitter):
    """Writes one part of a cache: a committer that holds the part's lock and the manifest; see
    docs/architecture.md for the contract.

    Args:
        path: cache folder or fsspec URL (created if needed), or an open ``Store``.
        spec: what the cache holds.
        fingerprints: teacher/tokenizer/data/settings fingerprints (JSON-ready dict).
        part: ``(index, count)`` of a job array; this writer owns shards with ``k % count == index``.
        storage_options: fsspec options for a URL (endpoint, credentials...).

    Raises:
        CacheMismatchError: ``path`` holds a cache with another spec or other fingerprints.
        CacheLockedError: another live writer holds the same part.
    """

    def __init__(self, path: str | os.PathLike[str] | Store, spec: CacheSpec, fingerprints: Mapping[str, Any], *,
                 part: tuple[int, int] = (0, 1), storage_options: Mapping[str, Any] | None = None) -> None:
        index, count = part
        if not (count >= 1 and 0 <= index < count):
            raise ShardError(f"part {part} is invalid; expected (index, count) with 0 <= index < count")
        super().__init__(open_store(path, storage_options), spec)
        self.root, self.part = self.store.url, (index, count)
        self.fingerprints = dict(fingerprints)
        self._lock = self.store.lock(f"part-{index:05d}-of-{count:05d}.lock", f"part {index} of {count}")
        try:
            with self.store.merge_lock():
                self._open_manifest()
        except BaseException:
            self.close()
            raise

    def _open_manifest(self) -> None:
        """Create the "writing" manifest, or check that an existing cache is the same cache."""
        if self.store.size(MANIFEST_NAME) is None:
            write_manifest(self.store, Manifest(self.spec, self.fingerprints, "writing"))
            return
        existing = read_manifest(self.store)
        refusal = existing.format.refusal(self.root)  # this code writes only its own format
        if refusal:
            raise FormatVersionError(refusal)
        differences = cache_differences(existing, self.spec, self.fingerprints)
        if differences:
            raise CacheMismatchError(f"{self.root} already holds a different cache:\n  - " + "\n  - ".join(differences)
                                     + "\nUse a new directory, or the same spec and fingerprints to resume.",
                                     differences=differences)
        if existing.status != "complete":  # a resumed writer makes the cache visibly in progress again
            existing.status = "writing"
            write_manifest(self.store, existing)

    # ---- writing -------------------------------------------------------------------------------------
    def owns(self, index: int) -> bool:
        """Whether shard ``index`` belongs to this writer's part."""
        return index % self.part[1] == self.part[0]

    def committed_shards(self) -> set[int]:
        """Shards committed so far by any part (sidecar present and data in place)."""
        return {k for k in read_sidecars(self.store) if self.store.exists(self.backend.shard_key(k))}

    def write_shard(self, index: int, sequences: Sequence[Mapping[str, Any]], *,
                    finite: frozenset[str] = frozenset()) -> ShardRecord:
        """``ShardCommitter.write_shard`` of a shard of this part not yet committed."""
        if not self.owns(index):
            raise ShardError(f"shard {index} belongs to part {index % self.part[1]} of {self.part[1]}, "
                             f"not to this writer's part {self.part[0]}")
        if self.store.size(sidecar_key(index)) is not None and self.store.exists(self.backend.shard_key(index)):
            raise ShardError(f"shard {index} is already committed; skip writer.committed_shards() when resuming")
        return super().write_shard(index, sequences, finite=finite)

    def finalize(self) -> Manifest:
        """Fold every committed shard into manifest.json; status "complete" once every shard is present."""
        return merge_parts(self.store)

    def close(self) -> None:
        """Release this part's lock (a local lock is also released if the process dies)."""
        if self._lock is not None:  # None: closed, or __init__ failed before taking it
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _valid_records(store: Store, manifest: Manifest, backend: Backend) -> list[ShardRecord]:
    records = []
    for index, record in sorted(read_sidecars(store).items()):
        problem = range_problem(record, manifest.spec)
        if problem:
            raise ManifestError(f"sidecar of shard {index}: {problem}")
        if set(record.arrays) != set(manifest.spec.array_names()):
            raise ManifestError(f"shard {index} holds arrays {sorted(record.arrays)}, expected "
                                f"{sorted(manifest.spec.array_names())}")
        if store.exists(backend.shard_key(index)):
            records.append(record)
    return records


def merge_parts(path: str | os.PathLike[str] | Store, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Merge every part's committed shards into manifest.json (written last, atomically).

    Safe to call from any process, any number of times (``kdcache merge``). On an object store merges are not
    serialised: run ``kdcache merge`` once all parts are done, as the README's job-array recipe does.

    Returns:
        The new manifest; its status is "complete" when every shard is present, else "partial".
    """
    store = open_store(path, storage_options)
    with store.merge_lock():
        manifest = read_manifest(store)
        backend = get_backend(manifest.spec, manifest.format)
        manifest.shards = _valid_records(store, manifest, backend)
        manifest.arrays = summarize_arrays(manifest.spec, manifest.shards)
        if manifest.format.sealed_index:  # an older cache's manifest keeps its format: no table of its folders
            manifest.files = folder_tables(store)
        complete = len(manifest.shards) == manifest.spec.num_shards
        manifest.status = "complete" if complete else "partial"
        if complete:  # no writer can still need a temp: every shard is committed
            store.remove_temps()
        try:
            write_manifest(store, manifest)
        except OSError as exc:
            needed = len(json.dumps(manifest.to_dict()))
            raise disk_full_error(exc, store.local_path(""), needed, "manifest.json") from None
    return manifest
