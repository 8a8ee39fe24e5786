"""``benchmarks.gpu_stage_two.stage_two_rows`` end to end on a tiny Llama on the CPU, so the GPU benchmark never
rots: five runs, each trained for real (its own process), each row well formed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.gpu_stage_two import RUNS, stage_two_rows
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.train._train_support import precompute_cache


@pytest.mark.slow
def test_stage_two_rows_small_on_the_cpu(tmp_path: Path) -> None:
    teacher = make_tiny_llama(tmp_path / "teacher", layers=4, hidden=32, heads=4, kv_heads=2)
    cache = precompute_cache(teacher, tmp_path / "cache", num_sequences=24,
                             extra=("--layers", "2,4", "--features", "hidden,logits", "--top-k", "8"))
    rows = stage_two_rows(str(teacher), str(cache), str(tmp_path / "work"), small=True, steps=3, warmup=1)
    assert [r["run"] for r in rows] == list(RUNS)
    for row in rows:
        assert set(row) == {"run", "tokens_per_s", "peak_gib", "vs_student_alone"}
        assert row["tokens_per_s"] > 0 and row["peak_gib"] == 0.0  # no GPU here: no GPU memory
    assert rows[0]["vs_student_alone"] == 1.0
    alone = rows[0]["tokens_per_s"]
    for row in rows:  # each ratio is its own rate over the student's, and no rate is a broken clock's (0 s)
        assert row["vs_student_alone"] == round(row["tokens_per_s"] / alone, 3), row
        assert row["tokens_per_s"] < 1e7, row  # a tiny model on two cores: far below ten million tokens a second
    assert not any((tmp_path / "work").glob("run-*/checkpoints"))  # each run's checkpoint is removed
