"""Training from a q/k (or q/k/v) cache end to end (issue 23): the attention KL rebuilt from queries and keys, and
MiniLMv2's relation loss, through the CLI and DeepSpeed on the CPU; the student keeps SDPA attention."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.logging import read_jsonl
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.train._train_support import make_student_config, precompute_cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qk-train")
    teacher = make_tiny_llama(root / "teacher", layers=3, hidden=32, heads=4, kv_heads=2)
    features = ("--features", "hidden,attention,logits", "--top-k", "8", "--layers", "1,3")
    qk = precompute_cache(teacher, root / "qk", num_sequences=16, extra=(*features, "--attention-source", "qk"))
    qkv = precompute_cache(teacher, root / "qkv", num_sequences=16, extra=(*features, "--attention-source", "qkv"))
    maps = precompute_cache(teacher, root / "maps", num_sequences=16, extra=features)
    student = make_student_config(root / "student", teacher, num_hidden_layers=2, hidden_size=16,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    return {"root": root, "qk": qk, "qkv": qkv, "maps": maps, "student": student}


def _train(setup: dict[str, Path], cache: str, out: str, *extra: str) -> list[dict]:
    run = setup["root"] / out
    argv = ["train", "--cache", str(setup[cache]), "--student", str(setup["student"]), "--out", str(run),
            "--zero-stage", "0", "--max-steps", "4", "--batch-size", "4", "--lr", "3e-3", "--delta", "1",
            "--log-every", "1", "--json", *extra]
    assert main(argv) == 0
    return read_jsonl(run / "metrics.jsonl")


@pytest.mark.slow
def test_attention_kl_trains_from_queries_and_keys(setup: dict[str, Path]) -> None:
    records = _train(setup, "qk", "kl")
    assert len(records) == 4
    assert all(r["attention"] > 0 for r in records)
    assert {"attention/s1_t1", "attention/s2_t3"} <= set(records[0])  # uniform map onto the cached blocks 1, 3
    assert not (setup["root"] / "kl" / "student" / "config.json").read_text().count('"kdcache_qk"')


@pytest.mark.slow
def test_evaluation_reads_attention_agreement_alike_from_maps_and_queries(setup: dict[str, Path]) -> None:
    from kdcache.stages.train.evaluation.evaluate import evaluate_run
    from kdcache.storage import CacheReader

    run = setup["root"] / "kl"
    if not (run / "student").exists():
        _train(setup, "qk", "kl")
    by_maps = evaluate_run(run, CacheReader(setup["maps"]), batch_size=8)["attention"]
    by_qk = evaluate_run(run, CacheReader(setup["qk"]), batch_size=8)["attention"]
    assert (by_maps["source"], by_qk["source"]) == ("maps", "qk")
    assert set(by_maps["pairs"]) == set(by_qk["pairs"]) == {"s1_t1", "s2_t3"}
    for key in by_maps["pairs"]:
        # fp16 maps and fp16 q/k round differently: a near-uniform random teacher has tiny KLs, hence the abs term
        assert by_qk["pairs"][key] == pytest.approx(by_maps["pairs"][key], rel=1e-3, abs=1e-7)


@pytest.mark.slow
def test_relation_loss_trains_from_queries_keys_and_values(setup: dict[str, Path]) -> None:
    """Also under gradient checkpointing: the recorded q/k/v stay in the graph the recomputation replays."""
    records = _train(setup, "qkv", "relation", "--attention-loss", "relation", "--relation-heads", "4",
                     "--alpha", "0", "--beta", "0", "--gamma", "0", "--gradient-checkpointing")
    assert all(0 < r["attention"] < float("inf") for r in records)
    assert all(r["loss"] == pytest.approx(r["attention"], rel=1e-5) for r in records)  # the only term


def test_relation_loss_on_a_maps_cache_is_refused(tmp_path: Path, tiny_gpt2: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Refused for its cause alone (one problem: the maps cache), before any step, naming both ways out."""
    cache = precompute_cache(tiny_gpt2, tmp_path / "maps", num_sequences=8)
    student = make_student_config(tmp_path / "student", tiny_gpt2, n_layer=2, n_embd=16, n_head=2)
    capsys.readouterr()
    code = main(["train", "--cache", str(cache), "--student", str(student), "--out", str(tmp_path / "run"),
                 "--delta", "1", "--attention-loss", "relation", "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "training cannot start (1 problem(s))" in err and "Traceback" not in err, err
    assert ("--attention-loss relation needs the teacher's queries and keys (and values), but the cache holds "
            "attention maps") in err and "--attention-source qk or qkv" in err and "--attention-loss kl" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_relation_heads_not_dividing_the_widths_are_refused_before_training(
        tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Teacher queries 4 x 8 wide and keys 2 x 8; student queries 2 x 8 and keys 1 x 8: R = 3 divides none."""
    cache = precompute_cache(tiny_llama, tmp_path / "qkv", num_sequences=8, extra=(
        "--features", "hidden,attention", "--layers", "1", "--attention-source", "qkv"))
    student = make_student_config(tmp_path / "student", tiny_llama, num_hidden_layers=1, hidden_size=16,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    argv = ["train", "--cache", str(cache), "--student", str(student), "--out", str(tmp_path / "run"), "--delta",
            "1", "--attention-loss", "relation", "--max-steps", "1"]
    assert main([*argv, "--relation-heads", "3"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--relation-heads 3 does not divide" in err
    assert "the teacher's queries (32)" in err and "the student's keys and values (8)" in err
    assert not (tmp_path / "run" / "options.json").exists()  # refused before the run started
