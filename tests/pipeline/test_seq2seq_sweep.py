"""Encoder-decoder caches go through eval, sweep and report like single-stream ones (BART and T5)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.evaluation.eval_records import read_evals
from tests.helpers.images import assert_png
from tests.helpers.tiny_models import make_tiny_bart, make_tiny_t5, sample_pairs, write_pair_dataset
from tests.stages.train._train_support import make_student_config

SHALLOW = {"bart": {"encoder_layers": 1, "decoder_layers": 1}, "t5": {"num_layers": 1, "num_decoder_layers": 1}}


def _precompute(teacher: Path, pairs: Path, out: Path) -> Path:
    assert main(["precompute", "--teacher", str(teacher), "--data", str(pairs), "--out", str(out),
                 "--source-column", "source", "--target-column", "target", "--features",
                 "hidden,attention,cross_attention,logits", "--top-k", "8", "--sequences-per-shard", "6",
                 "--max-length", "32", "--no-progress"]) == 0
    return out


# Each point of a sweep is two fresh processes (train, then eval: ~85% of the test's time), so each model sweeps
# one axis of two points, not a 2 x 2 grid: BART the decoder layer maps (hidden loss mse), T5 the hidden losses
# (map `last`). Each axis still runs end to end on an encoder-decoder cache, and `last` + mse, the run checked
# below, is in both; the cartesian product of two keys is sweep's own logic, tested on single-stream caches.
GRIDS = {"bart": (["--grid", "decoder_layer_map=last,explicit:1-1", "--hidden-loss", "mse"], "decoder_layer_map-last"),
         "t5": (["--grid", "hidden_loss=mse,cosine", "--decoder-layer-map", "last"], "hidden_loss-mse")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bart", "t5"])
def test_seq2seq_sweep_trains_evals_and_reports(name: str, tmp_path: Path) -> None:
    """Two decoder layer maps (BART) or two hidden losses (T5) from one cache, scored on a held-out cache, then
    reported."""
    teacher = (make_tiny_bart if name == "bart" else make_tiny_t5)(tmp_path / "teacher")
    cache = _precompute(teacher, write_pair_dataset(tmp_path / "train.jsonl", sample_pairs(18)), tmp_path / "cache")
    heldout = _precompute(teacher, write_pair_dataset(tmp_path / "heldout.jsonl", sample_pairs(8, seed=5)),
                          tmp_path / "heldout")
    student = make_student_config(tmp_path / "student", teacher, **SHALLOW[name])
    shutil.rmtree(teacher)  # neither training nor evaluation needs the teacher
    sweep = tmp_path / "sweep"
    assert main(["sweep", "--cache", str(cache), "--student", str(student), "--out", str(sweep), "--eval-cache",
                 str(heldout), *GRIDS[name][0], "--max-steps", "2", "--batch-size", "4", "--delta", "1",
                 "--log-every", "1"]) == 0
    with open(sweep / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok"] * 2
    for row in rows:
        assert float(row["eval_perplexity"]) > 1 and 0 <= float(row["eval_top1"]) <= 1
        assert float(row["eval_kl"]) >= 0 and 0 <= float(row["eval_cka_on_map"]) <= 1
    [evaluation] = read_evals(sweep / "runs" / GRIDS[name][1])
    assert evaluation["kind"] == "encoder_decoder_lm" and set(evaluation["cka_streams"]) == {"encoder", "decoder"}
    assert evaluation["cka_streams"]["decoder"]["on_map"][0]["teacher"] == 2  # `last` maps student 1 to block 2
    assert evaluation["cka_streams"]["encoder"]["student_layers"] == [0, 1]
    assert main(["report", str(sweep)]) == 0
    run_report = sweep / "runs" / GRIDS[name][1] / "report"
    for stack in ("encoder", "decoder"):
        assert_png(run_report / f"alignment-{stack}.png")
        assert f"Alignment ({stack} stack)" in (run_report / "report.html").read_text()
    assert "eval_kl" in (sweep / "report" / "report.html").read_text()


@pytest.mark.slow
def test_mbart_with_language_codes_through_both_stages(tmp_path: Path) -> None:
    """mBART: sources end `</s> en_XX`, targets `</s> ro_RO`, and the decoder starts from the target's language
    code (the model's own shift), in the cache and in training."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from kdcache.storage import CacheReader
    from tests.helpers.tiny_models import make_tiny_mbart

    teacher = make_tiny_mbart(tmp_path / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(str(teacher))
    en, ro, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("en_XX", "ro_RO", "</s>"))
    cache = _precompute(teacher, write_pair_dataset(tmp_path / "pairs.jsonl", sample_pairs(12)), tmp_path / "cache")
    reader = CacheReader(cache)
    first = reader.get(0, names=["encoder/input_ids", "decoder/input_ids", "decoder/hidden/2"])
    assert first["encoder/input_ids"][-2:].tolist() == [eos, en]
    assert first["decoder/input_ids"][-2:].tolist() == [eos, ro]
    model = AutoModelForSeq2SeqLM.from_pretrained(str(teacher), attn_implementation="eager").eval()
    labels = torch.from_numpy(first["decoder/input_ids"].astype("int64"))[None]
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert int(decoder_input_ids[0, 0]) == ro
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(first["encoder/input_ids"].astype("int64"))[None],
                    decoder_input_ids=decoder_input_ids, output_hidden_states=True)
    online = out.decoder_hidden_states[2][0].numpy()
    assert abs(first["decoder/hidden/2"].astype("float32") - online).max() < 2e-2  # fp16 storage
    assert main(["init-student", "--teacher", str(teacher), "--layers", "2", "--out", str(tmp_path / "student")]) == 0
    assert main(["train", "--cache", str(cache), "--student", str(tmp_path / "student"), "--out",
                 str(tmp_path / "run"), "--max-steps", "3", "--batch-size", "4", "--gamma", "1",
                 "--decoder-layer-map", "explicit:1-2", "--quiet"]) == 0
    assert main(["eval", "--cache", str(cache), "--run", str(tmp_path / "run")]) == 0
    [evaluation] = read_evals(tmp_path / "run")
    assert evaluation["kind"] == "encoder_decoder_lm" and evaluation["perplexity"] > 1 and 0 <= evaluation["top1_agreement"] <= 1


def test_the_teacher_scored_as_its_own_student_agrees_with_its_cache(tmp_path: Path) -> None:
    """The eval path of two streams (collate, decoder inputs from the labels, per-stack CKA) checked against the
    one answer known exactly: the teacher itself matches its own cache."""
    from kdcache.stages.train.evaluation.evaluate import evaluate_run
    from kdcache.storage import CacheReader

    teacher = make_tiny_bart(tmp_path / "teacher")
    cache = _precompute(teacher, write_pair_dataset(tmp_path / "pairs.jsonl", sample_pairs(10)), tmp_path / "cache")
    result = evaluate_run(tmp_path / "no-run", CacheReader(cache), student=teacher)
    assert result["kind"] == "encoder_decoder_lm" and result["top1_agreement"] == 1.0 and result["kl"] < 1e-3
    for stack in ("encoder", "decoder"):
        cka = result["cka_streams"][stack]
        assert cka["student_layers"] == [0, 1, 2] and cka["teacher_layers"] == [0, 1, 2]
        for j in range(3):
            assert cka["matrix"][j][j] > 0.999, (stack, j, cka["matrix"])
