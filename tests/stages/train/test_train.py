"""Stage two end to end on the CPU, one process: ZeRO 0/2/3, exact resumption, export, no teacher, bad inputs.

The caches are written by stage one (``kdcache precompute``), and the teacher is deleted as soon as they are, so
every run here is also a "no teacher" run.
DeepSpeed start-up dominates the cost, so runs are few and short, and the caches are module-scoped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from tests.helpers.tiny_models import make_tiny_gpt2, train_bpe_tokenizer
from tests.stages.train._train_support import make_student_config, precompute_cache

STEPS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    teacher = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=48)  # stage one, as users run it
    lean = precompute_cache(teacher, root / "lean", num_sequences=16, extra=("--features", "hidden", "--layers",
                                                                            "0,2"))
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    shutil.rmtree(teacher)  # stage two must never need it
    return {"root": root, "teacher": teacher, "cache": cache, "lean": lean, "student": student}


def _options(setup: dict[str, Path], out: str, **kw: object) -> TrainOptions:
    base = dict(cache=str(setup["cache"]), student=str(setup["student"]), out=str(setup["root"] / out),
                batch_size=4, lr=3e-3, log_every=1, delta=1.0, trace_samples=True, max_steps=STEPS)
    base.update(kw)
    return TrainOptions.of(**base)  # type: ignore[arg-type]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def zero0_run(setup: dict[str, Path]) -> Path:
    """A ZeRO-0 run through the CLI, with the teacher's files gone."""
    assert not setup["teacher"].exists()
    out = setup["root"] / "zero0"
    argv = ["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out", str(out),
            "--zero-stage", "0", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", "3e-3", "--delta", "1",
            "--log-every", "1", "--trace-samples", "--json"]
    assert main(argv) == 0
    return out


def test_trains_without_the_teacher_and_losses_fall(zero0_run: Path, setup: dict[str, Path]) -> None:
    losses = _losses(zero0_run)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    terms = read_jsonl(zero0_run / "metrics.jsonl")[0]
    assert {"ce", "topk_kl", "hidden", "attention", "hidden/s1_t1", "hidden/s2_t3"} <= set(terms)
    fingerprints = json.loads((setup["cache"] / "manifest.json").read_text())["fingerprints"]
    assert not Path(fingerprints["teacher"]["name_or_path"]).exists()


def test_exported_student_is_a_plain_hf_model(zero0_run: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(zero0_run / "student"))
    tokenizer = AutoTokenizer.from_pretrained(str(zero0_run / "student"))
    assert model.config.n_layer == 2 and len(tokenizer) == model.config.vocab_size
    assert not any("projector" in k or "criterion" in k for k in model.state_dict())
    projectors = torch.load(zero0_run / "projectors.pt")["projectors"]
    assert projectors["layers.s1_t1.weight"].shape == (32, 16)  # d_t x d_s, kept apart from the student


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_follow_the_same_trajectory(stage: int, zero0_run: Path, setup: dict[str, Path]) -> None:
    summary = run_training(_options(setup, f"zero{stage}", zero_stage=stage, max_steps=4))
    assert summary["zero_stage"] == stage and summary["steps"] == 4
    assert _losses(setup["root"] / f"zero{stage}") == pytest.approx(_losses(zero0_run)[:4], rel=1e-4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["student_dir"])  # gathered under ZeRO-3
    assert all(p.numel() > 0 for p in model.parameters())


def test_resume_after_a_checkpoint_reads_exactly_the_remaining_samples(setup: dict[str, Path]) -> None:
    # 48 sequences, batch 4, accumulation 2: 6 optimizer steps per epoch; 9 steps cross into epoch 1.
    kw = dict(zero_stage=2, grad_accum=2, save_every=2, max_steps=9)
    run_training(_options(setup, "straight", **kw))
    run_training(_options(setup, "killed", **{**kw, "max_steps": 5}))
    killed = setup["root"] / "killed"
    (killed / "checkpoints" / "latest").write_text("step4")  # as if killed after step 4's checkpoint
    summary = run_training(_options(setup, "killed", resume=True, **kw))
    assert summary["resumed_from"] == 4 and summary["steps"] == 9
    straight = read_jsonl(setup["root"] / "straight" / "samples-rank0.jsonl")
    resumed = {r["micro_step"]: r for r in read_jsonl(killed / "samples-rank0.jsonl")}  # the rerun wins
    assert sorted(resumed) == [r["micro_step"] for r in straight]
    assert [resumed[r["micro_step"]]["sample_ids"] for r in straight] == [r["sample_ids"] for r in straight]
    assert [resumed[r["micro_step"]]["loss"] for r in straight] == pytest.approx(
        [r["loss"] for r in straight], rel=1e-5)
    assert {r["epoch"] for r in straight} == {0, 1}


def test_other_hidden_losses_and_a_user_deepspeed_config(setup: dict[str, Path]) -> None:
    ds = setup["root"] / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 1}}))
    summary = run_training(_options(setup, "wgan", hidden_loss="wgan", delta=0.0, max_steps=2, deepspeed=str(ds),
                                    critic_steps=2))
    plan = json.loads((setup["root"] / "wgan" / "plan.json").read_text())
    assert summary["zero_stage"] == 1 and plan["grad_accum"] == 2
    state = torch.load(next((setup["root"] / "wgan" / "checkpoints" / "step2").glob("mp_rank_00_model_states.pt")),
                       weights_only=False)
    assert "critics" in state["kdcache"]  # the critics live outside the engine but are checkpointed
    summary = run_training(_options(setup, "cka", hidden_loss="cka", beta=0.0, max_steps=2,
                                    gradient_checkpointing=True, layer_map="last"))
    assert summary["last_loss"] is not None


@pytest.mark.parametrize("case, message", [
    ("no-cache", "does not exist; run `kdcache precompute` first"),
    ("vocab", "vocab size mismatch"),
    ("tokenizer", "tokenizer vocab differs"),
    ("layers", "needs teacher hidden layers 1, 3 but the cache holds 0, 2"),
    ("attention", "the attention term (--delta) needs attention maps"),
    ("logits", "the KL term (--beta) needs the teacher's logits"),
    ("topk-other", "exact only at T=1, but --temperature is 2"),
])
def test_bad_inputs_exit_2_with_a_clear_message(case: str, message: str, setup: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root, student, cache = setup["root"], str(setup["student"]), str(setup["lean"])
    extra = ["--beta", "0", "--delta", "0", "--layer-map", "explicit:1-2"]
    if case == "no-cache":
        cache = str(root / "nowhere")
    elif case == "vocab":
        student = str(make_student_config(root / "small-vocab", setup["student"], vocab_size=100))
    elif case == "tokenizer":
        other = make_student_config(root / "other-tok", setup["student"])
        train_bpe_tokenizer(other, vocab_size=320, texts=["completely different words here"] * 3)
        student = str(other)
    elif case == "layers":
        extra = ["--beta", "0", "--delta", "0", "--layer-map", "explicit:1-1,2-3"]
    elif case == "attention":
        extra = ["--beta", "0", "--delta", "1", "--layer-map", "explicit:1-2"]
    elif case == "logits":
        extra = ["--beta", "1", "--layer-map", "explicit:1-2"]
    elif case == "topk-other":
        cache = str(setup["cache"])
        extra = ["--beta", "1", "--topk-kl", "other", "--temperature", "2", "--delta", "0"]
    code = main(["train", "--cache", cache, "--student", student, "--out", str(root / f"bad-{case}"), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_cpu_optimizer_offload(zero0_run: Path, setup: dict[str, Path]) -> None:
    """ZeRO-2 with DeepSpeed's CPU Adam (compiled on first use, ~30 s)."""
    summary = run_training(_options(setup, "offload", zero_stage=2, offload=True, max_steps=3))
    assert _losses(setup["root"] / "offload") == pytest.approx(_losses(zero0_run)[:3], rel=1e-3)
    assert summary["steps"] == 3
