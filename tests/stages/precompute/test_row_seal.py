"""Stage one's row table sealed and checked, and nothing written where nothing was asked (issue 32).

The rows live in one folder outside every cache (``KDCACHE_ROWS``; conftest gives each test its own). Their files
carry the sealed file table of a cache's folders: a flipped byte in any of them is caught by ``kdcache verify``,
and the next run rebuilds the rows with a note instead of using them. ``--estimate`` and a run refused because
``--out`` holds a different cache leave the destination's listing and bytes as they were.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.rows.row_store import ROWS_ENV
from kdcache.storage.folders import TABLE
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def _argv(teacher: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--max-length", "24",
            "--sequences-per-shard", "8", "--features", "hidden,logits", "--layers", "0,2", "--top-k", "4",
            "--no-progress", *extra]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a folder."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "texts.jsonl", sample_texts(24, seed=2))


def test_a_flipped_byte_in_each_row_file_is_caught_and_never_reused(tiny_gpt2: Path, data: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cache"
    assert main(_argv(tiny_gpt2, data, out)) == 0
    assert not (out / "rows").exists()  # the cache holds only the cache
    rows = Path(os.environ[ROWS_ENV])
    (folder,) = [p for p in rows.iterdir() if p.is_dir()]
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([TABLE, "rows.arrow", "rows.json"])
    assert (rows / f"{folder.name}.lock").read_bytes() == b""  # an empty flock handle: nothing to check
    assert main(["verify", str(out)]) == 0
    pristine = {name: (folder / name).read_bytes() for name in names}
    for name in names:
        damaged = bytearray(pristine[name])
        damaged[len(damaged) // 2] ^= 0x01
        (folder / name).write_bytes(bytes(damaged))
        capsys.readouterr()
        assert main(["verify", str(out)]) == 1, name
        said = capsys.readouterr().out
        assert "BAD" in said and "rows:" in said and str(folder) in said, said
        assert main(_argv(tiny_gpt2, data, out, "--json")) == 0  # the cache is reused; its rows are not
        err = capsys.readouterr().err
        assert f"the rows at {folder} are damaged" in err and "building them again" in err, err
        assert {n: (folder / n).read_bytes() for n in names}.keys() == pristine.keys()
        assert (folder / "rows.arrow").read_bytes() == pristine["rows.arrow"]  # rebuilt, the same tokens
        assert main(["verify", str(out)]) == 0


def test_estimate_and_a_refused_run_leave_the_destination_unchanged(tiny_gpt2: Path, data: Path,
                                                                      tmp_path: Path) -> None:
    rows = Path(os.environ[ROWS_ENV])
    fresh = tmp_path / "fresh"
    assert main([*_argv(tiny_gpt2, data, fresh), "--estimate"]) == 0
    assert not fresh.exists() and _snapshot(rows) == {}  # no cache, no rows: the scratch rows are gone

    out = tmp_path / "cache"
    assert main(_argv(tiny_gpt2, data, out)) == 0
    before, rows_before = _snapshot(out), _snapshot(rows)
    assert main([*_argv(tiny_gpt2, data, out), "--estimate"]) == 0
    assert _snapshot(out) == before and _snapshot(rows) == rows_before
    other = write_text_dataset(tmp_path / "other.jsonl", sample_texts(16, seed=9))
    assert main(_argv(tiny_gpt2, other, out)) == 2  # a different cache is there: refused
    assert _snapshot(out) == before
