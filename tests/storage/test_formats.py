"""storage.core.formats, the one old-format adapter: older caches read as the current structures, and no other file of
pipeline/, stages/ or storage/ compares a format version."""

from __future__ import annotations

import ast
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import pytest
import zarr

from kdcache.storage import CacheReader, CacheSpec, CacheWriter, verify_cache
from kdcache.storage.core.canonical import canonical_json, sealed
from kdcache.storage.core.errors import FormatVersionError
from kdcache.storage.core.formats import FILE_TABLE, SEALED_INDEX, WRITABLE, CacheFormat
from kdcache.storage.schema.manifest import MANIFEST_SEAL
from tests.storage._cache_data import FINGERPRINTS, make_sequences

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
ADAPTER = Path("storage") / "core" / "formats.py"
# crc32 over every sequence's arrays (name, dtype, shape, bytes, in name order) as CacheReader returned them
# before storage.core.formats existed (commit 88158b7): the adapter must hand back the same values.
BEFORE = {"format1": "674fcba4", "format2-seq2seq": "5ca7d803"}


def digest(reader: CacheReader) -> str:
    crc = 0
    for sequence in reader.iter_sequences():
        for name in sorted(sequence):
            array = np.ascontiguousarray(sequence[name])
            crc = zlib.crc32(array.tobytes(), zlib.crc32(f"{name}:{array.dtype}:{array.shape}".encode(), crc))
    return f"{crc:08x}"


def plain_arrays(cache: Path, backend: str, shard: int) -> dict[str, np.ndarray]:
    """A format 1-2 shard's stored arrays, opened with zarr or pyarrow alone (no kdcache code)."""
    if backend == "zarr":
        group = zarr.open_group(str(cache / "shards" / f"shard-{shard:06d}"), mode="r")
        return {name: np.asarray(group[name][:]) for name in group.attrs["array_names"]}
    table = ipc.open_file(str(cache / "shards" / f"shard-{shard:06d}.arrow")).read_all()
    out = {}
    for name in table.column_names:
        inner = table.column(name).combine_chunks().flatten()
        width = getattr(inner.type, "list_size", None)
        out[name] = inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, width) if width else \
            inner.to_numpy(zero_copy_only=False)
    return out


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
@pytest.mark.parametrize("version, folder", [(1, "format1"), (2, "format2-seq2seq")])
def test_format1_and_2_caches_read_as_before(version: int, folder: str, backend: str, tmp_path: Path) -> None:
    source = DATA / folder / f"cache-{backend}"
    raw = json.loads((source / "manifest.json").read_text())
    reader = CacheReader(source)
    assert reader.manifest.format == CacheFormat(version, frozenset())  # no file table, no seals, read-only
    assert reader.spec == CacheSpec.from_dict(raw["spec"]) and reader.spec.backend == backend
    assert reader.spec.streams == (("encoder", "decoder") if version == 2 else ("",))
    assert digest(reader) == BEFORE[folder]
    for record in reader.records:
        shard = reader.read_shard(record.index)
        for name, stored in plain_arrays(source, backend, record.index).items():
            got = shard.arrays.get(name, shard.all_offsets.get(name))
            assert got is not None, name
            np.testing.assert_array_equal(got, stored, err_msg=f"shard {record.index} {name}")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    with pytest.raises(FormatVersionError, match=f"format {version} cache.*cannot add shards"):
        CacheWriter(copy, reader.spec, reader.fingerprints)


def as_format3(cache: Path) -> None:
    """Relabel a cache without token arrays as format 3 (which differs from 4 only by them), resealing manifest.json
    as a format-3 writer would have."""
    data = json.loads((cache / "manifest.json").read_text())
    assert "token_arrays" not in data["spec"]
    data["format_version"] = 3
    (cache / "manifest.json").write_bytes(canonical_json(sealed(data, MANIFEST_SEAL)))


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
def test_a_format3_cache_reads_checks_and_refuses_writes(backend: str, tmp_path: Path) -> None:
    spec = CacheSpec(num_sequences=5, backend=backend, hidden_layers=(0, 2), attention_layers=(1,), logits="topk",
                     top_k=3, vocab_size=300, sequences_per_shard=2)
    sequences = make_sequences(spec, [3, 5, 2, 4, 6])
    with CacheWriter(tmp_path / "cache", spec, FINGERPRINTS) as writer:
        for k in range(spec.num_shards):
            writer.write_shard(k, sequences[2 * k: 2 * k + 2])
        writer.finalize()
    current = digest(CacheReader(tmp_path / "cache"))
    as_format3(tmp_path / "cache")
    reader = CacheReader(tmp_path / "cache")
    assert reader.manifest.format_version == 3 and reader.spec == spec
    assert reader.manifest.format.features == {FILE_TABLE, SEALED_INDEX}  # read-only: not WRITABLE
    assert digest(reader) == current
    report = verify_cache(tmp_path / "cache")
    assert report.ok and not report.notes, (report.problems, report.notes)
    with pytest.raises(FormatVersionError, match="format 3 cache.*writes format 4 only"):
        CacheWriter(tmp_path / "cache", spec, FINGERPRINTS)
    assert CacheReader(tmp_path / "cache").manifest.format_version == 3  # the refused writer changed nothing


def test_a_new_cache_is_of_the_current_format(tmp_path: Path) -> None:
    spec = CacheSpec(num_sequences=2, hidden_layers=(0,), vocab_size=300, sequences_per_shard=2)
    with CacheWriter(tmp_path / "cache", spec, FINGERPRINTS) as writer:
        writer.write_shard(0, make_sequences(spec, [3, 4]))
        manifest = writer.finalize()
    assert manifest.format_version == 4 and manifest.format.features == {FILE_TABLE, SEALED_INDEX, WRITABLE}


VERSION_NAMES = ("format_version", "FORMAT_VERSION", "READABLE_FORMAT_VERSION", "FIRST_FILE_TABLE")


def mentions_version(node: ast.AST) -> bool:
    """Whether an expression names a format version (a variable, attribute, key or string)."""
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else \
            sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else None
        if name is not None and (name in VERSION_NAMES or name.startswith("is_format")):
            return True
    return False


def version_branches(path: Path, root: Path = REPO) -> list[str]:
    """``file:line`` (from ``root``) of every comparison, ``if``/``match`` test or ``is_format*`` call naming a format
    version."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        tests = [node] if isinstance(node, ast.Compare) else [node.test] if isinstance(
            node, (ast.If, ast.IfExp, ast.While, ast.Assert)) else [node.subject] if isinstance(node, ast.Match) \
            else [node] if isinstance(node, ast.Call) and mentions_version(node.func) else []
        found += [f"{path.relative_to(root)}:{node.lineno}" for test in tests if mentions_version(test)]
    return sorted(set(found))


def test_only_the_adapter_branches_on_the_format_version() -> None:
    files = [p for package in ("pipeline", "stages", "storage") for p in sorted((REPO / package).rglob("*.py"))]
    assert REPO / ADAPTER in files
    outside = [hit for path in files if path != REPO / ADAPTER for hit in version_branches(path)]
    assert outside == [], f"format versions are compared only in {ADAPTER}: {outside}"
    assert version_branches(REPO / ADAPTER), "the check finds the adapter's own comparisons"


def test_the_branch_check_catches_a_comparison(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def f(m):\n    return 1 if m.format_version < 3 else 2\n")
    assert version_branches(planted, tmp_path) == ["planted.py:2"]
    planted.write_text("def f(m, r):\n    x = 1\n    if m['format_version'] == 2 or is_format3(r):\n        pass\n")
    assert version_branches(planted, tmp_path) == ["planted.py:3"]
    planted.write_text("def f(m):\n    match m.format_version:\n        case 2:\n            pass\n")
    assert version_branches(planted, tmp_path) == ["planted.py:2"]
    planted.write_text("def f(m):\n    return {'format_version': m.version}\n")  # naming it is not a branch
    assert version_branches(planted, tmp_path) == []
