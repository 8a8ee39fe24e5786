"""The bytes of a cache's shard files (data and sidecars) and of the folders beside them, from a folder or a
bucket alike: what two runs with the same inputs must write identically (docs/cache-format.md)."""

from __future__ import annotations

from pathlib import Path

from kdcache.storage.core.stores import RemoteStore, open_store

FOLDERS = ("shards", "tokenizer", "teacher_head")


def cache_files(where: str | Path) -> dict[str, bytes]:
    """Every file or object under ``shards/``, ``tokenizer/`` and ``teacher_head/``, by key."""
    store = open_store(where)
    if isinstance(store, RemoteStore):
        keys = [key[len(store.root) + 1:] for top in FOLDERS for key in store.fs.find(f"{store.root}/{top}")]
    else:
        root = Path(where)
        keys = [p.relative_to(root).as_posix() for top in FOLDERS for p in (root / top).rglob("*") if p.is_file()]
    return {key: store.read(key) for key in sorted(keys)}
