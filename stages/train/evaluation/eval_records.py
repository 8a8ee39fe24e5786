"""Where evaluations live: ``RUN/evals/{role}@{cache label}.json``, one file per (student, cache).

Several evaluations of one run coexist (a held-out cache and the training cache, the trained student and its
untrained baseline), and each names what it measured: the cache's path, a label made of its folder name and a
hash of its fingerprints, and the sequences and tokens it covered. Nothing here imports torch, so reports and
sweeps read evaluations without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kdcache.storage import hash_json, is_url, read_json_object

EVALS_DIR = "evals"


def cache_label(path: str, fingerprints: Mapping[str, Any]) -> str:
    """``heldout-1a2b3c4d``: the cache folder's name and 8 hex digits of its fingerprints' hash."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(path).rstrip("/").rsplit("/", 1)[-1]).strip("-") or "cache"
    return f"{name}-{hash_json(dict(fingerprints)).rsplit(':', 1)[-1][:8]}"


def eval_path(run_dir: str | Path, role: str, label: str) -> Path:
    """The file of one evaluation."""
    return Path(run_dir) / EVALS_DIR / f"{role}@{label}.json"


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable evaluation of a run, baseline before trained, by cache label."""
    # Being written or damaged (not an object, no cache record): a report skips it.
    records = [read_json_object(p) for p in sorted((Path(run_dir) / EVALS_DIR).glob("*@*.json"))]
    records = [r for r in records if r and isinstance(r.get("cache", {}), dict)]
    return sorted(records, key=lambda r: (r.get("cache", {}).get("label", ""), r.get("role") != "baseline"))


def cache_identity(cache: str) -> str:
    """How an evaluation names its cache: a folder resolved to an absolute path, a URL as written."""
    return str(cache) if is_url(cache) else str(Path(cache).resolve())


def same_cache(record: Mapping[str, Any], cache: str | None) -> bool:
    """Whether an evaluation was made against ``cache``."""
    return cache is None or record.get("cache", {}).get("path") == cache_identity(cache)


def find_eval(run_dir: str | Path, role: str = "trained", cache: str | None = None) -> dict[str, Any] | None:
    """The newest evaluation of ``role`` (against ``cache`` when given), or None."""
    return newest(read_evals(run_dir), role, cache)


def newest(records: list[dict[str, Any]], role: str, cache: str | None = None) -> dict[str, Any] | None:
    """The newest of ``records`` with ``role`` (against ``cache`` when given), or None."""
    found = [r for r in records if r.get("role") == role and same_cache(r, cache)]
    return max(found, key=lambda r: r.get("written_at", ""), default=None)


def remove_evals(run_dir: str | Path, role: str, cache: str) -> None:
    """Delete the evaluations of ``role`` against ``cache`` (before scoring a retrained student again)."""
    for path in (Path(run_dir) / EVALS_DIR).glob(f"{role}@*.json"):
        if same_cache(read_json_object(path), cache):
            path.unlink(missing_ok=True)


def alignment_panels(evaluation: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """An evaluation's CKA results by stream: every stack of a two-stream cache, or the one stream's (key "")."""
    if evaluation.get("cka_streams"):
        return dict(evaluation["cka_streams"])
    return {"": evaluation["cka"]} if evaluation.get("cka") else {}
