"""``kdcache draft`` keeps stage two's checkpoints: a run stopped after k steps and resumed with ``--resume`` ends
with the weights of an uninterrupted run, and the run folder follows train's rules (a checkpoint is continued only
with ``--resume``; a resume with other options or another cache is refused, exit 2, the folder left as it was).

Every run here is in this process, one after the other, so the runs compared differ only in their interruption:
on the CPU (fp32, one rank) a resumed run replays the same batches in the same order, so the weights agree to the
last bit in practice; the bound allows 1e-6 absolute, the rounding of a reordered float32 reduction.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdcache.pipeline.cli import main
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.train._train_support import precompute_cache

ATOL = 1e-6
STEPS = 5  # 16 sequences at batch 4: four steps an epoch, so the runs cross an epoch boundary
DRAFT = ("--batch-size", "4", "--draft-vocab", "64", "--ttt-steps", "2", "--lr", "3e-3")
CACHE = ("--layers", "draft", "--features", "hidden,logits", "--logits", "head")


def _draft(cache: Path, out: Path, steps: int, *extra: str) -> None:
    assert main(["draft", "--cache", str(cache), "--out", str(out), "--max-steps", str(steps), *DRAFT, *extra]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted run of STEPS steps, and one stopped at step 3 (checkpoints at 2 and 3) then resumed."""
    root = tmp_path_factory.mktemp("draft-resume")
    target = make_tiny_llama(root / "target", layers=8, hidden=16, heads=2, kv_heads=1, intermediate=32)
    cache = precompute_cache(target, root / "cache", num_sequences=16, extra=CACHE)
    straight, stopped = root / "straight", root / "stopped"
    _draft(cache, straight, STEPS)
    _draft(cache, stopped, 3, "--save-every", "2")
    shutil.copytree(stopped, root / "at-step-3")  # the stopped run as it stood, before its resume
    _draft(cache, stopped, STEPS, "--save-every", "2", "--resume")
    return {"root": root, "target": target, "cache": cache, "straight": straight, "stopped": stopped,
            "at3": root / "at-step-3"}


def _worst(a: Path, b: Path) -> float:
    want, got = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert want.keys() == got.keys()
    return max(float((want[k].double() - got[k].double()).abs().max()) for k in want)


def _losses(run: Path) -> list[list[float]]:
    """``draft_run.json``'s loss and step-0 accuracy per step."""
    return [[x["loss"], x["accuracy"]] for x in json.loads((run / "draft_run.json").read_text())["losses"]]


def test_a_run_stopped_at_step_3_and_resumed_ends_with_the_uninterrupted_weights(runs):
    assert sorted(p.name for p in (runs["at3"] / "checkpoints").iterdir()) == ["latest", "step2", "step3"]
    assert _worst(runs["straight"], runs["stopped"]) <= ATOL
    assert _worst(runs["straight"], runs["at3"]) > 100 * ATOL  # three steps are not five: the check can fail
    straight, resumed = (_losses(runs["straight"]), _losses(runs["stopped"]))
    assert len(resumed) == STEPS  # steps 1-3 kept from the first leg, 4-5 from the resumed one
    torch.testing.assert_close(torch.tensor(resumed, dtype=torch.float64),
                               torch.tensor(straight, dtype=torch.float64), rtol=0, atol=ATOL)


def test_a_checkpoint_leaves_out_the_targets_frozen_embedding(runs):
    # The [V, d] embedding is read from the cache on every start: at V = 128k and d = 4096 it would add 2 GiB of
    # float32 to each checkpoint.
    (states,) = (runs["at3"] / "checkpoints" / "step3").rglob("*model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert "draft.fc.weight" in module and not [k for k in module if "embed" in k]


def test_a_run_killed_between_checkpoints_resumes_from_the_last_one(runs):
    # What a kill after step 3, before its checkpoint and export, leaves: the record and the step-2 checkpoint.
    killed = runs["root"] / "killed"
    shutil.copytree(runs["at3"], killed)
    for name in ("config.json", "model.safetensors", "draft_run.json"):
        (killed / name).unlink()
    shutil.rmtree(killed / "checkpoints" / "step3")
    (killed / "checkpoints" / "latest").write_text("step2")
    _draft(runs["cache"], killed, STEPS, "--resume")
    assert _worst(runs["straight"], killed) <= ATOL


@pytest.mark.parametrize("case", ["taken without --resume", "another option", "another cache", "nothing to resume",
                                  "fewer steps than done"])
def test_a_refused_run_exits_2_naming_why_and_leaves_the_folder_as_it_was(runs, case, capsys):
    other = runs["root"] / "other-cache"
    if case == "another cache" and not other.exists():
        precompute_cache(runs["target"], other, num_sequences=8, extra=CACHE)
    out = runs["root"] / "empty" if case == "nothing to resume" else runs["at3"]
    extra, message = {
        "taken without --resume": ((), f"{out} already holds a checkpoint; pass --resume to continue it, or choose "
                                       "another --out"),
        "another option": (("--resume", "--seed", "1"), "--seed: 0 in the run, 1 now"),
        "another cache": (("--resume", "--cache", str(other)), "--cache: another cache"),
        "nothing to resume": (("--resume",), f"--resume: no checkpoint in {out / 'checkpoints'}"),
        "fewer steps than done": (("--resume", "--max-steps", "2"), "--max-steps: 2 is below the checkpoint's step 3"),
    }[case]
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")} if out.exists() else {}
    capsys.readouterr()
    argv = ["draft", "--cache", str(runs["cache"]), "--out", str(out), "--max-steps", "4", *DRAFT, *extra]
    assert main(argv) == 2  # a later --cache or --max-steps wins over the first
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert before == ({p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")} if out.exists() else {})
