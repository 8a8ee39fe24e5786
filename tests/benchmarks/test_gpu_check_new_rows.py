"""The GPU check's rows for this round's two new products (issue 62), on the CPU so that they never rot between the
sessions that have a GPU: ``bench_generate`` at its smallest writes the JSON the check reads, and the report turns
it and a draft result into rows with their verdicts. The figures here mean nothing; the rows must be there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_generate_json_becomes_the_reports_generation_row(tmp_path: Path) -> None:
    sys.path.append(str(REPO))
    from benchmarks.gpu_report import report

    out = tmp_path / "generate.json"
    subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--shapes", "2x8x4", "--repeats", "1",
                    "--threads", "1", "--model", "64x2x512", "--json", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    row = json.loads(out.read_text())[0]
    assert row["device"] == "cpu" and row["tokens"] == 2 * (8 + 4) and row["ratio"] > 0
    verdict = "**met**" if row["ratio"] >= 0.9 else "missed"
    assert "| 2 × 8 × 4 | " in report(tmp_path) and f"{row['ratio']:.2f} (≥ 0.9) | {verdict} |" in report(tmp_path)
    assert "bench_draft: missing" in report(tmp_path)  # a step that did not run is never shown as met


def test_a_draft_result_becomes_the_reports_tau_rows(tmp_path: Path) -> None:
    sys.path.append(str(REPO))
    from benchmarks.gpu_report import report

    rows = {"prompt lookup": {"tau": 1.1, "speedup": 0.93}, "EAGLE-3 head (fp16 cache)": {"tau": 2.5, "speedup": 1.7}}
    (tmp_path / "draft.json").write_text(json.dumps({"rows": rows}))
    text = report(tmp_path)
    assert "| prompt lookup | 1.10 | 0.93× |" in text and "| EAGLE-3 head (fp16 cache) | 2.50 | 1.70× |" in text
    assert "bench_generate: missing" in text
