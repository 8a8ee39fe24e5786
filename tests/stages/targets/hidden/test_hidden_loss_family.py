"""The hidden-state losses as one family of objects (``stages/targets/hidden/``): each built-in loss says
what the rest of stage two asks of it, nothing outside the family compares their names, and a loss defined in a
test is one registration that ``kdcache train`` runs (flag, checks, projectors, the term, its evaluation) and
refuses again once it is removed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.hidden.hidden_losses import (
    HIDDEN_LOSSES,
    HiddenLoss,
    HiddenLossFlags,
    hidden_loss,
    register_hidden_loss,
)
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.losses import get_loss
from tests.stages.train._train_support import make_student_config, precompute_cache
from tests.test_source_rules import PACKAGES, _files, name_comparisons

FAMILY = "stages/targets/hidden/"


def test_each_built_in_loss_says_what_stage_two_asks_of_it() -> None:
    facts = {loss.name: (loss.projector, loss.empty_safe, loss.adversarial) for loss in HIDDEN_LOSSES.values()}
    assert facts == {"mse": (True, True, False), "cosine": (True, True, False), "cka": (False, False, False),
                     "cka_sqrt": (False, False, False), "wgan": (True, False, True)}
    for name in facts:  # one function per loss, whichever way it is asked for
        assert hidden_loss(name).resolved() is get_loss(name)
    assert HiddenLossFlags(hidden_loss="cka").loss() is HIDDEN_LOSSES["cka"]


def test_an_unknown_name_is_refused_naming_every_loss() -> None:
    with pytest.raises(LossError, match="unknown hidden loss 'l1'; choose one of mse, cosine, cka, cka_sqrt, wgan$"):
        HiddenLossFlags(hidden_loss="l1").loss()


def test_the_family_imports_without_torch() -> None:
    code = ("import sys; from kdcache.stages.train.core.options import LossOptions; "
            "print(LossOptions().hidden.loss().name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "mse False"


def test_no_file_outside_the_family_compares_a_hidden_loss_name() -> None:
    names = set(HIDDEN_LOSSES)
    planted = name_comparisons("if loss == 'wgan' or loss in ('cka', 'x'):\n    pass\n", names)
    assert planted == [(1, "cka"), (1, "wgan")]  # the checker finds them
    found = [f"{path}:{line}: compares {text!r}" for path, text in _files(*PACKAGES) if not path.startswith(FAMILY)
             for line, text in name_comparisons(text, names)]
    assert not found, "read the HiddenLoss's attributes instead:\n" + "\n".join(found)


class MaskedL1:
    """A toy hidden loss: the mean over trained tokens and dims of |h_s − h_t| (``[B, L, d_t]`` each, ``mask
    [B, L]``), counting its calls and whether the student's side carried a gradient."""

    def __init__(self) -> None:
        self.calls, self.with_grad = 0, 0

    def __call__(self, h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.with_grad += int(h_s.requires_grad)
        rows = mask.bool()
        return (h_s[rows].float() - h_t[rows].float()).abs().mean()


@pytest.fixture
def toy() -> Iterator[MaskedL1]:
    """``toy_l1`` registered for one test only (a projector, not empty-safe: the loss asks the counts first)."""
    function = MaskedL1()
    register_hidden_loss(HiddenLoss("toy_l1", function, projector=True, empty_safe=False))
    yield function
    HIDDEN_LOSSES.pop("toy_l1", None)


def test_a_hidden_loss_defined_in_a_test_trains_and_evaluates_through_kdcache_train(
        toy: MaskedL1, tiny_gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = precompute_cache(tiny_gpt2, tmp_path / "cache", num_sequences=8, extra=("--features", "hidden"))
    student = make_student_config(tmp_path / "student", tiny_gpt2, n_layer=1, n_embd=16, n_head=2)  # d_s < d_t
    out = tmp_path / "run"
    argv = ["train", "--cache", str(cache), "--student", str(student), "--out", str(out), "--hidden-loss", "toy_l1",
            "--layer-map", "last", "--max-steps", "1", "--batch-size", "4", "--eval-cache", str(cache), "--quiet"]
    assert main(argv) == 0
    assert toy.calls >= 2 and 0 < toy.with_grad < toy.calls  # trained (with a gradient), then evaluated (without)
    [step] = read_jsonl(out / "metrics.jsonl")
    [scored] = read_jsonl(out / "eval.jsonl")
    assert step["hidden"] > 0 and scored["eval_hidden"] > 0
    assert json.loads((out / "options.json").read_text())["hidden_loss"] == "toy_l1"
    assert any(k.startswith("layers.") for k in torch.load(out / "projectors.pt")["projectors"])  # projector=True
    capsys.readouterr()
    del HIDDEN_LOSSES["toy_l1"]  # removed: the flag's choices follow the registry
    with pytest.raises(SystemExit) as refused:
        main([*argv[:6], str(tmp_path / "again"), *argv[7:]])
    assert refused.value.code == 2 and "invalid choice: 'toy_l1'" in capsys.readouterr().err
