"""``benchmarks/bench_gil.py --small`` end to end, so the benchmark behind RESULTS.md's GIL figures never rots:
every mode runs the real writer or reader beside the launcher and reports its row. (A subprocess: the benchmark
pins its threads to cores.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the launcher and the host path need a core each")
def test_the_gil_benchmark_at_its_smallest(tmp_path: Path) -> None:
    out = tmp_path / "gil.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gil.py"), "--small", "--seconds", "0.3",
                    "--rounds", "1", "--rows", "4", "--launch-seconds", "0.05", "--json", str(out)], check=True, cwd=ROOT,
                   timeout=300)
    results = json.loads(out.read_text())
    for mode in ("write", "write_topk", "read"):
        row = results[mode]
        assert row["host_tokens_per_s"] > 0, mode  # the host path did work beside the launcher
        assert 0 <= row["stall_share"] <= 1 and row["launches_vs_alone"] > 0, mode
    run = results["stage_one"]  # a real precompute, its teacher's layers the launcher
    assert run["batches"] == 2 and run["launches_s"] > 0 and run["compute_s"] >= run["launches_s"]
