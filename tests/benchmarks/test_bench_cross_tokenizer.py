"""``benchmarks/bench_cross_tokenizer.py`` end to end at its smallest on the CPU, so the benchmark behind the
RESULTS.md table never rots: every run trains for real and every row of the table is filled."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.bench_cross_tokenizer import run, table


@pytest.mark.slow
def test_the_cross_tokenizer_benchmark_at_its_smallest(tmp_path: Path) -> None:
    results = run(steps=2, sentences=20, repeats=1, teacher_steps=2, root=tmp_path, seeds=2)
    for name in ("ce", "gold", "gold_other", "uld", "same", "same_cross"):
        speed = results[f"{name}_speed"]
        assert speed["steps_per_s"] > 0 and speed["tokens_per_s"] > 0, name
    for name in ("untrained", "ce", "gold", "gold_other", "uld"):
        assert len(results[name]) == (1 if name == "untrained" else 2), name  # one record per seed
        for scored in results[name]:
            assert scored["spans"] > 0 and 0 <= scored["span_top1"] <= 1, name
            assert 0 < scored["aligned_share"] < 1 and math.isfinite(scored["span_cka"]["s2_t2"]), name
    # The ceiling: the teacher through the cross path agrees with its own cache on every span.
    [teacher] = results["teacher"]
    assert teacher["span_top1"] == 1.0 and teacher["aligned_share"] == 1.0
    lines = table(results).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) == 2 + 6 + 2 and all(line.count("|") == 7 for line in rows), lines
    assert "best constant prediction scores" in lines[0] and " ± " in lines[lines.index(rows[0]) + 4]
