"""verify_cache: re-read and decode every chunk of every array of every committed shard.

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

from kdcache.storage.backends.registry import get_backend
from kdcache.storage.errors import KdcacheError
from kdcache.storage.hidden_codecs import decode
from kdcache.storage.manifest import Manifest, read_manifest, read_sidecars
from kdcache.storage.stores import Store, open_store


@dataclass
class VerifyProblem:
    """One finding: ``shard`` and ``array`` are None when the problem is cache-wide (e.g. the manifest)."""

    shard: int | None
    array: str | None
    message: str

    def __str__(self) -> str:
        where = [f"shard {self.shard}"] if self.shard is not None else []
        if self.array is not None:  # a path under shards/ names a file no single array owns (group metadata)
            where.append(f"{'file' if self.array.startswith('shard-') else 'array'} {self.array}")
        return f"{', '.join(where) or 'cache'}: {self.message}"


@dataclass
class VerifyReport:
    """What ``verify_cache`` found."""

    path: str
    status: str | None = None
    shards_checked: int = 0
    arrays_checked: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_arrays(self) -> list[tuple[int, str]]:
        """``(shard, array)`` of every damaged array."""
        return [(p.shard, p.array) for p in self.problems if p.shard is not None and p.array is not None]


def _check_shards(store: Store, manifest: Manifest, report: VerifyReport, sidecars: dict[int, Any]) -> None:
    backend = get_backend(manifest.spec.backend)
    records = {r.index: r for r in manifest.shards}
    records.update(sidecars)  # also check what a running or dead writer committed
    for index, record in sorted(records.items()):
        if not store.exists(record.path):
            report.problems.append(VerifyProblem(index, None, f"listed as committed but {store.url}/{record.path} "
                                                              f"is missing"))
            continue
        damage = backend.verify(store, record, manifest.spec)
        # Only intact bytes are worth decoding.
        found = damage or _decode_problems(store, record, manifest)
        report.problems += [VerifyProblem(index, array, message) for array, message in found]
        report.shards_checked += 1
        report.arrays_checked += len(record.arrays)


DECODED_RTOL = 1e-4  # float32 row sums made on a device against float64 sums of the numpy decode


def _decode_problems(store: Store, record: Any, manifest: Manifest) -> list[tuple[str, str]]:
    """Each coded array whose numpy decode's sum of squares differs from the recorded ``decoded_sq``."""
    spec, problems = manifest.spec, []
    coded = [name for name, err in record.lossy.items() if "decoded_sq" in err]
    if not coded:
        return []
    handle = get_backend(spec.backend).open(store, record, spec)
    for name in coded:
        arrays = {part: handle.read(part) for part in spec.with_parts(name)}
        got = float((decode(spec.hidden_codec, arrays, name).astype(np.float64) ** 2).sum())
        want = record.lossy[name]["decoded_sq"]
        if abs(got - want) > DECODED_RTOL * max(abs(want), 1e-30):
            problems.append((name, f"decodes to a sum of squares of {got:.6g}, recorded {want:.6g} when its error "
                                   f"was measured; the codes or scales do not decode as written"))
    return problems


def verify_cache(path: str | os.PathLike[str] | Store,
                 storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check every committed shard of the cache at ``path``.

    Returns:
        A report; ``report.ok`` is True only for a complete cache whose every chunk decodes and matches its
        checksum. A missing or corrupt manifest, or a partial cache, is reported, not raised.
    """
    store = open_store(path, storage_options)
    report = VerifyReport(store.url)
    try:
        manifest = read_manifest(store)
        report.status = manifest.status
        sidecars = read_sidecars(store) if manifest.status != "complete" else {}
        if manifest.status != "complete":
            report.problems.append(VerifyProblem(None, None, f"cache is not complete (status {manifest.status!r}, "
                                                             f"{len(sidecars)} of {manifest.spec.num_shards} "
                                                             f"shards committed)"))
        _check_shards(store, manifest, report, sidecars)
    except KdcacheError as exc:  # manifest or sidecar unreadable: a finding, never a crash
        report.problems.append(VerifyProblem(None, None, str(exc)))
    return report
