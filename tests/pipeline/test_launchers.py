"""The deepspeed launcher drives `kdcache train` as users launch it on a cluster (here: 2 CPU processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.pipeline.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def test_local_rank_flag_from_the_deepspeed_launcher_is_accepted() -> None:
    args = build_parser().parse_args(["--local_rank=1", "inspect", "somewhere"])
    assert args.command == "inspect" and args.local_rank == 1


@pytest.mark.slow
def test_deepspeed_launcher_trains_with_two_processes(tiny_gpt2: Path, tmp_path: Path) -> None:
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    launcher = Path(sys.executable).with_name("deepspeed")
    if not launcher.exists():
        launcher = Path(shutil.which("deepspeed") or "deepspeed")
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(32))
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache),
                 "--layers", "1,2,3", "--top-k", "8", "--max-length", "24", "--sequences-per-shard", "4",
                 "--no-progress"]) == 0
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", "29641", "--module", "kdcache", "train",
           "--cache", str(cache), "--student", str(tiny_gpt2), "--out", str(run), "--zero-stage", "2",
           "--max-steps", "3", "--batch-size", "4", "--log-every", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The launcher's summary against the run's own records: both ranks, every step logged, the loss it printed.
    from kdcache.stages.train.logging import read_jsonl

    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert "trained 3 steps on 2 process(es), ZeRO-2" in proc.stdout, proc.stdout
    assert f"loss {first:.4f} -> {last:.4f}" in proc.stdout
    assert (run / "student" / "config.json").is_file()


def test_a_working_directory_with_its_own_pipeline_stages_and_storage_changes_nothing(tmp_path: Path) -> None:
    # `torchrun -m kdcache` and `deepspeed --module kdcache` put the working directory first on sys.path, and ML
    # repositories often hold modules of these names: kdcache must import only its own.
    for name in ("pipeline.py", "stages.py", "storage/__init__.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("raise SystemExit('the user module was imported instead of kdcache')\n")
    cache = REPO / "tests" / "data" / "format1" / "cache-zarr"
    shadowed, clean = (subprocess.run([sys.executable, "-m", "kdcache", "inspect", str(cache), "--json"], cwd=cwd,
                                      capture_output=True, text=True, timeout=120) for cwd in (tmp_path, REPO))
    assert shadowed.returncode == 0, shadowed.stderr
    assert shadowed.stdout == clean.stdout  # the same inspect, whatever the working directory holds
    from kdcache.storage import CacheReader

    info, reader = json.loads(shadowed.stdout), CacheReader(cache)
    assert (info["num_sequences"], info["num_tokens"]) == (reader.num_sequences, reader.num_tokens)


def test_every_package_folder_is_installed_under_kdcache() -> None:
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"kdcache." + ".".join(p.parent.relative_to(REPO).parts)
               for top in ("pipeline", "stages", "storage") for p in (REPO / top).rglob("__init__.py")}
    assert folders | {"kdcache"} == listed
