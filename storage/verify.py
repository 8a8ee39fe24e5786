"""verify_cache: check every file of a cache: every chunk of every array of every committed shard against its
checksums, and beyond those, the index files and the folders beside the shards:

- ``manifest.json`` and every sidecar carry their own crc32c (storage.core.canonical); the manifest's shard records must
  equal the sidecars, and its totals must equal their sums;
- each record agrees with itself and with the data: its range is the spec's range for its index (so the ranges
  tile the cache), ``num_tokens`` is the last value of its token offsets, ``stored_bytes`` the sum of its files'
  sizes, ``checksum`` the summary of its file table;
- every file under a folder beside the shards (tokenizer, teacher head) is listed in ``manifest.json["files"]``
  and its folder's table, and matches its size and crc32c.

A cache written before these seals existed is checked as far as its format allows, with a note saying what not.
Each finding is ``(shard or None, file or array or None, message)``.

Hidden states of a quantised codec are also decoded with the numpy reference (``storage.hidden_codecs``) and their
sum of squares compared with the one recorded at write time, so codes, scales and outliers that no longer make
the values the recorded error was measured on are found.

Unlike the reader, verify never raises for a damaged cache: it collects every problem, so one run tells the
user everything that is wrong (``kdcache verify`` prints them and exits 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kdcache.storage.backends.base import Backend, check_file, get_backend, owner_of
from kdcache.storage.core.canonical import SEAL, is_sealed
from kdcache.storage.core.errors import KdcacheError
from kdcache.storage.core.store_base import Store
from kdcache.storage.core.stores import open_store
from kdcache.storage.core.streams import token_offsets_name
from kdcache.storage.folders import CACHE_ENTRIES, TABLE, folder_is_complete, folder_names, read_table
from kdcache.storage.hidden_codecs import decode, projected
from kdcache.storage.projection import read_projection
from kdcache.storage.schema.manifest import (
    MANIFEST_NAME,
    MANIFEST_SEAL,
    Manifest,
    ShardRecord,
    load_manifest,
    load_sidecars,
    range_problem,
    shard_checksum,
    shard_name,
    sidecar_names,
)


@dataclass
class VerifyProblem:
    """One finding: ``shard`` and ``array`` are None when the problem is cache-wide (e.g. the manifest)."""

    shard: int | None
    array: str | None
    message: str

    def __str__(self) -> str:
        where = [f"shard {self.shard}"] if self.shard is not None else []
        if self.array is not None:  # a path names a file no single array owns (group metadata, a sidecar)
            # a file is a path with a dot or a folder; an array is a name such as hidden/2
            is_file = self.array.startswith("shard-") or "." in self.array or self.array.endswith("/")
            where.append(f"{'file' if is_file else 'array'} {self.array}")
        return f"{', '.join(where) or 'cache'}: {self.message}"


@dataclass
class VerifyReport:
    """What ``verify_cache`` found."""

    path: str
    status: str | None = None
    shards_checked: int = 0
    arrays_checked: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what an older cache's format cannot have checked

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_arrays(self) -> list[tuple[int, str]]:
        """``(shard, array)`` of every damaged array."""
        return [(p.shard, p.array) for p in self.problems if p.shard is not None and p.array is not None]


def _check_shards(store: Store, manifest: Manifest, report: VerifyReport, records: dict[int, ShardRecord]) -> None:
    backend = get_backend(manifest.spec, manifest.format)
    for index, record in sorted(records.items()):
        if not store.exists(record.path):
            report.problems.append(VerifyProblem(index, None, f"listed as committed but {store.url}/{record.path} "
                                                              f"is missing"))
            continue
        problems = [VerifyProblem(index, array, message) for array, message in backend.verify(store, record,
                                                                                              manifest.spec)]
        if not problems:  # intact files: their values can be held against the record
            problems = [VerifyProblem(*f) for f in token_findings(store, record, manifest, backend)]
            try:
                decoded = _decode_problems(store, record, manifest)
            except Exception as exc:  # noqa: BLE001 - whatever the damage, the rest of the cache is still checked
                decoded = [(None, f"cannot decode its coded hidden states: {type(exc).__name__}: {exc}")]
            problems += [VerifyProblem(index, name, message) for name, message in decoded]
        report.problems += problems
        report.shards_checked += 1
        report.arrays_checked += len(record.arrays)


DECODED_RTOL = 1e-4  # float32 row sums made on a device against float64 sums of the numpy decode


def _decode_problems(store: Store, record: ShardRecord, manifest: Manifest) -> list[tuple[str | None, str]]:
    """Each coded array whose numpy decode's sum of squares differs from the recorded ``decoded_sq`` (any failure,
    a record edited out of shape or arrays that do not fit each other, is one more finding: verify never raises)."""
    spec = manifest.spec
    problems: list[tuple[str | None, str]] = []
    coded = [name for name, err in record.lossy.items() if "decoded_sq" in err]
    if not coded:
        return []
    handle = get_backend(spec, manifest.format).open(store, record, spec)
    rank = spec.hidden_codec.rank  # a rank codec decodes through the cache's stored bases
    bases = read_projection(store, [n for n in coded if projected(spec.hidden_codec, n)], rank) if rank else None
    for name in coded:
        arrays = {part: handle.read(part) for part in spec.with_parts(name)}
        got = float((decode(spec.hidden_codec, arrays, name, bases).astype(np.float64) ** 2).sum())
        want = record.lossy[name]["decoded_sq"]
        if abs(got - want) > DECODED_RTOL * max(abs(want), 1e-30):
            problems.append((name, f"decodes to a sum of squares of {got:.6g}, recorded {want:.6g} when its error "
                                   f"was measured; the codes or scales do not decode as written"))
    return problems


def _check_index(store: Store, manifest: Manifest, raw: dict[str, Any],
                 report: VerifyReport) -> dict[int, ShardRecord]:
    """The manifest, the sidecars and the folders beside the shards; returns the shard records to check (the
    manifest's, plus whatever a running or dead writer committed since)."""
    findings: list[Finding] = []
    sidecars = sidecar_records(store, manifest, findings)
    findings += manifest_findings(raw, manifest, sidecars)
    records = {**sidecars, **{r.index: r for r in manifest.shards}}
    for record in records.values():
        try:
            findings += record_findings(record, manifest)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a record edited out of shape
            findings.append((record.index, f"shard-{record.index:06d}.json", f"malformed record: {exc!r}"))
    if manifest.format.sealed_index:
        findings += folder_findings(store, manifest)
    report.problems += [VerifyProblem(*finding) for finding in findings]
    # what a cache of an older format cannot have checked (storage.core.formats); None for a sealed cache
    report.notes += [note] if (note := manifest.format.note([f"{k}/" for k in folder_names(store)])) else []
    return records


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


def _stage_one_leftovers(store: Store) -> list[str]:
    """The entries of a folder holding nothing but what stage one writes before its manifest; [] otherwise."""
    names = sorted(store.list(""))
    return names if names and all(n in CACHE_ENTRIES or n.startswith(".") for n in names) else []


def _incomplete(manifest: Manifest, committed: int) -> str:
    """What an unfinished cache is, and how to finish it."""
    return (f"cache is not complete (status {manifest.status!r}, {committed} of {manifest.spec.num_shards} shards "
            f"committed): its precompute stopped (or is still running); rerun the same `kdcache precompute` command "
            f"to finish it, keeping the committed shards (`kdcache merge` joins a job array's parts)")


def verify_cache(path: str | os.PathLike[str] | Store,
                 storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check every file of the cache at ``path``.

    Returns:
        A report; ``report.ok`` is True only for a complete cache whose every file matches its checksum and whose
        index agrees with its data. A missing or corrupt manifest, or a partial cache, is reported, not raised;
        ``report.notes`` says what an older cache's format cannot have checked.
    """
    store = open_store(path, storage_options)
    report = VerifyReport(store.url)
    if store.size(MANIFEST_NAME) is None and (left := _stage_one_leftovers(store)):
        report.problems.append(VerifyProblem(None, None, f"no {MANIFEST_NAME} in {store.url}: a precompute stopped "
                                                         f"before writing it (the folder holds {', '.join(left)}); "
                                                         f"rerun the same `kdcache precompute` command"))
        return report
    try:
        manifest, raw = load_manifest(store)
        report.status = manifest.status
        if manifest.status != "complete":
            committed = len(sidecar_names(store))
            report.problems.append(VerifyProblem(None, None, _incomplete(manifest, committed)))
        _check_shards(store, manifest, report, _check_index(store, manifest, raw, report))
    except KdcacheError as exc:  # manifest unreadable: a finding, never a crash
        report.problems.append(VerifyProblem(None, None, str(exc)))
    return report
