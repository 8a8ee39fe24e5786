"""The Python API (``kdcache.DistillationLoss``, ``kdcache.CacheDataset``, ``kdcache.CacheTrainer``) against
``kdcache train`` on the same caches, seed and batches, on the CPU in fp32: the same loss terms at step 1, the same
curve over 50 steps, an exact resume, ZeRO-2 through ``TrainingArguments(deepspeed=...)`` and a LoRA student (the
README's two examples as written: test_readme_api.py).

The caches are written by stage one and the teacher is deleted before any training, so nothing here can load it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdcache
from kdcache.stages.train.api import ApiError
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.core.student import load_student
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from tests.helpers.tiny_models import make_tiny_bart, make_tiny_gpt2, sample_pairs, write_pair_dataset
from tests.stages.train._train_support import make_student_config, precompute_cache

LR, BATCH = 1e-3, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api")
    teacher = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=32)  # hidden, attention maps, top-8 logits
    head = precompute_cache(teacher, root / "head", num_sequences=32,
                            extra=("--features", "hidden,logits", "--logits", "head", "--layers", "2,3"))
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)  # d_s 16: projectors
    shutil.rmtree(teacher)
    return {"root": root, "cache": cache, "head": head, "student": student}


def _cli_run(setup: dict[str, Path], name: str, cache: str, steps: int, **loss: Any) -> list[dict[str, Any]]:
    """``kdcache train`` (DeepSpeed ZeRO-0, fp32): its metrics, one record per step."""
    out = setup["root"] / name
    run_training(TrainOptions.of(cache=str(setup[cache]), student=str(setup["student"]), out=str(out),
                                 batch_size=BATCH, lr=LR, log_every=1, max_steps=steps, export=False, quiet=True,
                                 **loss))
    return read_jsonl(out / "metrics.jsonl")


def _args(out: Path, steps: int, **kw: Any) -> Any:
    """The optimizer ``kdcache train`` uses: AdamW at a constant LR, no weight decay, gradients clipped at 1."""
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, learning_rate=LR, max_steps=steps,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def _trainer(setup: dict[str, Path], name: str, cache: str, steps: int, loss: dict[str, Any],
             **kw: Any) -> kdcache.CacheTrainer:
    student = load_student(setup["student"], seed=0)  # as kdcache train loads it: the same init
    return kdcache.CacheTrainer(student, _args(setup["root"] / name, steps, **kw), str(setup[cache]),
                                loss_options=loss)


def _logged(trainer: Any) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}


def test_import_kdcache_stays_cheap_and_names_resolve() -> None:
    code = ("import sys, kdcache; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
            "print(kdcache.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(out) == ["ApiError", "Cache", "CacheCheckError", "CacheDataset", "CacheReader",
                                     "CacheTrainer", "ChecksumError", "DataPosition", "DistillationArguments",
                                     "DistillationLoss", "EvaluationError", "KdcacheError", "PartialCacheError",
                                     "TrainStep",
                                     "open_cache"]
    assert all(getattr(kdcache, name) is not None for name in kdcache.__all__)


BOOKKEEPING = {"step", "time_s", "lr", "epoch", "sample_index", "tokens", "data_wait_s", "data_wait_share"}
CASES = {
    "ce+topk_kl+hidden_mse_projected": ("cache", {}, {"ce", "topk_kl", "hidden", "hidden/s1_t1", "hidden/s2_t3"}),
    "ce+attention_kl": ("cache", {"beta": 0.0, "gamma": 0.0, "delta": 1.0}, {"ce", "attention", "attention/s2_t3"}),
    "head_mode": ("head", {}, {"ce", "kl", "hidden", "hidden/s2_t3"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_terms_at_step_one_equal_kdcache_train_s(setup: dict[str, Path], case: str) -> None:
    cache, loss, expected = CASES[case]
    cli = _cli_run(setup, f"cli-{case}", cache, 1, **loss)[0]
    trainer = _trainer(setup, f"hf-{case}", cache, 1, loss)
    trainer.train()
    hf = _logged(trainer)[1]
    terms = set(cli) - BOOKKEEPING  # the total and every term kdcache train logged
    assert expected | {"loss"} <= terms <= set(hf), (sorted(cli), sorted(hf))
    for name in terms:
        assert hf[name] == pytest.approx(cli[name], rel=1e-6, abs=1e-6), name
    if "hidden" in expected:  # d_s 16 against d_t 32: the hidden term went through the trained projectors
        assert sum(p.numel() for p in trainer.distill.projectors.parameters()) > 0


def test_a_seq2seq_student_s_terms_equal_kdcache_train_s(setup: dict[str, Path]) -> None:
    """BART from a two-stream cache: each stream's hidden and attention terms and the cross-attention KL."""
    from kdcache.pipeline.cli import main

    root = setup["root"] / "bart"
    teacher = make_tiny_bart(root / "teacher")
    data = write_pair_dataset(root / "pairs.jsonl", sample_pairs(16))
    assert main(["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(root / "cache"),
                 "--source-column", "source", "--target-column", "target", "--features",
                 "hidden,attention,cross_attention,logits", "--top-k", "8", "--max-length", "32", "--no-progress"]) == 0
    paths = {**setup, "bart": root / "cache",
             "student": make_student_config(root / "student", teacher, encoder_layers=1, decoder_layers=1)}
    shutil.rmtree(teacher)
    loss = {"delta": 1.0, "temperature": 1.0, "layer_map": "encoder:last decoder:explicit:1-2"}
    cli = _cli_run(paths, "cli-bart", "bart", 1, **loss)[0]
    trainer = _trainer(paths, "hf-bart", "bart", 1, loss)
    trainer.train()
    hf, terms = _logged(trainer)[1], set(cli) - BOOKKEEPING
    assert {"topk_kl", "encoder/hidden", "decoder/attention", "cross_attention/s1_t2"} <= terms <= set(hf)
    for name in terms:
        assert hf[name] == pytest.approx(cli[name], rel=1e-6, abs=1e-6), name


@pytest.fixture(scope="module")
def curves(setup: dict[str, Path]) -> tuple[list[float], dict[int, dict[str, float]]]:
    cli = [r["loss"] for r in _cli_run(setup, "cli-50", "cache", 50)]
    trainer = _trainer(setup, "hf-50", "cache", 50, {})
    trainer.train()
    return cli, _logged(trainer)


def test_fifty_step_curves_stay_within_one_percent(curves: tuple[list[float], dict[int, dict[str, float]]]) -> None:
    cli, hf = curves
    assert len(cli) == len(hf) == 50
    worst = max(abs(hf[step + 1]["loss"] - value) / abs(value) for step, value in enumerate(cli))
    assert worst < 0.01, worst
    assert sum(cli[-5:]) < sum(cli[:5])  # and it learns


def _stop_at(step: int) -> Any:
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()


def test_a_resumed_trainer_repeats_the_uninterrupted_run(setup: dict[str, Path]) -> None:
    loss = {"delta": 1.0}
    whole = _trainer(setup, "whole", "cache", 20, loss)
    whole.train()
    first = _trainer(setup, "split", "cache", 20, loss, save_strategy="steps", save_steps=10)
    first.add_callback(_stop_at(10))
    first.train()
    saved = setup["root"] / "split" / "checkpoint-10"
    state = json.loads((saved / "kdcache_state.json").read_text())
    assert (state["epoch"], state["sample_index"], state["micro_step"]) == (1, 8, 10)  # 8 steps an epoch of 32 / 4
    second = _trainer(setup, "split", "cache", 20, loss)
    second.train(resume_from_checkpoint=True)
    resumed, reference = _logged(second), _logged(whole)
    assert sorted(resumed) == list(range(1, 21))  # 1-10 from the checkpoint's history, 11-20 trained here
    for step in range(11, 21):
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-6), step
        assert resumed[step]["attention"] == pytest.approx(reference[step]["attention"], rel=1e-6), step
    ours, theirs = second.distill.projectors.state_dict(), whole.distill.projectors.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)


def test_a_lora_student_trains_saves_and_reloads(setup: dict[str, Path]) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0)
    student = peft.get_peft_model(load_student(setup["student"], seed=0), config)
    loss = {"alpha": 0.0, "beta": 1.0, "gamma": 1.0}
    args = _args(setup["root"] / "lora", 6, learning_rate=1e-2, report_to=["tensorboard"])  # under output_dir/runs
    trainer = kdcache.CacheTrainer(student, args, str(setup["cache"]), loss_options=loss)
    trainer.train()
    assert {"topk_kl", "hidden", "hidden/s2_t3"} <= set(_logged(trainer)[6])
    assert _logged(trainer)[6]["epoch"] == pytest.approx(0.75)  # the cache's epochs: 6 of its 8 steps
    assert {"train/topk_kl", "train/hidden/s2_t3"} <= _tensorboard_tags(setup["root"] / "lora" / "runs")
    names = {id(p): n for n, p in student.named_parameters()}
    names.update({id(p): "projector " + n for n, p in trainer.distill.named_parameters()})
    optimized = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    assert optimized and all("lora_" in n or n.startswith("projector ") for n in optimized), optimized
    assert any(n.startswith("projector ") for n in optimized)
    assert any(float(p.detach().abs().max()) > 0 for n, p in student.named_parameters() if "lora_B" in n)  # B starts at 0

    data = trainer.distill.dataset(batch_size=BATCH, seed=7)
    batch = data.to_device(next(iter(torch.utils.data.DataLoader(data, batch_size=None))), "cpu")
    before = _score(student, trainer.distill, batch)
    out = setup["root"] / "lora" / "final"
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    again = peft.PeftModel.from_pretrained(load_student(setup["student"], seed=0), str(out))
    reloaded = kdcache.DistillationLoss(str(setup["cache"]), again, announce=False, **loss)
    reloaded.projectors.load_state_dict(torch.load(out / "projectors.pt")["projectors"])
    after = _score(again, reloaded, batch)
    assert after.keys() == before.keys() and all(after[k] == pytest.approx(before[k], rel=1e-6) for k in before)


def _tensorboard_tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in folder.rglob("events.out.tfevents.*"):
        tags.update(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    return tags


def _score(student: Any, loss: Any, batch: dict[str, Any]) -> dict[str, float]:
    student.eval()
    with torch.no_grad():
        return {k: float(v) for k, v in loss(loss.student_outputs(student, batch), batch).items()}


def test_bad_input_is_refused_by_name(setup: dict[str, Path]) -> None:
    student = load_student(setup["student"], seed=0)
    with pytest.raises(ApiError, match="'gama'.*expected any of"):
        kdcache.DistillationLoss(str(setup["cache"]), student, gama=1.0)
    with pytest.raises(ApiError, match="gamma must be >= 0, got -1"):
        kdcache.DistillationLoss(str(setup["cache"]), student, gamma=-1.0)
    with pytest.raises(ApiError, match="train_dataset"):
        kdcache.CacheTrainer(student, _args(setup["root"] / "bad", 1), str(setup["cache"]), train_dataset=[])
    with pytest.raises(ApiError, match="rank 2 of world size 2"):
        kdcache.CacheDataset(str(setup["cache"]), ("input_ids",), batch_size=2, rank=2, world_size=2)


def test_what_the_trainer_cannot_do_right_is_refused(setup: dict[str, Path]) -> None:
    """Evaluation without a held-out cache, an optimizer without the projectors (they would never train); and the
    caller's TrainingArguments are left as given."""
    student = load_student(setup["student"], seed=0)
    args = _args(setup["root"] / "refused", 2)
    with pytest.raises(ApiError, match="eval_dataset=list: expected a cache"):
        kdcache.CacheTrainer(student, args, str(setup["cache"]), eval_dataset=[])
    with pytest.raises(ApiError, match="eval_strategy 'steps' needs a held-out cache"):
        kdcache.CacheTrainer(student, _args(setup["root"] / "refused", 2, eval_strategy="steps", eval_steps=1),
                             str(setup["cache"]))
    loss = kdcache.DistillationLoss(str(setup["cache"]), student, gamma=1.0)
    alone = torch.optim.AdamW(student.parameters(), lr=LR)
    with pytest.raises(ApiError, match="must hold the loss's parameters"):
        kdcache.CacheTrainer(student, args, str(setup["cache"]), loss=loss, optimizers=(alone, None))
    both = torch.optim.AdamW([*student.parameters(), *loss.parameters()], lr=LR)
    trainer = kdcache.CacheTrainer(student, args, str(setup["cache"]), loss=loss, optimizers=(both, None))
    assert args.max_steps == 2 and not args.ignore_data_skip and trainer.args.ignore_data_skip
    with pytest.raises(ApiError, match="no held-out cache"):
        trainer.evaluate()


def test_the_dataset_splits_ranks_and_resumes_exactly(setup: dict[str, Path]) -> None:
    def ids(rank: int, start: Any = None, count: int = 3) -> list[list[int]]:
        data = kdcache.CacheDataset(str(setup["cache"]), ("input_ids",), batch_size=2, rank=rank, world_size=2,
                                    start=start)
        batches = [b for _, b in zip(range(count), torch.utils.data.DataLoader(data, batch_size=None))]
        return [b["sample_ids"].tolist() for b in batches] + [data.position_after(batches[-1]).to_dict()]

    rank0, rank1 = ids(0), ids(1)
    assert not {i for b in rank0[:-1] for i in b} & {i for b in rank1[:-1] for i in b}
    later = ids(0, start=ids(0, count=1)[-1], count=2)
    assert later == rank0[1:]


def test_zero2_through_training_arguments_trains_on_the_cpu(setup: dict[str, Path]) -> None:
    """Last in the module: accelerate keeps DeepSpeed in its process-wide state, which is reset afterwards."""
    pytest.importorskip("deepspeed")
    from accelerate.state import AcceleratorState

    environ = dict(os.environ)
    with socket.socket() as free:  # a port no other test process holds (used when no process group exists yet)
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    zero2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    try:
        trainer = _trainer(setup, "zero2", "cache", 4, {}, deepspeed=zero2, save_strategy="steps", save_steps=4)
        before = {k: v.clone() for k, v in trainer.distill.projectors.state_dict().items()}
        trainer.train()
        assert trainer.model_wrapped.zero_optimization_stage() == 2
        first = _cli_run(setup, "cli-zero2", "cache", 1)[0]
        assert _logged(trainer)[1]["loss"] == pytest.approx(first["loss"], rel=1e-6)
        after = trainer.distill.projectors.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)  # DeepSpeed stepped the projectors
        saved = setup["root"] / "zero2" / "checkpoint-4"
        assert (saved / "projectors.pt").is_file()
        from safetensors import safe_open

        with safe_open(str(saved / "model.safetensors"), "pt") as weights:
            assert not [k for k in weights.keys() if "kdcache_loss" in k]  # the student is saved without the loss
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)


# The loss's state_dict keys as main's code wrote them before issue 57 made the loss one module (loss_keys_main.json:
# ``kdcache.DistillationLoss(...).state_dict()``, which held the loss as ``criterion``; ``kdcache train``'s
# DistillModel holds it as ``criterion`` too), so that checkpoints written before load after.
MAIN_KEYS = json.loads((Path(__file__).parent / "loss_keys_main.json").read_text())


def test_the_loss_keeps_the_checkpoint_keys_main_wrote(setup: dict[str, Path]) -> None:
    """One stream: the trained module's loss keys, the exported projectors' and the wgan critics' are main's, and a
    state dict of main's Python API loss loads into the one loss, values and all."""
    from kdcache.stages.train.loss import DistillModel

    student = load_student(setup["student"], seed=0)
    with pytest.warns(UserWarning, match="attention implementation was switched"):
        loss = kdcache.DistillationLoss(str(setup["cache"]), student, gamma=1.0, delta=1.0)
    trained = sorted(k for k in DistillModel(student, loss).state_dict() if not k.startswith("student."))
    assert trained == MAIN_KEYS["gpt2_api"]
    assert sorted(loss.projectors.state_dict()) == MAIN_KEYS["gpt2_projectors"]
    earlier = {f"criterion.{k}": v + 1.0 for k, v in loss.state_dict().items()}  # main's API loss, other values
    loss.load_state_dict(earlier, strict=True)
    assert all(torch.equal(v, earlier[f"criterion.{k}"]) for k, v in loss.state_dict().items())
    wgan = kdcache.DistillationLoss(str(setup["cache"]), student, gamma=1.0, hidden_loss="wgan")
    assert [f"criterion.{k}" for k in sorted(wgan.state_dict())] == MAIN_KEYS["gpt2_api_wgan"]
    assert wgan.critics is not None and sorted(wgan.critics.state_dict()) == MAIN_KEYS["gpt2_api_wgan_critics"]
