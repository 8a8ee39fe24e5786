"""What ``verify`` checks beyond each data file's own checksum: the index files and the folders beside the shards.

- ``manifest.json`` and every sidecar carry their own crc32c (storage.core.canonical); the manifest's shard records must
  equal the sidecars, and its totals must equal their sums;
- each record agrees with itself and with the data: its range is the spec's range for its index (so the ranges
  tile the cache), ``num_tokens`` is the last value of its token offsets, ``stored_bytes`` the sum of its files'
  sizes, ``checksum`` the summary of its file table;
- every file under a folder beside the shards (tokenizer, teacher head) is listed in ``manifest.json["files"]``
  and its folder's table, and matches its size and crc32c.

A cache written before these seals existed is checked as far as its format allows, with a note saying what not.
Each finding is ``(shard or None, file or array or None, message)``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from kdcache.storage.backends.base import Backend, check_file, owner_of
from kdcache.storage.core.canonical import SEAL, is_sealed
from kdcache.storage.core.errors import KdcacheError
from kdcache.storage.core.stores import Store
from kdcache.storage.core.streams import token_offsets_name
from kdcache.storage.folders import TABLE, folder_is_complete, folder_names, read_table
from kdcache.storage.schema.manifest import (
    MANIFEST_NAME,
    MANIFEST_SEAL,
    Manifest,
    ShardRecord,
    load_sidecars,
    range_problem,
    shard_checksum,
    shard_name,
)

Finding = tuple[int | None, str | None, str]


def sidecar_records(store: Store, manifest: Manifest, findings: list[Finding]) -> dict[int, ShardRecord]:
    """Every readable sidecar's record; a damaged or unsealed one (in a sealed format) becomes a finding."""
    records = {}
    for name, record in load_sidecars(store):
        index = int(name[len("shard-"):-len(".json")])
        if isinstance(record, KdcacheError):
            findings.append((index, name, str(record)))
            continue
        if record.index != index:
            findings.append((index, name, f"index is {record.index}, but the file is named for shard {index}"))
            continue
        if manifest.format.sealed_index and SEAL not in record.extra:  # a sidecar's seal is in its extra (SIDECAR_SEAL)
            findings.append((index, name, "carries no crc32c, though this cache's format seals every sidecar "
                                          "(damaged)"))
        records[index] = record
    return records


def manifest_findings(raw: dict[str, Any], manifest: Manifest, sidecars: dict[int, ShardRecord]) -> list[Finding]:
    """The manifest's own seal, its totals, and its shard records against the sidecars.

    Args:
        raw: the JSON object ``manifest`` was read from (``load_manifest``, which has checked its seal if any).
    """
    findings: list[Finding] = []
    if manifest.format.sealed_index and not is_sealed(raw, MANIFEST_SEAL):
        findings.append((None, None, f"{MANIFEST_NAME} carries no crc32c, though it lists the cache's files "
                                     f"(damaged)"))
    totals = {"num_committed_shards": len(manifest.shards), "num_tokens": manifest.num_tokens}
    findings += [(None, None, f"{MANIFEST_NAME}: {key} is {raw.get(key)!r}, its shard records add up to {want}")
                 for key, want in totals.items() if raw.get(key) != want]
    if manifest.status == "complete" and len(manifest.shards) != manifest.spec.num_shards:
        findings.append((None, None, f"{MANIFEST_NAME} says complete but lists {len(manifest.shards)} of "
                                     f"{manifest.spec.num_shards} shards"))
    for record in manifest.shards:
        sidecar = sidecars.get(record.index)
        name = f"{shard_name(record.index)}.json"
        if sidecar is None:
            findings.append((record.index, name, f"is missing or unusable, though {MANIFEST_NAME} lists the shard"))
        elif asdict(sidecar) != asdict(record):
            fields = [k for k, v in asdict(record).items() if asdict(sidecar)[k] != v]
            findings.append((record.index, name, f"disagrees with {MANIFEST_NAME}'s record of the shard on "
                                                 f"{', '.join(fields)}"))
    return findings


def record_findings(record: ShardRecord, manifest: Manifest) -> list[Finding]:
    """A record against the spec and itself: range, bytes and the file-table summary (where the format has one)."""
    spec, index = manifest.spec, record.index
    findings: list[Finding] = []
    name = f"{shard_name(index)}.json"
    if problem := range_problem(record, spec):
        findings.append((index, name, problem))
    if not manifest.format.file_table:
        return findings
    files = record.extra["files"]
    if record.stored_bytes != sum(size for size, _ in files.values()):
        findings.append((index, name, f"stored_bytes is {record.stored_bytes}, its files hold "
                                      f"{sum(size for size, _ in files.values())}"))
    if record.decoded_bytes != sum(int(a.get("decoded_bytes", 0)) for a in record.arrays.values()):
        findings.append((index, name, f"decoded_bytes is {record.decoded_bytes}, its arrays add up to "
                                      f"{sum(int(a.get('decoded_bytes', 0)) for a in record.arrays.values())}"))
    if record.checksum != shard_checksum(files):
        findings.append((index, name, "its checksum does not summarise its file table"))
    return findings + array_findings(record, files)


def array_findings(record: ShardRecord, files: dict[str, list[int]]) -> list[Finding]:
    """Each array's byte counts against its shape and its own files (a zarr array owns its files; an Arrow
    column shares the shard's one file, so only its decoded size can be derived)."""
    findings: list[Finding] = []
    for array, info in sorted(record.arrays.items()):
        where = f"{shard_name(record.index)}.json"
        try:
            decoded = int(np.prod(info["shape"])) * np.dtype(info["dtype"]).itemsize
        except TypeError:  # a dtype numpy does not name: nothing to derive
            decoded = info["decoded_bytes"]
        if info["decoded_bytes"] != decoded:
            findings.append((record.index, where, f"{array}: decoded_bytes is {info['decoded_bytes']}, its shape "
                                                  f"{info['shape']} of {info['dtype']} holds {decoded}"))
        own = info.get("files", [])
        if own and all(owner_of(record, path) == array for path in own):
            stored = sum(files[path][0] for path in own if path in files)
            if info["stored_bytes"] != stored:
                findings.append((record.index, where, f"{array}: stored_bytes is {info['stored_bytes']}, its "
                                                      f"files hold {stored}"))
    return findings


def token_findings(store: Store, record: ShardRecord, manifest: Manifest, backend: Backend) -> list[Finding]:
    """``num_tokens`` and the sequence count against the shard's offsets (read from the data, checksums checked)."""
    spec, name = manifest.spec, f"{shard_name(record.index)}.json"
    handle = backend.open(store, record, spec)
    try:
        offsets = [handle.read(token_offsets_name(stream)) for stream in spec.streams]
    except Exception as exc:  # noqa: BLE001 - damaged data is reported by the backend's own check
        return [(record.index, None, f"cannot read its offsets: {type(exc).__name__}: {exc}")]
    tokens = sum(int(o[-1]) for o in offsets)
    findings: list[Finding] = []
    if tokens != record.num_tokens:
        findings.append((record.index, name, f"num_tokens is {record.num_tokens}, its offsets locate {tokens}"))
    for stream, edges in zip(spec.streams, offsets):
        ids = record.arrays.get(spec.ids_name(stream), {}).get("shape", [None])[0]
        if ids != int(edges[-1]):
            findings.append((record.index, name, f"{spec.ids_name(stream)} has shape {ids} rows, its offsets locate "
                                                 f"{int(edges[-1])}"))
    sequences = record.seq_stop - record.seq_start
    if any(len(o) != sequences + 1 for o in offsets):
        findings.append((record.index, name, f"covers {sequences} sequences, its offsets locate "
                                             f"{[len(o) - 1 for o in offsets]}"))
    return findings


def folder_findings(store: Store, manifest: Manifest) -> list[Finding]:
    """Every file beside the shards against ``manifest.json["files"]`` and its folder's table."""
    listed = manifest.files or {}
    findings: list[Finding] = [(None, path, message) for path, (size, crc) in sorted(listed.items())
                               if (message := check_file(store, path, size, crc, under=""))]
    for key in folder_names(store):
        if not folder_is_complete(store, key):
            findings.append((None, f"{key}/", f"{key}/ holds no file table ({TABLE}): its files are not covered "
                                               f"by a checksum"))
            continue
        try:
            table = read_table(store, key)
        except KdcacheError as exc:
            findings.append((None, f"{key}/{TABLE}", str(exc)))
            continue
        findings += _table_findings(store, manifest, key, table)
        extra = sorted(set(store.list(key)) - {TABLE} - {p.split("/", 1)[1] for p in table})
        findings += [(None, f"{key}/{n}", f"file {key}/{n} is not in its folder's table: no checksum covers it")
                     for n in extra]
    return findings


def _table_findings(store: Store, manifest: Manifest, key: str, table: dict[str, list[int]]) -> list[Finding]:
    """Folder ``key``'s table against the manifest's list of its files, or, while the shards are being written
    (the manifest lists the folders' files only once they are merged: a killed precompute's never does), each of
    its files against the table itself."""
    if manifest.status == "writing":
        return [(None, path, message) for path, (size, crc) in sorted(table.items())
                if (message := check_file(store, path, size, crc, under=""))]
    if table != {p: e for p, e in (manifest.files or {}).items() if p.startswith(f"{key}/")}:
        return [(None, f"{key}/{TABLE}", f"{key}/{TABLE} and {MANIFEST_NAME} list different files")]
    return []
