"""Encoder-decoder caches go through eval, sweep and report like single-stream ones (BART and T5)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.eval_records import read_evals
from tests.helpers.tiny_models import make_tiny_bart, make_tiny_t5, sample_pairs, write_pair_dataset
from tests.stages._train_support import make_student_config

SHALLOW = {"bart": {"encoder_layers": 1, "decoder_layers": 1}, "t5": {"num_layers": 1, "num_decoder_layers": 1}}


def _precompute(teacher: Path, pairs: Path, out: Path) -> Path:
    assert main(["precompute", "--teacher", str(teacher), "--data", str(pairs), "--out", str(out),
                 "--source-column", "source", "--target-column", "target", "--features",
                 "hidden,attention,cross_attention,logits", "--top-k", "8", "--sequences-per-shard", "6",
                 "--max-length", "32", "--no-progress"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bart", "t5"])
def test_seq2seq_sweep_trains_evals_and_reports(name: str, tmp_path: Path) -> None:
    """Two decoder layer maps x two hidden losses from one cache, scored on a held-out cache, then reported."""
    teacher = (make_tiny_bart if name == "bart" else make_tiny_t5)(tmp_path / "teacher")
    cache = _precompute(teacher, write_pair_dataset(tmp_path / "train.jsonl", sample_pairs(18)), tmp_path / "cache")
    heldout = _precompute(teacher, write_pair_dataset(tmp_path / "heldout.jsonl", sample_pairs(8, seed=5)),
                          tmp_path / "heldout")
    student = make_student_config(tmp_path / "student", teacher, **SHALLOW[name])
    shutil.rmtree(teacher)  # neither training nor evaluation needs the teacher
    sweep = tmp_path / "sweep"
    assert main(["sweep", "--cache", str(cache), "--student", str(student), "--out", str(sweep), "--eval-cache",
                 str(heldout), "--grid", "decoder_layer_map=last,explicit:1-1", "--grid", "hidden_loss=mse,cosine",
                 "--max-steps", "2", "--batch-size", "4", "--delta", "1", "--log-every", "1"]) == 0
    with open(sweep / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok"] * 4
    for row in rows:
        assert float(row["eval_perplexity"]) > 1 and 0 <= float(row["eval_top1"]) <= 1
        assert float(row["eval_kl"]) >= 0 and row["eval_cka_on_map"]
    [evaluation] = read_evals(sweep / "runs" / "decoder_layer_map-last__hidden_loss-mse")
    assert evaluation["kind"] == "seq2seq_lm" and set(evaluation["cka_streams"]) == {"encoder", "decoder"}
    assert evaluation["cka_streams"]["decoder"]["on_map"][0]["teacher"] == 2  # `last` maps student 1 to block 2
    assert evaluation["cka_streams"]["encoder"]["student_layers"] == [0, 1]
    assert main(["report", str(sweep)]) == 0
    run_report = sweep / "runs" / "decoder_layer_map-last__hidden_loss-mse" / "report"
    for stack in ("encoder", "decoder"):
        assert (run_report / f"alignment-{stack}.png").is_file()
        assert f"Alignment ({stack} stack)" in (run_report / "report.html").read_text()
    assert "eval_kl" in (sweep / "report" / "report.html").read_text()
