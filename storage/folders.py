"""Folders a cache carries beside its shards (the tokenizer, a teacher head), each with a table of its files.

A folder is written whole from bytes in memory (``Store.put_folder``) with a sealed table,
``{key}/.kdcache-files.json`` = ``{"files": {name: [size, crc32c]}}``, taken from those same bytes and landing
last: the table is the folder's commit point, as a sidecar is a shard's. ``merge_parts`` copies every table into
``manifest.json["files"]`` (``{"tokenizer/tokenizer.json": [size, crc32c], ...}``), and ``verify`` checks each
listed file, each table against the manifest, and that a folder holds nothing its table does not list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdcache.storage.core.canonical import canonical_json, is_sealed, seal_problem, sealed
from kdcache.storage.core.errors import ManifestError
from kdcache.storage.core.files import crc32c, write_bytes_atomic
from kdcache.storage.core.store_base import Store
from kdcache.storage.schema.manifest import MANIFEST_NAME, SHARDS_DIR, read_json

TABLE = ".kdcache-files.json"
# Stage one's rows (tokenized data, memory-mapped by its ranks) live outside every cache, in one rows folder
# (stages.precompute.rows.row_store.rows_root); caches written before that may still hold a rows/ folder, never read.
ROWS_DIR = "rows"
_NOT_FOLDERS = {SHARDS_DIR, "locks", MANIFEST_NAME, ROWS_DIR}
# The folders stage one writes (its teacher head is stages.targets.logits.teacher_head.HEAD_FOLDER): with the entries
# above, all that a killed first run may leave in a new cache folder before its manifest exists.
# texts: stages.common.cache_texts; draft: stages.targets.draft.draft_inputs.DRAFT_FOLDER
STAGE_ONE_FOLDERS = ("tokenizer", "teacher_head", "projection", "texts", "draft")
CACHE_ENTRIES = frozenset({*_NOT_FOLDERS, *STAGE_ONE_FOLDERS})


def put_folder(store: Store, key: str, source: Path) -> None:
    """Copy the local folder ``source`` (flat, e.g. a saved tokenizer) to ``key`` with its file table; a complete
    ``key`` already there (a resumed run, another rank) is kept."""
    if folder_is_complete(store, key):
        return
    put_files(store, key, {path.name: path.read_bytes() for path in sorted(source.iterdir()) if path.is_file()})


def put_files(store: Store, key: str, files: dict[str, bytes]) -> None:
    """Write folder ``key`` from ``files`` (name -> bytes) with its file table, landing last; a complete ``key``
    already there is kept (``Store.put_folder``)."""
    table = {"files": {name: [len(data), crc32c(data)] for name, data in files.items()}}
    store.put_folder(key, {**files, TABLE: canonical_json(sealed(table))}, TABLE)


def folder_is_complete(store: Store, key: str) -> bool:
    """Whether folder ``key`` was written whole (its table landed)."""
    return store.size(f"{key}/{TABLE}") is not None


def folder_names(store: Store) -> list[str]:
    """Top-level entries of the cache other than the shards, the locks and the manifest (hidden temps too)."""
    return sorted(n for n in store.list("") if n not in _NOT_FOLDERS and not n.startswith("."))


def read_table(store: Store, key: str) -> dict[str, list[int]]:
    """Folder ``key``'s table as manifest entries ``{"key/name": [size, crc32c]}``, its seal checked.

    Raises:
        ManifestError: the table is missing, damaged or malformed.
    """
    data = read_json(store, f"{key}/{TABLE}", f"the file table of {key}/", ())
    files = data.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"the file table of {key}/ at {store.url}/{key}/{TABLE} holds no 'files' object")
    return {f"{key}/{name}": entry for name, entry in files.items()}


def folder_tables(store: Store) -> dict[str, list[int]]:
    """Every complete folder's entries, for ``manifest.json["files"]``."""
    files: dict[str, list[int]] = {}
    for key in folder_names(store):
        if folder_is_complete(store, key):
            files.update(read_table(store, key))
    return files


# ---- local folders too large to hold in memory (stage one's row tables) ------------------------------------------
_BLOCK = 16 << 20  # bytes read at a time when checksumming a large file


def file_entry(path: Path) -> list[int]:
    """``[size, crc32c]`` of a local file, read a block at a time (a row table may not fit in memory)."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            crc, size = crc32c(block, crc), size + len(block)
    return [size, crc]


def seal_local_folder(folder: Path, extra: dict[str, Any] | None = None) -> None:
    """Write ``folder``'s file table (``TABLE``: every file's ``[size, crc32c]``, plus ``extra``), sealed, last:
    the same table and seal as ``put_files`` gives a cache's folders, for a folder written file by file."""
    files = {p.name: file_entry(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != TABLE}
    write_bytes_atomic(folder / TABLE, canonical_json(sealed({"files": files, **(extra or {})})))


def read_local_table(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``folder``'s file table if intact (seal checked), else ``(None, what is wrong with it)``."""
    try:
        raw = (folder / TABLE).read_bytes()
        table = json.loads(raw)
    except FileNotFoundError:
        return None, f"{TABLE} is missing"
    except (OSError, ValueError) as exc:
        return None, f"{TABLE} is unreadable ({exc})"
    if not isinstance(table, dict) or not isinstance(table.get("files"), dict) or not is_sealed(table):
        return None, f"{TABLE} is not a sealed file table"
    problem = seal_problem(raw, table)
    return (None, f"{TABLE}: {problem}") if problem else (table, None)


def local_folder_problems(folder: Path) -> list[str]:
    """What is wrong with a folder sealed by ``seal_local_folder``: its table, each listed file's size and crc32c,
    and files its table does not list; empty when every byte is as written."""
    table, problem = read_local_table(folder)
    if table is None:
        return [problem or f"{TABLE} is damaged"]
    problems = []
    for name, entry in sorted(table["files"].items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_entry(path) != list(entry):
            problems.append(f"{name} does not match its size and crc32c (damaged)")
    listed = set(table["files"]) | {TABLE}
    problems += [f"{p.name} is not in the folder's table" for p in sorted(folder.iterdir()) if p.name not in listed]
    return problems
