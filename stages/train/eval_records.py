"""Where evaluations live: ``RUN/evals/{role}@{cache label}.json``, one file per (student, cache).

Several evaluations of one run coexist (a held-out cache and the training cache, the trained student and its
untrained baseline), and each names what it measured: the cache's path, a label made of its folder name and a
hash of its fingerprints, and the sequences and tokens it covered. Nothing here imports torch, so reports and
sweeps read evaluations without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EVALS_DIR = "evals"
ROLES = ("trained", "baseline")  # the run's exported student, or another one scored with `eval --student`


def cache_label(path: str, fingerprints: Mapping[str, Any]) -> str:
    """``heldout-1a2b3c4d``: the cache folder's name and 8 hex digits of its fingerprints' hash."""
    from kdcache.storage.fingerprint import hash_json

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(path).rstrip("/").rsplit("/", 1)[-1]).strip("-") or "cache"
    return f"{name}-{hash_json(dict(fingerprints)).rsplit(':', 1)[-1][:8]}"


def eval_path(run_dir: str | Path, role: str, label: str) -> Path:
    """The file of one evaluation."""
    return Path(run_dir) / EVALS_DIR / f"{role}@{label}.json"


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable evaluation of a run, baseline before trained, by cache label."""
    records = []
    for path in sorted((Path(run_dir) / EVALS_DIR).glob("*@*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being written, or damaged: a report skips it
    return sorted(records, key=lambda r: (r.get("cache", {}).get("label", ""), r.get("role") != "baseline"))


def cache_identity(cache: str) -> str:
    """How an evaluation names its cache: a folder resolved to an absolute path, a URL as written."""
    from kdcache.storage.stores import is_url

    return str(cache) if is_url(cache) else str(Path(cache).resolve())


def same_cache(record: Mapping[str, Any], cache: str | None) -> bool:
    """Whether an evaluation was made against ``cache``."""
    return cache is None or record.get("cache", {}).get("path") == cache_identity(cache)


def find_eval(run_dir: str | Path, role: str = "trained", cache: str | None = None) -> dict[str, Any] | None:
    """The newest evaluation of ``role`` (against ``cache`` when given), or None."""
    found = [r for r in read_evals(run_dir) if r.get("role") == role and same_cache(r, cache)]
    return max(found, key=lambda r: r.get("written_at", ""), default=None)
