"""Teacher-free evaluation against a cache: the streaming CKA, the LM metrics, and whole runs.

The strongest check available without a trained student: evaluate the *teacher itself* as if it were the
student of a run. Its perplexity is then the teacher's, its KL to the cache ~0 (fp16 rounding), its top-1
agreement 1, and its CKA against its own cached layers 1 on the diagonal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.hidden.loss_terms import linear_cka
from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.evaluation.agreement import CkaMatrix, LmStats
from kdcache.stages.train.evaluation.eval_records import find_eval, read_evals
from kdcache.stages.train.evaluation.evaluate import cache_batches, evaluate_run
from kdcache.storage import CacheReader, CacheSpec, CacheWriter
from tests.helpers.tiny_models import make_tiny_bert
from tests.stages.train._train_support import write_cache


def make_run(root: Path, model_dir: Path, pairs: list[tuple[int, int]], projectors: dict | None = None) -> Path:
    """A run directory as training leaves it: student/ (a copy of ``model_dir``), plan.json, projectors.pt."""
    root.mkdir(parents=True)
    shutil.copytree(model_dir, root / "student")
    (root / "plan.json").write_text(json.dumps({"hidden_pairs": [list(p) for p in pairs]}))
    if projectors is not None:
        torch.save({"projectors": projectors}, root / "projectors.pt")
    return root


def test_streaming_cka_equals_linear_cka_on_all_rows() -> None:
    torch.manual_seed(0)
    s = [torch.randn(30, 5), torch.randn(20, 5)]
    t = [s[0] @ torch.randn(5, 7) + 0.3 * torch.randn(30, 7), s[1] @ torch.randn(5, 7) + 2.0]
    cka = CkaMatrix([1], [4])
    for a, b in zip(s, t):
        cka.update({1: a}, {4: b})
    rows_s, rows_t = torch.cat(s)[None], torch.cat(t)[None]
    expected = float(linear_cka(rows_s, rows_t, torch.ones(1, 50)))
    assert cka.matrix()[0, 0] == pytest.approx(expected, rel=1e-5)


def test_lm_stats_on_a_student_equal_to_its_teacher() -> None:
    torch.manual_seed(1)
    logits, mask = torch.randn(2, 5, 11), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ids = torch.randint(0, 11, (2, 5))
    stats = LmStats(logit_kinds.get("full"))
    stats.update(logits, ids, token_masks(mask, causal=True), {"logits/full": logits})
    result = stats.result()
    assert result["kl"] == pytest.approx(0.0, abs=1e-6) and result["top1_agreement"] == 1.0
    other = torch.randn(2, 5, 11)
    stats = LmStats(logit_kinds.get("full"))
    stats.update(other, ids, token_masks(mask, causal=True), {"logits/full": logits})
    assert stats.result()["kl"] == pytest.approx(float(kd_kl(other, logits, mask)), rel=1e-5)
    log_p = torch.log_softmax(other, -1)
    nll = -torch.cat([log_p[0, :4].gather(1, ids[0, 1:, None]), log_p[1, :2].gather(1, ids[1, 1:3, None])])
    assert stats.result()["perplexity"] == pytest.approx(float(nll.mean().exp()), rel=1e-5)


@pytest.mark.parametrize("logits", ["full", "topk"])
def test_causal_lm_eval_of_the_teacher_against_its_own_cache(logits: str, tiny_gpt2: Path, tmp_path: Path) -> None:
    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=12, logits=logits, top_k=16,
                        hidden_layers=(1, 2, 3))
    run = make_run(tmp_path / "run", tiny_gpt2, [(1, 1), (2, 3)])
    result = evaluate_run(run, CacheReader(cache), batch_size=5)
    assert result["kind"] == "causal_lm"
    assert result["kl"] == pytest.approx(0.0, abs=2e-3)  # the cache is fp16
    assert result["top1_agreement"] > 0.97 and result["perplexity"] > 1.0
    cka = result["cka"]
    assert cka["student_layers"] == [0, 1, 2, 3] and cka["teacher_layers"] == [1, 2, 3]
    assert cka["on_map"][0]["cka"] == pytest.approx(1.0, abs=1e-3)  # (1, 1): the very same states
    assert cka["on_map"][1]["cka"] < 0.99  # (2, 3): neighbouring layers, similar but not the same
    assert cka["final"] == pytest.approx(1.0, abs=1e-3)


def test_causal_lm_eval_without_teacher_logits_gives_perplexity_only(tiny_gpt2: Path, tmp_path: Path) -> None:
    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=6, logits=None, hidden_layers=(3,))
    result = evaluate_run(make_run(tmp_path / "run", tiny_gpt2, [(3, 3)]), CacheReader(cache))
    assert result["kind"] == "causal_lm" and result["perplexity"] > 1.0 and "kl" not in result
    assert "perplexity only" in " ".join(result["notes"])


def test_encoder_eval_cosine_spearman_and_projectors(tmp_path: Path) -> None:
    teacher = make_tiny_bert(tmp_path / "bert", layers=2, hidden=32, lm_head=False)
    cache = write_cache(teacher, tmp_path / "cache", num_sequences=12, hidden_layers=(1, 2))
    same = evaluate_run(make_run(tmp_path / "same", teacher, [(1, 1), (2, 2)]), CacheReader(cache))
    assert same["kind"] == "encoder" and same["cosine"] == pytest.approx(1.0, abs=1e-3)
    assert same["spearman"] > 0.99 and same["cka"]["mean_on_map"] == pytest.approx(1.0, abs=1e-3)
    assert same["sentences"] == 12
    narrow = make_tiny_bert(tmp_path / "narrow", layers=2, hidden=16, heads=2, lm_head=False)
    skipped = evaluate_run(make_run(tmp_path / "no-proj", narrow, [(2, 2)]), CacheReader(cache))
    assert "cosine" not in skipped and "cosine skipped" in " ".join(skipped["notes"])
    projector = {"layers.s2_t2.weight": torch.randn(32, 16), "layers.s2_t2.bias": torch.zeros(32)}
    projected = evaluate_run(make_run(tmp_path / "proj", narrow, [(2, 2)], projector), CacheReader(cache))
    assert -1.0 <= projected["cosine"] <= 1.0 and projected["cosine_through"] == "projector s2_t2"
    assert projected["spearman"] == pytest.approx(skipped["spearman"])  # width-free, projector-free


def test_eval_cli_writes_eval_json_and_refuses_an_unfinished_run(tiny_gpt2: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=6, logits="topk", hidden_layers=(3,))
    run = make_run(tmp_path / "run", tiny_gpt2, [(3, 3)])
    assert main(["eval", "--cache", str(cache), "--run", str(run), "--json", "--limit", "4"]) == 0
    [written] = read_evals(run)
    assert written["kind"] == "causal_lm" and written["cka"]["final"] == pytest.approx(1.0, abs=1e-3)
    assert written["role"] == "trained" and written["cache"]["path"] == str(cache.resolve())
    assert written["cache"]["sequences"] == 4 and written["cache"]["cache_sequences"] == 6
    assert written["cache"]["tokens"] == sum(len(CacheReader(cache)[i]["input_ids"]) for i in range(4))
    unfinished = tmp_path / "unfinished"  # training writes plan.json first, student/ at the end
    unfinished.mkdir()
    (unfinished / "plan.json").write_text((run / "plan.json").read_text())
    capsys.readouterr()
    assert main(["eval", "--cache", str(cache), "--run", str(unfinished)]) == 2
    err = capsys.readouterr().err
    assert "no exported student/" in err and "Traceback" not in err
    for not_a_run in (tmp_path / "nosuchrun", cache):  # a typo, or a cache given as the run
        assert main(["eval", "--cache", str(cache), "--run", str(not_a_run)]) == 2
        err = capsys.readouterr().err
        assert f"--run {str(not_a_run)!r} is not a training run (no plan.json there)" in err, err
        assert "still training" not in err and "Traceback" not in err
    assert not (tmp_path / "nosuchrun").exists()


def test_two_caches_and_a_baseline_keep_their_own_evaluations(tiny_gpt2: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An initial (random) student scored with --student, then the run against two caches: three records."""
    from tests.stages.train._train_support import make_student_config

    train = write_cache(tiny_gpt2, tmp_path / "train", num_sequences=6, logits="topk", hidden_layers=(3,))
    heldout = write_cache(tiny_gpt2, tmp_path / "heldout", num_sequences=5, logits="topk", hidden_layers=(3,), seed=1)
    run = make_run(tmp_path / "run", tiny_gpt2, [(3, 3)])
    initial = make_student_config(tmp_path / "initial", tiny_gpt2, n_layer=2)  # config only: random weights
    for extra in (["--cache", str(heldout), "--student", str(initial)], ["--cache", str(heldout)],
                  ["--cache", str(train)]):
        assert main(["eval", "--run", str(run), *extra]) == 0
    records = read_evals(run)
    assert [(r["role"], r["cache"]["sequences"]) for r in records] == [("baseline", 5), ("trained", 5),
                                                                       ("trained", 6)]
    assert records[0]["cache"]["label"].startswith("heldout-") and records[2]["cache"]["label"].startswith("train-")
    # The run's "trained" student is the teacher itself here, so it agrees everywhere; the random baseline does not.
    assert records[0]["top1_agreement"] < records[1]["top1_agreement"] == pytest.approx(1.0)
    assert find_eval(run, "trained", str(heldout))["cache"]["sequences"] == 5
    # Another student as the baseline on the same cache is refused, naming the one it holds; the same one re-scores.
    other = make_student_config(tmp_path / "other", tiny_gpt2, n_layer=1)
    held = (run / "evals").glob("baseline@*.json").__next__().read_text()
    assert main(["eval", "--run", str(run), "--cache", str(heldout), "--student", str(other)]) == 2
    err = capsys.readouterr().err
    assert "already holds this run's baseline on that cache, from the student" in err and str(initial.resolve()) in err
    assert next((run / "evals").glob("baseline@*.json")).read_text() == held
    assert main(["eval", "--run", str(run), "--cache", str(heldout), "--student", str(initial)]) == 0
    assert main(["report", str(run)]) == 0
    html = (run / "report" / "report.html").read_text()
    assert "baseline → trained" in html and html.index(">baseline<") < html.index(">trained<")
    assert records[0]["cache"]["label"] in html and str(train.resolve()) in html


def _problems(err: str) -> list[str]:
    """The ``  - ...`` lines of an error message."""
    return [line for line in err.splitlines() if line.startswith("  - ")]


def test_eval_refuses_a_student_of_another_tokenizer_like_train(tiny_gpt2: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A student whose tokenizer (and vocabulary) is not the cache's: eval (trained and baseline) and the sweep's
    up-front check exit 2 with train's sentences and write nothing."""
    from tests.helpers.tiny_models import SENTENCES, make_tiny_gpt2, sample_texts

    other = make_tiny_gpt2(tmp_path / "other", vocab_size=400, layers=2,
                           texts=[*SENTENCES, *sample_texts(30, seed=3), "zebra quokka xylophone"])
    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=6, logits="topk", hidden_layers=(3,))
    capsys.readouterr()
    assert main(["train", "--cache", str(cache), "--student", str(other), "--out", str(tmp_path / "t"),
                 "--gamma", "0"]) == 2
    refused = _problems(capsys.readouterr().err)
    assert any("tokenizer vocab differs" in p for p in refused) and "?" not in "".join(refused)
    trained = make_run(tmp_path / "run", other, [(2, 3)])
    baseline = make_run(tmp_path / "base", tiny_gpt2, [(3, 3)])
    for argv in (["--run", str(trained)], ["--run", str(baseline), "--student", str(other)]):
        assert main(["eval", "--cache", str(cache), *argv]) == 2
        err = capsys.readouterr().err
        assert "evaluation cannot start" in err and "Traceback" not in err
        assert _problems(err) == refused
    assert not (trained / "evals").exists() and not (baseline / "evals").exists()
    sweep = tmp_path / "sweep"
    assert main(["sweep", "--cache", str(cache), "--student", str(tiny_gpt2), "--eval-cache",
                 str(write_cache(other, tmp_path / "other-cache", num_sequences=4, hidden_layers=(2,))),
                 "--grid", "gamma=0.1,1", "--out", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer vocab differs" in err and not sweep.exists()


def test_batches_of_a_partial_cache_carry_the_global_ids_of_their_shards(tmp_path: Path) -> None:
    """Shards 0 and 2 of 3 committed: the batches' ids are 0, 1, 4, 5 (the texts and the scored sequences are looked
    up by them), not 0..3 counted as the rows come."""
    spec = CacheSpec(num_sequences=6, sequences_per_shard=2, hidden_layers=(), attention_layers=(), logits="full",
                     vocab_size=5, dtype="fp16")
    fingerprints = {"teacher": {"name_or_path": "random", "revision": None, "config_hash": "sha256:aa",
                                "weights_hash": "sha256:bb"},
                    "tokenizer": {"vocab_hash": "sha256:11", "vocab_size": 5, "special_tokens": {}},
                    "data": {"source": "random", "split": None, "num_sequences": 6}, "settings": {}}
    writer = CacheWriter(tmp_path, spec, fingerprints)
    for shard in (0, 2):  # sequence i holds the token i, so a row names the sequence it came from
        start, stop = spec.shard_range(shard)
        writer.write_shard(shard, [{"input_ids": np.full(3, i), "logits/full": np.zeros((3, 5), np.float32)}
                                   for i in range(start, stop)])
    writer.close()
    batches = list(cache_batches(CacheReader(tmp_path, allow_partial=True), ["input_ids"], 3))
    assert [b["sample_ids"].tolist() for b in batches] == [[0, 1, 4], [5]]
    assert [b["input_ids"][:, 0].tolist() for b in batches] == [[0, 1, 4], [5]]
