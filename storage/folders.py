"""Folders a cache carries beside its shards (the tokenizer, a teacher head), each with a table of its files.

A folder is written whole from bytes in memory (``Store.put_folder``) with a sealed table,
``{key}/.kdcache-files.json`` = ``{"files": {name: [size, crc32c]}}``, taken from those same bytes and landing
last: the table is the folder's commit point, as a sidecar is a shard's. ``merge_parts`` copies every table into
``manifest.json["files"]`` (``{"tokenizer/tokenizer.json": [size, crc32c], ...}``), and ``verify`` checks each
listed file, each table against the manifest, and that a folder holds nothing its table does not list.
"""

from __future__ import annotations

from pathlib import Path

from kdcache.storage.canonical import canonical_json, sealed
from kdcache.storage.files import crc32c
from kdcache.storage.manifest import MANIFEST_NAME, SHARDS_DIR, read_json
from kdcache.storage.stores import Store

TABLE = ".kdcache-files.json"
# Stage one's rows (tokenized data, built once per cache and memory-mapped by its ranks) live beside the cache in
# a local folder, but are a cache of the data, not part of the cache: nothing reads them from a cache.
ROWS_DIR = "rows"
_NOT_FOLDERS = {SHARDS_DIR, "locks", MANIFEST_NAME, ROWS_DIR}
# The folders stage one writes (its teacher head is stages.common.teacher_head.HEAD_FOLDER): with the entries
# above, all that a killed first run may leave in a new cache folder before its manifest exists.
STAGE_ONE_FOLDERS = ("tokenizer", "teacher_head", "projection")
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
        from kdcache.storage.errors import ManifestError

        raise ManifestError(f"the file table of {key}/ at {store.url}/{key}/{TABLE} holds no 'files' object")
    return {f"{key}/{name}": entry for name, entry in files.items()}


def folder_tables(store: Store) -> dict[str, list[int]]:
    """Every complete folder's entries, for ``manifest.json["files"]``."""
    files: dict[str, list[int]] = {}
    for key in folder_names(store):
        if folder_is_complete(store, key):
            files.update(read_table(store, key))
    return files
