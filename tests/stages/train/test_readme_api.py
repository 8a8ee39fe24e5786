"""The README's Python examples ("From your own training code") on the cache the README builds for them, as a new
user pastes them: the causal cache and student its bash lines make from a causal teacher, then the ``Trainer`` and
loop examples as written. The loop gives ``kdcache train``'s per-step losses; every output scores with
``kdcache eval --run`` as the trained student; one ``projectors.pt`` layout; an idle loss option is named.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from tests.helpers.tiny_models import make_tiny_llama, sample_texts, write_text_dataset
from tests.pipeline.test_readme import readme_block

SECTION = "## From your own training code"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's names made here (a 4-block Llama teacher ``my-llama``, ``mine.jsonl``, ``heldout.jsonl``), then
    the section's bash lines in turn; the teacher is deleted before any training."""
    root = tmp_path_factory.mktemp("readme-api")
    make_tiny_llama(root / "my-llama", layers=4, hidden=32, heads=4, kv_heads=2)
    texts = sample_texts(48)
    write_text_dataset(root / "mine.jsonl", texts[:40])
    write_text_dataset(root / "heldout.jsonl", texts[40:])
    lines = [line for line in readme_block(SECTION, "bash").splitlines() if line.strip()]
    assert [line.split()[1] for line in lines] == ["precompute", "precompute", "init-student"], lines
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for line in lines:
            assert main([*shlex.split(line)[1:], *(["--no-progress"] if "precompute" in line else [])]) == 0, line
    return root


def _run_example(folder: Path, heading: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(folder)
    scope: dict[str, Any] = {}
    exec(compile(readme_block(heading, "python"), "README.md", "exec"), scope)
    return scope


def _eval(folder: Path, run: str) -> dict[str, Any]:
    """``kdcache eval --cache heldout-lm --run RUN``: the record it writes."""
    assert main(["eval", "--cache", str(folder / "heldout-lm"), "--run", str(folder / run)]) == 0
    [record] = (folder / run / "evals").glob("*.json")
    return dict(json.loads(record.read_text()))


def test_the_trainer_example_runs_and_its_output_scores_as_trained(folder: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _run_example(folder, "### With transformers' Trainer", monkeypatch)
    run = folder / "run-hf"
    assert (run / "model.safetensors").is_file() and (run / "checkpoint-10" / "kdcache_state.json").is_file()
    assert set(torch.load(run / "projectors.pt")) == {"projectors"}  # train's layout
    record = _eval(folder, "run-hf")
    assert record["role"] == "trained" and record["student"] == str(run) and 0 <= record["top1_agreement"] <= 1


def test_the_loop_example_gives_kdcache_train_s_losses(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scope = _run_example(folder, "### In a loop of your own", monkeypatch)
    run_training(TrainOptions.of(cache=str(folder / "cache-lm"), student=str(folder / "student-lm"),
                                 out=str(folder / "run-cli"), max_steps=10, batch_size=8, gamma=1.0, log_every=1,
                                 quiet=True))
    cli = [r["loss"] for r in read_jsonl(folder / "run-cli" / "metrics.jsonl")]
    assert len(scope["losses"]) == len(cli) == 10
    for step, (mine, theirs) in enumerate(zip(scope["losses"], cli), 1):
        assert mine == pytest.approx(theirs, rel=1e-6), (step, mine, theirs)
    ours, train = torch.load(folder / "run-loop" / "projectors.pt"), torch.load(folder / "run-cli" / "projectors.pt")
    assert set(ours) == set(train) == {"projectors"} and set(ours["projectors"]) == set(train["projectors"])
    assert json.loads((folder / "run-loop" / "plan.json").read_text())["hidden_pairs"] == [[1, 2], [2, 4]]
    record = _eval(folder, "run-loop")
    assert record["role"] == "trained" and record["student"].endswith("run-loop/student")


def test_a_temperature_without_logits_is_named(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    import kdcache

    assert main(["precompute", "--teacher", str(folder / "my-llama"), "--data", str(folder / "mine.jsonl"), "--out",
                 str(folder / "cache-hidden"), "--layers", "2,4", "--features", "hidden", "--no-progress"]) == 0
    student = AutoModelForCausalLM.from_pretrained(str(folder / "student-lm"))
    idle = "temperature 3.0 does nothing here: it scales the logit KL, and the cache holds no teacher logits"
    with pytest.warns(UserWarning, match=re.escape(idle)):  # the API prints no notes, but warns of an idle option
        kdcache.DistillationLoss(str(folder / "cache-hidden"), student, gamma=1.0, temperature=3.0)
    capsys.readouterr()
    options = ["--alpha", "0", "--beta", "0", "--gamma", "1", "--temperature", "3.0", "--max-steps", "1"]
    assert main(["train", "--cache", str(folder / "cache-hidden"), "--student", str(folder / "student-lm"),
                 "--out", str(folder / "run-idle"), *options]) == 0
    said = capsys.readouterr()
    assert f"note: {idle}" in said.out + said.err  # the CLI says it among its notes


def test_a_lora_output_scores_through_its_adapters(folder: Path) -> None:
    """``save_model`` of a PEFT student writes adapters only; eval merges them into the base its config names."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, TrainingArguments

    import kdcache

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    student = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder / "student-lm")), config)
    args = TrainingArguments(output_dir=str(folder / "lora-out"), per_device_train_batch_size=8, learning_rate=3e-2,
                             max_steps=4, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = kdcache.CacheTrainer(student, args, str(folder / "cache-lm"), loss_options={"gamma": 1.0})
    trainer.train()
    trainer.save_model(str(folder / "run-lora"))
    assert not (folder / "run-lora" / "config.json").exists()  # adapters only
    trained = _eval(folder, "run-lora")
    assert trained["role"] == "trained" and trained["student"] == str(folder / "run-lora")
    assert any(float(p.detach().abs().max()) > 0 for n, p in student.named_parameters() if "lora_B" in n)  # trained
    student.merge_and_unload().save_pretrained(str(folder / "merged"))  # what the adapters make of the base
    merged, base = (_baseline(folder, name) for name in ("merged", "student-lm"))
    # The adapters' path and the merged weights round apart (a KL of 2e-4 moves by ~1e-5 relative); the base
    # student, which is what eval scored before (or nothing: it refused the folder), is far from both.
    assert abs(trained["kl"] - merged["kl"]) < 0.01 * abs(trained["kl"] - base["kl"])


def _baseline(folder: Path, student: str) -> dict[str, Any]:
    """``kdcache eval --cache heldout-lm --run RUN --student STUDENT`` into a run folder of its own: the record."""
    run = folder / f"scored-{student}"
    assert main(["eval", "--cache", str(folder / "heldout-lm"), "--run", str(run), "--student",
                 str(folder / student)]) == 0
    return dict(json.loads(next((run / "evals").glob("baseline@*.json")).read_text()))
