"""verify_cache: check every file of a cache: every chunk of every array of every committed shard against its
checksums, and the index files and folders beside the shards (storage.crosscheck).

Hidden states of a quantised codec are also decoded with the numpy reference (``storage.hidden_codecs``) and their
sum of squares compared with the one recorded at write time, so codes, scales and outliers that no longer make
the values the recorded error was measured on are found.

Unlike the reader, verify never raises for a damaged cache: it collects every problem, so one run tells the
user everything that is wrong (``kdcache verify`` prints them and exits 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdcache.storage import crosscheck
from kdcache.storage.backends.base import get_backend
from kdcache.storage.core.errors import KdcacheError
from kdcache.storage.core.stores import Store, open_store
from kdcache.storage.folders import CACHE_ENTRIES, folder_names
from kdcache.storage.hidden_codecs import decode, projected
from kdcache.storage.projection import read_projection
from kdcache.storage.schema.manifest import MANIFEST_NAME, Manifest, ShardRecord, load_manifest, sidecar_names


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
            problems = [VerifyProblem(*f) for f in crosscheck.token_findings(store, record, manifest, backend)]
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
    findings: list[crosscheck.Finding] = []
    sidecars = crosscheck.sidecar_records(store, manifest, findings)
    findings += crosscheck.manifest_findings(raw, manifest, sidecars)
    records = {**sidecars, **{r.index: r for r in manifest.shards}}
    for record in records.values():
        try:
            findings += crosscheck.record_findings(record, manifest)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a record edited out of shape
            findings.append((record.index, f"shard-{record.index:06d}.json", f"malformed record: {exc!r}"))
    if manifest.format.sealed_index:
        findings += crosscheck.folder_findings(store, manifest)
    report.problems += [VerifyProblem(*finding) for finding in findings]
    # what a cache of an older format cannot have checked (storage.core.formats); None for a sealed cache
    report.notes += [note] if (note := manifest.format.note([f"{k}/" for k in folder_names(store)])) else []
    return records


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
