"""``benchmarks/bench_host_path.py`` at its smallest, so the benchmark behind RESULTS.md's host-path figures never
rots, and its stub device keeps time: a run cannot end before the device clock says its last batch is done. (A
subprocess: the benchmark pins its threads to cores.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark compares one core with two")
def test_the_host_path_benchmark_at_its_smallest(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_path.py"), "--rows", "16", "--widths", "64",
                    "--repeats", "1", "--json", str(out)], check=True, cwd=ROOT, timeout=300)
    (row,) = json.loads(out.read_text())
    assert row["width"] == 64 and row["tokens"] == 16 * 2048
    assert row["cpu_us_per_token_layer"] > 0 and row["wall_1_core_s"] > 0 and row["wall_2_cores_s"] > 0
    # 64-wide fp16 rows cost a few microseconds of host CPU per token-layer (15 at 2,048 wide): a count of the wrong
    # tokens or layers, or a clock read in the wrong unit, lands far outside.
    assert row["cpu_us_per_token_layer"] < 1000, row
    # Two batches of device time, each 1.5x the host's: the host waited for the clock, so no run beats it.
    assert row["slow_stub_s"] > 0 and row["slow_wall_s"] >= row["slow_stub_s"]
