"""manifest.json and shard sidecars: the cache's index, always written atomically and last.

Commit protocol (see storage/writer.py): a shard's data is renamed into place, then its small sidecar
``shards/shard-NNNNNN.json`` is written; the sidecar is the commit point. ``finalize`` merges every sidecar into
``manifest.json``. So the manifest never lists a shard whose bytes are not durable on disk.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from kdcache.storage.core.canonical import SEAL, seal_problem, sealed
from kdcache.storage.core.errors import KdcacheError, ManifestError
from kdcache.storage.core.formats import FORMAT_VERSION, CacheFormat, cache_format, read_format
from kdcache.storage.core.store_base import Store
from kdcache.storage.core.stores import open_store
from kdcache.storage.schema.spec import CacheSpec

MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
STATUSES = ("writing", "partial", "complete")
_SIDECAR = re.compile(r"shard-\d+\.json")
MANIFEST_SEAL: tuple[str, ...] = ()  # where each index file keeps its own crc32c (storage.core.canonical)
SIDECAR_SEAL = ("extra",)  # inside ``extra``, which every ShardRecord has, so older readers still load sidecars


def shard_name(index: int) -> str:
    """Base name of shard ``index``: ``shard-000007``."""
    return f"shard-{index:06d}"


def sidecar_key(index: int) -> str:
    """Key of shard ``index``'s commit sidecar, relative to the cache root."""
    return f"{SHARDS_DIR}/{shard_name(index)}.json"


def now() -> str:
    """UTC timestamp, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load_json(store: Store, key: str, what: str) -> tuple[bytes, dict[str, Any]]:
    """A JSON object's bytes and value from the store, turning absence or corruption into ManifestError."""
    where = f"{store.url}/{key}"
    try:
        raw = store.read(key)
        data = json.loads(raw)
    except FileNotFoundError:
        raise ManifestError(f"{what} not found at {where}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{what} at {where} is corrupt (not valid JSON: {exc})") from None
    except OSError as exc:  # a folder in its place, no permission
        raise ManifestError(f"{what} at {where} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{what} at {where} is corrupt: expected a JSON object, got {type(data).__name__}")
    return raw, data


def check_seal(raw: bytes, data: dict[str, Any], seal: tuple[str, ...], what: str) -> None:
    """Raise ManifestError naming ``what`` when a sealed object's bytes do not match its seal
    (storage.core.canonical)."""
    problem = seal_problem(raw, data, seal)
    if problem:
        raise ManifestError(f"{what} is corrupt: {problem}")


def read_json(store: Store, key: str, what: str, seal: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Load a JSON object from the store, turning absence or corruption into ManifestError.

    ``seal``: where the object keeps its own crc32c, checked when it carries one (storage.core.canonical).
    """
    raw, data = load_json(store, key, what)
    if seal is not None:
        check_seal(raw, data, seal, f"{what} at {store.url}/{key}")
    return data


@dataclass
class ShardRecord:
    """One committed shard.

    ``arrays`` maps array name -> ``{"shape", "dtype", "stored_bytes", "decoded_bytes", "files"}`` plus the
    backend's per-array checksum; ``extra["files"]`` maps every file of the shard (relative to ``shards/``) to
    ``[size, crc32c]`` taken from the bytes in memory at write time (format 3); ``checksum`` summarises that table.
    Format 1-2 records hold a zlib ``crc32`` per array instead (read-only).
    """

    index: int
    seq_start: int
    seq_stop: int
    num_tokens: int
    path: str
    stored_bytes: int
    decoded_bytes: int
    checksum: str
    arrays: dict[str, dict[str, Any]]
    lossy: dict[str, dict[str, float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardRecord:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ManifestError(f"corrupt shard record {str(data)[:200]}: {exc}") from None


def shard_checksum(files: dict[str, list[int]]) -> str:
    """One crc32 over a shard's file table (sorted ``path=size:crc32c``), as ``crc32:xxxxxxxx``.

    A summary for humans and for comparing two caches; the per-file entries are what readers check.
    """
    text = ",".join(f"{path}={size}:{crc}" for path, (size, crc) in sorted(files.items()))
    return f"crc32:{zlib.crc32(text.encode()):08x}"


@dataclass
class Manifest:
    """The cache index. ``shards`` lists committed shards in index order."""

    spec: CacheSpec
    fingerprints: dict[str, Any]
    status: str = "writing"
    format_version: int = FORMAT_VERSION  # a cache read from disk keeps the version it was written in
    shards: list[ShardRecord] = field(default_factory=list)
    arrays: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_at: str = field(default_factory=now)
    updated_at: str = field(default_factory=now)
    # Files beside the shards (tokenizer, teacher head): ``{path: [size, crc32c]}`` (storage.folders). None: a
    # cache written before kdcache listed them, whose index files carry no crc32c either.
    files: dict[str, list[int]] | None = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Valid tokens in committed shards."""
        return sum(s.num_tokens for s in self.shards)

    @property
    def committed(self) -> list[int]:
        return [s.index for s in self.shards]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "kdcache", "format_version": self.format_version, "status": self.status,
            "created_at": self.created_at, "updated_at": self.updated_at,
            "num_sequences": self.spec.num_sequences, "num_shards": self.spec.num_shards,
            "num_committed_shards": len(self.shards), "num_tokens": self.num_tokens,
            "spec": self.spec.to_dict(), "fingerprints": self.fingerprints, "arrays": self.arrays,
            "shards": [asdict(s) for s in self.shards], **({} if self.files is None else {"files": self.files}),
        }

    @property
    def format(self) -> CacheFormat:
        """This cache's format as a reader sees it (storage.core.formats): what its bytes let a reader check."""
        return cache_format(self.format_version, self.files is not None)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest.json") -> Manifest:
        version = read_format(data, where).version  # an older format reads as the current structures
        if data.get("status") not in STATUSES:
            raise ManifestError(f"{where} has status {data.get('status')!r}; expected one of {list(STATUSES)}")
        try:
            spec = CacheSpec.from_dict(data["spec"])
            shards = [ShardRecord.from_dict(s) for s in data["shards"]]
            files = data.get("files")
            if files is not None and not isinstance(files, dict):
                raise TypeError(f"'files' is a {type(files).__name__}, expected an object")
            return cls(spec, data["fingerprints"], data["status"], version, shards, data.get("arrays", {}),
                       data.get("created_at", ""), data.get("updated_at", ""), files)
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{where} is corrupt: missing or malformed field {exc}") from None


def read_manifest(root: str | os.PathLike[str] | Store) -> Manifest:
    """Read ``manifest.json`` of the cache at a path, URL or store.

    Raises:
        ManifestError: missing or corrupt; FormatVersionError: written by a newer format.
    """
    return load_manifest(open_store(root))[0]


def load_manifest(store: Store) -> tuple[Manifest, dict[str, Any]]:
    """``read_manifest``, with the JSON object it was read from (its totals and seal, for ``verify``)."""
    if store.size(MANIFEST_NAME) is None:
        raise ManifestError(f"no {MANIFEST_NAME} in {store.url}: not a kdcache cache, or its writer never started")
    where = f"{store.url}/{MANIFEST_NAME}"
    raw, data = load_json(store, MANIFEST_NAME, MANIFEST_NAME)
    manifest = Manifest.from_dict(data, where)  # a newer format is refused as such, before its seal is read
    check_seal(raw, data, MANIFEST_SEAL, f"{MANIFEST_NAME} at {where}")
    return manifest, data


def write_manifest(root: str | os.PathLike[str] | Store, manifest: Manifest) -> None:
    """Atomically (re)write ``manifest.json``, canonical and sealed."""
    manifest.updated_at = now()
    open_store(root).put_json(MANIFEST_NAME, sealed(manifest.to_dict(), MANIFEST_SEAL))


def write_sidecar(store: Store, record: ShardRecord) -> None:
    """Write shard ``record``'s commit sidecar, sealed; ``record.extra`` gains the seal, as the manifest lists it."""
    data = sealed(asdict(record), SIDECAR_SEAL)
    record.extra[SEAL] = data["extra"][SEAL]
    store.put_json(sidecar_key(record.index), data)


def read_sidecars(root: str | os.PathLike[str] | Store) -> dict[int, ShardRecord]:
    """Every committed shard's record, from the sidecars under ``shards/`` (fetched in parallel).

    Raises:
        ManifestError: a sidecar is unreadable, damaged or malformed.
    """
    records = {}
    for _, loaded in load_sidecars(open_store(root)):
        if isinstance(loaded, KdcacheError):
            raise loaded
        records[loaded.index] = loaded
    return records


def sidecar_names(store: Store) -> list[str]:
    """The sidecar files under ``shards/`` (``shard-000007.json``...), sorted."""
    return sorted(n for n in store.list(SHARDS_DIR) if _SIDECAR.fullmatch(n))


def load_sidecars(store: Store) -> list[tuple[str, ShardRecord | KdcacheError]]:
    """Each sidecar's name and record, or the error that reading it raised (``verify`` reports every one), fetched
    in parallel: on an object store each is a GET."""
    def load(name: str) -> ShardRecord | KdcacheError:
        try:
            return ShardRecord.from_dict(read_json(store, f"{SHARDS_DIR}/{name}", "shard sidecar", SIDECAR_SEAL))
        except KdcacheError as exc:
            return exc

    names = sidecar_names(store)
    with ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
        return list(zip(names, pool.map(load, names)))


def range_problem(record: ShardRecord, spec: CacheSpec) -> str | None:
    """What is wrong with a record's index and sequence range for ``spec`` (they tile the cache), or None."""
    index = record.index
    if 0 <= index < spec.num_shards and (record.seq_start, record.seq_stop) == spec.shard_range(index):
        return None
    want = list(spec.shard_range(index)) if 0 <= index < spec.num_shards else \
        f"nothing (its shards are 0..{spec.num_shards - 1})"
    return (f"seq_start, seq_stop are [{record.seq_start}, {record.seq_stop}), but shard {index} of this cache "
            f"covers {want}")


def summarize_arrays(spec: CacheSpec, records: list[ShardRecord]) -> dict[str, dict[str, Any]]:
    """Per-array totals over committed shards: dtype, trailing shape, codec, bytes, worst lossy error.

    Raises:
        ManifestError: two shards disagree on an array's dtype or trailing shape (e.g. hidden size).
    """
    summary: dict[str, dict[str, Any]] = {}
    for record in records:
        for name, info in record.arrays.items():
            entry = summary.setdefault(name, {"dtype": info["dtype"], "shape_tail": info["shape"][1:],
                                              "codec": spec.codec_for(name), "stored_bytes": 0, "decoded_bytes": 0})
            if (entry["dtype"], entry["shape_tail"]) != (info["dtype"], info["shape"][1:]):
                raise ManifestError(f"shard {record.index} stores {name} as {info['dtype']} {info['shape'][1:]}, "
                                    f"other shards as {entry['dtype']} {entry['shape_tail']}")
            entry["stored_bytes"] += info["stored_bytes"]
            entry["decoded_bytes"] += info["decoded_bytes"]
        for name, err in record.lossy.items():
            worst = summary[name].get("lossy")
            if worst is None:
                summary[name]["lossy"] = dict(err)
                continue
            for key in set(err) & {"max_abs_error", "max_rel_error", "rel_rms_error"}:
                worst[key] = max(worst[key], err[key])
            for key in set(err) & {"kept_mass_mean", "kept_mass_p5", "kept_mass_min"}:  # the worst shard's
                worst[key] = min(worst.get(key, err[key]), err[key])
            if "worst_row_cosine" in err:  # a hidden codec: the worst shard's figures, the decoded energy summed
                worst["worst_row_cosine"] = min(worst["worst_row_cosine"], err["worst_row_cosine"])
                worst["decoded_sq"] += err["decoded_sq"]
            if "clipped" in err:  # quantised log-probs below the range: counted over the shards
                worst["clipped"] += err["clipped"]
    return summary


def cache_exists(path: str | os.PathLike[str] | Store) -> bool:
    """Whether a ``manifest.json`` is at ``path`` (a folder, a URL or a store)."""
    return open_store(path).size(MANIFEST_NAME) is not None
