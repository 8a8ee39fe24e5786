"""``benchmarks/bench_gpu.py --small`` on the CPU: the GPU benchmark's own code runs in every test run, so that it
never rots between the sessions that have a GPU. Its figures here mean nothing; its rows and ratios must be there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_gpu_small_runs_every_row(tmp_path: Path) -> None:
    sys.path.append(str(REPO))
    from benchmarks.bench_gpu import main, stage_one_configs

    out = tmp_path / "gpu.json"
    assert main(["--small", "--no-train", "--tokens", "1024", "--work", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["disk_write_mb_s"] > 0 and set(results["reference"]) == {"bare_forward", "forward_head_topk"}
    rows = results["stage_one"]
    assert [r["run"] for r in rows] == list(stage_one_configs(small=True))
    for row in rows:
        assert row["tokens"] == 1024 and row["tokens_per_s"] > 0 and row["bytes_per_token"] > 0
        assert row["vs_limit"] == pytest.approx(row["tokens_per_s"] / min(
            results["reference"]["forward_head_topk"], row["disk_allows_tokens_per_s"]), rel=1e-2, abs=1e-3)  # 3 decimals
        base_seconds = row["tokens"] / results["reference"]["bare_forward"]
        assert row["forward_vs_base"] == pytest.approx(row["forward_s"] / base_seconds, rel=1e-2, abs=1e-3)
        assert row["host_cpu_s"] > 0
    assert rows[1]["bytes_per_token"] > rows[0]["bytes_per_token"] > 0  # hidden layers cost bytes
    _check_report(tmp_path, results)


def _check_report(folder: Path, results: dict) -> None:
    """The prepared check's report (benchmarks/gpu_report.py) on this run's JSON: each stage one target shows the
    figure measured, stage two's (not run) and the steps that did not run show as missing, never as met."""
    from benchmarks.gpu_report import report

    text = report(folder)
    fp16 = next(r for r in results["stage_one"] if r["run"] == "+4 hidden fp16")["vs_forward_head"]
    assert f"| stage one 4 fp16 hidden layers vs forward + head | {fp16} | ≥ 0.85 |" in text
    assert "| stage two all terms vs the student alone | — | ≥ 0.9 | missing |" in text
    assert "card unknown" in text and "Kernel tests on CUDA: missing" in text and "bench_vocab_losses: missing" in text
