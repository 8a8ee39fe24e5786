"""``CacheTrainer`` and ``kdcache train --eval-cache`` evaluated on a held-out cache (every loss term and the
agreement with the teacher, as ``kdcache eval`` computes it; best checkpoint; early stopping), and the API's smaller
promises: what it exports,
its messages in its own spelling, a tokenizer given as ``processing_class``, a student's folder without training
files, a partial cache.

One tiny GPT-2 teacher writes a training cache and a held-out cache of other texts; another teacher writes a
cache the held-out check must refuse. The teachers are deleted before any training.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import kdcache
from kdcache.stages.train.core.student import load_student
from kdcache.stages.train.evaluation.evaluate import evaluate_run
from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts
from tests.stages.train._train_support import make_student_config

BATCH, HELD = 4, 16  # the held-out cache is scored in one batch of all its sequences


def _precompute(teacher: Path, out: Path, texts: list[str], *extra: str) -> Path:
    from kdcache.pipeline.cli import main

    data = out.parent / f"{out.name}.txt"
    data.write_text("\n".join(texts) + "\n")
    assert main(["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--max-length",
                 "24", "--sequences-per-shard", "8", "--batch-size", "16", "--no-progress", "--top-k", "8",
                 *(extra or ("--features", "hidden,logits"))]) == 0
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api-eval")
    teacher = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    other = make_tiny_gpt2(root / "other-teacher", layers=3, hidden=32, heads=4, seed=1)
    paths = {"root": root, "cache": _precompute(teacher, root / "cache", sample_texts(32)),
             "heldout": _precompute(teacher, root / "heldout", sample_texts(HELD, seed=1)),
             "logits_only": _precompute(teacher, root / "logits-only", sample_texts(8), "--features", "logits"),
             "maps": _precompute(teacher, root / "maps", sample_texts(8), "--features", "hidden,attention"),
             "other": _precompute(other, root / "other", sample_texts(HELD, seed=1)),
             "student": make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2),
             "other_tokenizer": make_tiny_gpt2(root / "other-tokenizer", texts=["a b c d e f g", "x y z"] * 4)}
    shutil.rmtree(teacher)
    shutil.rmtree(other)
    return paths


def _args(out: Path, steps: int, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, per_device_eval_batch_size=HELD,
                learning_rate=1e-3, max_steps=steps, lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def _student(setup: dict[str, Path]) -> Any:
    return load_student(setup["student"], seed=0)


# ---- evaluation from a held-out cache ----------------------------------------------------------------------
def test_evaluate_reports_every_term_and_kdcache_eval_s_agreement(setup: dict[str, Path]) -> None:
    student = _student(setup)
    trainer = kdcache.CacheTrainer(student, _args(setup["root"] / "evaluate", 2), str(setup["cache"]),
                                   eval_cache=str(setup["heldout"]))
    trainer.train()
    metrics = trainer.evaluate()
    terms = {"loss", "ce", "topk_kl", "hidden", "hidden/s1_t1", "hidden/s2_t3"}
    assert {f"eval_{t}" for t in terms} | {"eval_top1_agreement", "eval_kl", "eval_perplexity"} <= set(metrics)
    assert metrics["eval_sequences"] == HELD
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]  # logged, so report_to sees it

    # The terms: the run's loss over the whole held-out cache in one batch, computed here by hand.
    loss = kdcache.DistillationLoss(str(setup["heldout"]), student)
    loss.projectors.load_state_dict(trainer.distill.projectors.state_dict())
    data = loss.dataset(batch_size=HELD)
    batch = data.to_device(next(iter(torch.utils.data.DataLoader(data, batch_size=None))), "cpu")
    student.eval()
    with torch.no_grad():
        by_hand = {k: float(v) for k, v in loss(loss.student_outputs(student, batch), batch).items()}
    for name in terms:
        assert metrics[f"eval_{name}"] == pytest.approx(by_hand[name], rel=1e-5), name

    # The agreement: what `kdcache eval` reports for the same student on the same cache.
    trainer.save_model(str(setup["root"] / "evaluate" / "student"))
    scored = evaluate_run(setup["root"] / "evaluate", kdcache.open_cache(str(setup["heldout"])),
                          student=setup["root"] / "evaluate" / "student")
    for name in ("top1_agreement", "kl", "perplexity"):
        assert metrics[f"eval_{name}"] == pytest.approx(scored[name], rel=1e-5), name


def test_a_heldout_cache_of_another_teacher_is_refused_by_name(setup: dict[str, Path]) -> None:
    with pytest.raises(kdcache.EvaluationError, match="its teacher '.*other-teacher' is not the training cache's"):
        kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "other", 1), str(setup["cache"]),
                             eval_cache=str(setup["other"]))
    with pytest.raises(kdcache.ApiError, match=r"eval_dataset=list: expected a cache"):
        kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "other", 1), str(setup["cache"]), eval_dataset=[])
    plain = kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "other", 1), str(setup["cache"]))
    once = plain.evaluate(eval_dataset=kdcache.open_cache(str(setup["heldout"])), metric_key_prefix="heldout")
    assert {"heldout_loss", "heldout_top1_agreement"} <= set(once)  # an opened cache, this once
    with pytest.raises(kdcache.EvaluationError, match="other-teacher"):
        plain.evaluate(eval_dataset=str(setup["other"]))
    with pytest.raises(kdcache.ApiError, match="eval_strategy 'steps' needs a held-out cache: pass eval_cache="):
        kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "other", 1, eval_strategy="steps", eval_steps=1),
                             str(setup["cache"]))


def test_early_stopping_stops_a_run_and_the_best_checkpoint_is_loaded(setup: dict[str, Path]) -> None:
    from transformers import EarlyStoppingCallback

    plain = kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "plain", 2), str(setup["cache"]))
    plain.train()
    # greater_is_better on a falling loss: the first evaluation stays the best, so the second fails to beat it
    # (patience 1 stops the run there) and load_best_model_at_end has an earlier checkpoint to go back to.
    args = _args(setup["root"] / "early", 10, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                 save_steps=1, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    trainer = kdcache.CacheTrainer(_student(setup), args, str(setup["cache"]), eval_dataset=str(setup["heldout"]),
                                   callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert trainer.state.global_step == 2 and trainer.state.best_metric == evals[0]["eval_loss"]
    best = setup["root"] / "early" / "checkpoint-1"
    assert trainer.state.best_model_checkpoint == str(best)
    trained = {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}
    reference = {r["step"]: r["loss"] for r in plain.state.log_history if "loss" in r}
    assert trained == reference  # evaluating between steps changes no training step
    from safetensors.torch import load_file

    weights, now = load_file(best / "model.safetensors"), trainer.model.state_dict()
    assert all(torch.equal(weights[k], now[k]) for k in weights)  # the student of step 1, not of step 2
    projectors = torch.load(best / "projectors.pt")["projectors"]
    loaded = trainer.distill.projectors.state_dict()
    assert all(torch.equal(projectors[k], loaded[k]) for k in projectors)  # and its projectors with it
    again = trainer.evaluate()
    assert again["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-6)


# ---- the API's smaller promises ----------------------------------------------------------------------------
def test_kdcache_exports_the_reader_and_the_error_classes() -> None:
    for name in ("ApiError", "CacheCheckError", "EvaluationError", "PartialCacheError", "ChecksumError"):
        assert issubclass(getattr(kdcache, name), kdcache.KdcacheError), name
    assert kdcache.CacheReader.__name__ == "CacheReader" and "CacheReader" in kdcache.__all__


def test_api_messages_use_the_api_s_spelling_and_guess_typos(setup: dict[str, Path]) -> None:
    student = _student(setup)
    with pytest.raises(kdcache.CacheCheckError) as refused:
        kdcache.DistillationLoss(str(setup["logits_only"]), student, gamma=1.0)
    assert "gamma=0" in str(refused.value) and "--gamma" not in str(refused.value), str(refused.value)
    with pytest.raises(kdcache.ApiError, match=r"'gama' \(did you mean 'gamma'\?\)"):
        kdcache.DistillationLoss(str(setup["cache"]), student, gama=1.0)
    loss = kdcache.DistillationLoss(str(setup["cache"]), student)
    with pytest.raises(kdcache.ApiError, match=r"batch_size=0: expected a whole number of sequences >= 1"):
        loss.dataset(batch_size=0)


def test_a_tokenizer_given_as_processing_class_is_checked(setup: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(setup["other_tokenizer"]))
    with pytest.raises(kdcache.CacheCheckError, match="tokenizer"):
        kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "tok", 1), str(setup["cache"]),
                             processing_class=tokenizer)
    loss = kdcache.DistillationLoss(str(setup["cache"]), _student(setup))
    with pytest.raises(kdcache.CacheCheckError, match="tokenizer"):
        kdcache.CacheTrainer(loss._student[0], _args(setup["root"] / "tok", 1), str(setup["cache"]), loss=loss,
                             processing_class=tokenizer)


def test_save_model_writes_a_student_folder_without_training_files(setup: dict[str, Path]) -> None:
    trainer = kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "save", 1, save_strategy="steps",
                                                          save_steps=1), str(setup["cache"]))
    trainer.train()
    out = setup["root"] / "save" / "student"
    trainer.save_model(str(out))
    assert (out / "model.safetensors").is_file() and (out / "projectors.pt").is_file()
    assert not (out / "kdcache_state.json").exists() and not (out / "training_args.bin").exists()
    checkpoint = setup["root"] / "save" / "checkpoint-1"  # a checkpoint keeps what a resume reads
    assert (checkpoint / "kdcache_state.json").is_file() and (checkpoint / "training_args.bin").is_file()


def test_a_partial_cache_trains_where_the_message_says(setup: dict[str, Path]) -> None:
    from kdcache.storage.schema.manifest import read_manifest, write_manifest

    partial = setup["root"] / "partial"
    shutil.copytree(setup["cache"], partial)
    write_manifest(partial, dataclasses.replace(read_manifest(partial), status="partial"))
    with pytest.raises(kdcache.PartialCacheError, match=r"kdcache\.open_cache\(path, allow_partial=True\)"):
        kdcache.DistillationLoss(str(partial), _student(setup))
    loss = kdcache.DistillationLoss(str(partial), _student(setup), allow_partial=True)
    assert loss.dataset(batch_size=BATCH).num_sequences == 32
    opened = kdcache.DistillationLoss(kdcache.open_cache(str(partial), allow_partial=True), _student(setup))
    assert opened.arrays == loss.arrays


# ---- kdcache train --eval-cache ----------------------------------------------------------------------------
def test_kdcache_train_scores_its_heldout_cache_every_n_steps(setup: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.pipeline.cli import main
    from kdcache.stages.train.logging import read_jsonl

    run = setup["root"] / "cli"
    common = ["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--batch-size", str(HELD),
              "--max-steps", "4", "--quiet", "--eval-every", "2"]
    assert main([*common, "--out", str(setup["root"] / "cli-other"), "--eval-cache", str(setup["other"])]) == 2
    refused = capsys.readouterr().err  # refused before training, naming the flag and the other teacher
    assert "--eval-cache" in refused and "other-teacher' is not the training cache's" in refused
    assert "Traceback" not in refused and not (setup["root"] / "cli-other" / "metrics.jsonl").exists()
    assert main([*common, "--out", str(run)]) == 2
    assert "eval_every 2 needs eval_cache" in capsys.readouterr().err
    assert main([*common, "--out", str(run), "--eval-cache", str(setup["heldout"])]) == 0
    evals = read_jsonl(run / "eval.jsonl")
    assert [r["step"] for r in evals] == [2, 4]
    terms = set(read_jsonl(run / "metrics.jsonl")[-1]) & {"loss", "ce", "topk_kl", "hidden", "hidden/s2_t3"}
    assert len(terms) == 5 and {f"eval_{t}" for t in terms} | {"eval_top1_agreement", "eval_kl"} <= set(evals[-1])

    # The last scores are the exported student's and projectors' loss on the whole held-out cache (one batch).
    student = load_student(run / "student", seed=0).eval()
    loss = kdcache.DistillationLoss(str(setup["heldout"]), student)
    loss.projectors.load_state_dict(torch.load(run / "projectors.pt")["projectors"])
    data = loss.dataset(batch_size=HELD)
    batch = data.to_device(next(iter(torch.utils.data.DataLoader(data, batch_size=None))), "cpu")
    with torch.no_grad():
        by_hand = {k: float(v) for k, v in loss(loss.student_outputs(student, batch), batch).items()}
    for name in terms:
        assert evals[-1][f"eval_{name}"] == pytest.approx(by_hand[name], rel=1e-5), name


# ---- the ecosystem's shapes --------------------------------------------------------------------------------
def test_the_dataset_resumes_from_its_state_dict(setup: dict[str, Path]) -> None:
    def take(data: Any, count: int) -> list[list[int]]:
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        return [b["sample_ids"].tolist() for _, b in zip(range(count), loader)]

    whole = take(kdcache.open_cache(str(setup["cache"])).dataset(batch_size=BATCH, arrays=["input_ids"]), 11)
    first = kdcache.open_cache(str(setup["cache"])).dataset(batch_size=BATCH, arrays=["input_ids"])
    assert take(first, 3) == whole[:3]
    state = first.state_dict()
    assert state == {"epoch": 0, "sample_index": 3 * BATCH, "seed": 0, "batch_size": BATCH, "world_size": 1}
    again = kdcache.CacheDataset(str(setup["cache"]), ["input_ids"], batch_size=BATCH)
    again.load_state_dict(state)
    assert take(again, 8) == whole[3:]  # on into the second epoch
    other = kdcache.CacheDataset(str(setup["cache"]), ["input_ids"], batch_size=BATCH, seed=1)
    with pytest.raises(kdcache.KdcacheError, match="seed was 0 in the checkpoint, now 1"):
        other.load_state_dict(state)


def test_the_trainer_takes_the_cache_as_its_train_dataset(setup: dict[str, Path]) -> None:
    data = kdcache.open_cache(str(setup["cache"])).dataset(batch_size=BATCH)
    given = kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "as-data", 2), train_dataset=data)
    given.train()
    by_path = kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "by-path", 2), str(setup["cache"]))
    by_path.train()
    logged = [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k}
              for t in (given, by_path) for r in t.state.log_history]
    assert logged[:2] == logged[3:5] and len(logged) == 6  # the same steps, terms and values
    with pytest.raises(kdcache.ApiError, match="train_dataset: batch_size 2 where TrainingArguments has 4"):
        kdcache.CacheTrainer(_student(setup), _args(setup["root"] / "as-data", 1),
                             train_dataset=kdcache.open_cache(str(setup["cache"])).dataset(batch_size=2))


def test_loss_options_ride_in_training_arguments_through_hf_argument_parser(setup: dict[str, Path]) -> None:
    from transformers import HfArgumentParser

    from kdcache.stages.train.api import LOSS_OPTIONS

    fields = {f.name for f in dataclasses.fields(kdcache.DistillationArguments)}
    assert set(LOSS_OPTIONS) - {"seed", "cross_tokenizer"} <= fields  # every loss and map option, typed
    config = setup["root"] / "args.yaml"
    config.write_text(f"output_dir: {setup['root'] / 'yaml'}\nper_device_train_batch_size: {BATCH}\nuse_cpu: true\n"
                      f"report_to: none\ngamma: 0.5\ntemperature: 1.5\nlayer_map: last\n"
                      f"eval_cache: {setup['heldout']}\n")
    (args,) = HfArgumentParser(kdcache.DistillationArguments).parse_yaml_file(str(config))
    assert (args.gamma, args.temperature, args.layer_map, args.alpha) == (0.5, 1.5, "last", None)
    (flags,) = HfArgumentParser(kdcache.DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir", str(setup["root"] / "flags"), "--gamma", "0.5", "--layer_map", "last"])
    assert (flags.gamma, flags.layer_map) == (0.5, "last")
    trainer = kdcache.CacheTrainer(_student(setup), args, str(setup["cache"]))
    loss = trainer.distill.options.loss
    assert (loss.gamma, loss.logit.temperature, loss.alpha) == (0.5, 1.5, 1.0)  # alpha: kdcache train's default
    pairs = [tuple(p) for p in trainer.distill.plan.to_json()["hidden_pairs"]]
    assert pairs == [(1, 2), (2, 3)]  # last: onto the teacher's last layers (uniform would pair 1 with 1)
    assert trainer.heldout is not None and "eval_loss" in trainer.evaluate()
    with pytest.raises(kdcache.ApiError, match="gamma=0.5 in the arguments and 1.0 in loss_options"):
        kdcache.CacheTrainer(_student(setup), args, str(setup["cache"]), loss_options={"gamma": 1.0})


def test_the_loss_prints_nothing_and_says_when_it_changes_the_model(setup: dict[str, Path],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    student = _student(setup)
    before = student.config._attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: the model stays as it was
        kdcache.DistillationLoss(str(setup["maps"]), student)  # attention maps cached, left unused: a note once
    assert capsys.readouterr().err == "" and student.config._attn_implementation == before
    kdcache.DistillationLoss(str(setup["maps"]), student, announce=True)
    assert "leaves unused" in capsys.readouterr().err  # the notes, when asked for
    with pytest.warns(UserWarning, match=f"switched from '{before}' to 'kdcache_maps'"):
        kdcache.DistillationLoss(str(setup["maps"]), student, delta=1.0)
    assert student.config._attn_implementation == "kdcache_maps"


def test_the_readme_names_every_export() -> None:
    from tests.pipeline.test_readme import REPO

    section = (REPO / "README.md").read_text().split("## From your own training code", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in kdcache.__all__ if f"`kdcache.{name}" not in section and f"`{name}" not in section]
    assert not missing, missing
