"""One serialisation for every JSON file a cache writes, and the crc32c seal its small index files carry.

Canonical JSON (sorted keys, one line with fixed separators, ASCII, a trailing newline) makes the same
values the same bytes whatever order a dict was filled in (arrays packed concurrently, a resumed run, a bucket),
so two caches of the same inputs compare, deduplicate and content-address by their bytes.

A *seal* is the crc32c of the canonical bytes of a JSON object without its seal, stored in the object itself
(at ``SEAL``, or in a nested object such as a sidecar's ``extra``). Checking it needs nothing else: the file's
bytes must be the canonical form of what they parse to (so a flipped bit in the layout is seen) and the seal must
match the rest (so a flipped bit in a value is seen).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from kdcache.storage.core.files import crc32c

SEAL = "crc32c"


def canonical_json(obj: object) -> bytes:
    """The canonical bytes of a JSON value: sorted keys, one line, ``", "`` / ``": "``, ASCII, ending in a newline.

    No indent: with one, ``json`` falls back to its pure-Python encoder, ~3x slower on a large manifest.
    """
    return (json.dumps(obj, sort_keys=True, separators=(", ", ": "), ensure_ascii=True) + "\n").encode()


def _holder(obj: dict[str, Any], at: tuple[str, ...]) -> dict[str, Any] | None:
    """The object inside ``obj`` that holds the seal (``obj`` itself for ``at=()``); None if it is not there."""
    for key in at:
        obj = obj.get(key)  # type: ignore[assignment]
        if not isinstance(obj, dict):
            return None
    return obj


def sealed(obj: dict[str, Any], at: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of ``obj`` carrying its seal at ``at`` (the holder object must exist)."""
    out = copy.deepcopy(obj)
    holder = _holder(out, at)
    if holder is None:
        raise ValueError(f"no object at {'.'.join(at)} to hold the seal")
    holder.pop(SEAL, None)
    holder[SEAL] = crc32c(canonical_json(out))
    return out


def is_sealed(obj: dict[str, Any], at: tuple[str, ...] = ()) -> bool:
    """Whether ``obj`` carries a seal at ``at`` (files written before seals existed carry none)."""
    holder = _holder(obj, at)
    return holder is not None and SEAL in holder


def seal_problem(raw: bytes, obj: dict[str, Any], at: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a sealed file's bytes ``raw`` (parsed: ``obj``); None when it is intact.

    An unsealed object is not checked here (``is_sealed`` tells the caller which case it is in).
    """
    if not is_sealed(obj, at):
        return None
    if canonical_json(obj) != raw:
        return "its bytes are not the canonical JSON of what they hold (damaged)"
    holder: dict[str, Any] = _holder(obj, at)  # type: ignore[assignment]  # is_sealed: it holds the seal
    seal = holder.pop(SEAL)  # taken out and put back: no copy of a large manifest
    try:
        intact = crc32c(canonical_json(obj)) == seal
    finally:
        holder[SEAL] = seal
    return None if intact else "it does not match the crc32c it carries (damaged or edited)"
