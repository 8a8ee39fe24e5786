"""The logit kinds registry (issue 21): each ``--logits`` mode one module, looked up by name.

Each kind round-trips on a tiny tensor: its ``--logits`` value parses, its spec fields make a valid ``CacheSpec``
whose storage layout lists exactly the arrays the capture returns, and its loss is 0 for a student equal to the
teacher and positive for another one.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.logits import KlSetup, LogitFlags, LogitKindError
from kdcache.stages.targets.logits.topk import STEP_PER_TOLERANCE
from kdcache.storage import CacheSpec
from kdcache.storage.core.logit_layouts import LAYOUTS, TOPK_MASS

V, B, L = 13, 2, 5
VALUES = {"topk": "topk", "full": "full", "sampled": "sampled:40", "head": "head"}
LOGITS = ("logits",)  # the run's features: logits cached


class _Head(torch.nn.Module):
    """A teacher head as stage two loads it: ``[N, d] -> [N, V]`` fp32 logits, reading cached layer ``layer``."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.layer = 3
        self.proj = torch.nn.Linear(d, V)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float())


def _flags(**overrides: Any) -> LogitFlags:
    return LogitFlags(**{"top_k": 4, **overrides})


def _spec(value: str, **flags: Any) -> CacheSpec:
    """The spec of ``--logits value``: the family's settings record, whole, as stage one's targets hand it over."""
    settings = _flags(logits_mode=value, **flags).settings(LOGITS)
    return CacheSpec(num_sequences=1, vocab_size=V, **settings.spec_fields())


def test_a_modes_settings_are_one_record_from_the_flags_to_the_spec_and_the_fingerprint() -> None:
    options = PrecomputeOptions.of(teacher="t", data="d", out="o", features=LOGITS, top_k=4, logits_mode="sampled:12",
                                   sample_temperature=0.7)  # flat names, as the flags give them
    flags = options.targets.logit
    assert flags == _flags(logits_mode="sampled:12", sample_temperature=0.7)  # land in the family's one group
    settings = flags.settings(options.targets.features)
    assert settings.kind is logit_kinds.get("sampled")
    assert pickle.loads(pickle.dumps(settings)) == settings  # equal by the mode's name, as a worker's copy is
    spec = CacheSpec(num_sequences=1, vocab_size=V, **settings.spec_fields())
    assert (spec.logits, spec.samples, spec.sample_temperature, spec.top_k, spec.topk_values) == (
        "sampled", 12, 0.7, 0, "fp16")
    assert settings.fingerprint() == {"top_k": 0, "logits": "sampled", "samples": 12, "sample_temperature": 0.7}
    logprob = _flags(topk_values="logprob", logprob_tolerance=0.01).settings(LOGITS)
    assert logprob.fingerprint()["logprob_step"] == STEP_PER_TOLERANCE * 0.01  # the same product as the kind's
    assert logprob.spec_fields()["topk_values"] == "logprob"
    none = _flags(sample_temperature=0.7).settings(("hidden",))
    assert none.kind is None and none.logit_layout is None and none.spec_fields()["logits"] is None
    assert none.fingerprint() == {"top_k": 0, "logits": None, "samples": 0, "sample_temperature": 0.7}


def test_every_kind_has_a_storage_layout_of_its_name() -> None:
    assert sorted(logit_kinds.names()) == sorted(LAYOUTS) == ["full", "head", "sampled", "topk"]


@pytest.mark.parametrize("value", ["bogus", "topk2", ""])
def test_an_unknown_mode_names_the_value_and_the_registered_modes(value: str) -> None:
    with pytest.raises(LogitKindError, match=f"got {value!r}") as info:
        logit_kinds.parse(value)
    assert all(name in str(info.value) for name in logit_kinds.names()) and "sampled:N" in str(info.value)
    with pytest.raises(LogitKindError, match=r"unknown logit mode 'bogus'; expected one of full, head, sampled, topk"):
        logit_kinds.get("bogus")


@pytest.mark.parametrize("value", ["sampled", "sampled:0", "sampled:256", "sampled:x", "sampled:012", "sampled:²", "topk:3",
                                   "full:1"])
def test_a_bad_argument_is_refused_naming_it(value: str) -> None:
    with pytest.raises(LogitKindError, match=value.partition(":")[0]):
        logit_kinds.parse(value)


def test_the_flags_report_a_bad_mode_as_a_problem() -> None:
    problems = _flags(logits_mode="sampled:300").problems(LOGITS)
    assert any("sampled:300" in p and "1..255" in p for p in problems)
    assert _flags(logits_mode="sampled:255").settings(LOGITS).samples == 255
    assert _flags(logits_mode="topk").settings(LOGITS).samples == 0
    assert _flags(top_k=0).problems(LOGITS) == ["top_k: got 0, must be >= 1"]
    assert _flags(top_k=0).problems(()) == []  # the mode's own check waits until logits are asked for


@pytest.mark.parametrize("name", ["topk", "full", "sampled", "head"])
def test_each_kind_round_trips_parse_spec_capture_and_loss(name: str) -> None:
    kind, argument = logit_kinds.parse(VALUES[name])
    assert kind.name == name and argument == (40 if name == "sampled" else 0)
    spec = _spec(VALUES[name])
    torch.manual_seed(0)
    teacher, mask = torch.randn(B, L, V), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    captured = kind.capture(teacher, spec, torch.Generator().manual_seed(1))
    assert sorted(set(captured) - {TOPK_MASS}) == sorted(spec.logit_arrays())  # the layout stores what it captures
    targets = {n: t.float() for n, t in captured.items()}
    head = _Head() if kind.teacher_head else None
    if head is not None:  # the teacher's logits come from its last layer through its head
        targets[f"hidden/{head.layer}"] = torch.randn(B, L, 6)
        teacher = head(targets[f"hidden/{head.layer}"]).detach()
    assert logit_kinds.from_targets(targets, head is not None) is kind
    setup = KlSetup(spec.sample_temperature, "renorm", head)
    same = kind.loss(teacher.clone().requires_grad_(), targets, mask, setup)
    other = kind.loss(torch.randn(B, L, V, requires_grad=True), targets, mask, setup)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-5) and float(other.detach()) > 0.05
    other.backward()
    top1 = kind.teacher_top1(targets, mask.bool(), head)
    assert torch.equal(top1, teacher[mask.bool()].argmax(-1))  # 40 draws of 13 ids include each row's top-1
    assert isinstance(kind.describe(spec.to_dict()), str) and kind.term in ("kl", f"{name}_kl")


def test_topk_with_logprob_values_captures_log_probabilities_without_the_logsumexp() -> None:
    kind = logit_kinds.get("topk")
    spec = _spec("topk", topk_values="logprob")
    logits = torch.randn(3, V)
    kept = kind.capture(logits, spec)
    assert "logits/lse" not in kept and sorted(set(kept) - {TOPK_MASS}) == sorted(spec.logit_arrays())
    exact = torch.log_softmax(logits, -1).gather(1, kept["logits/topk_ids"].long())
    assert torch.allclose(kept["logits/topk_values"], exact, atol=1e-6)
    assert spec.array_dtype("logits/topk_values") == np.uint16 and spec.gap_coded("logits/topk_values")


def test_the_checks_of_each_kind_against_the_student_and_the_loss() -> None:
    spec = SimpleNamespace(vocab_size=V, sample_temperature=0.5)
    assert logit_kinds.get("full").vocab_problems(spec, V + 1) and not logit_kinds.get("full").vocab_problems(spec, V)
    assert not logit_kinds.get("topk").vocab_problems(spec, V + 1) and logit_kinds.get("sampled").vocab_problems(
        spec, V - 1)
    other = SimpleNamespace(topk_kl="other", temperature=2.0)
    assert "exact only at T=1" in logit_kinds.get("topk").loss_problems(spec, other)[0]
    assert "--topk-kl other is a KL for caches written with --logits topk" in logit_kinds.get(
        "head").loss_problems(spec, other)[0]
    sampled = logit_kinds.get("sampled")
    assert "drawn at, 0.5" in sampled.loss_problems(spec, SimpleNamespace(topk_kl="renorm", temperature=2.0))[0]
    assert sampled.default_temperature(spec) == 0.5 and logit_kinds.get("topk").default_temperature(spec) is None


def test_the_registry_and_the_option_classes_import_without_torch_and_a_loss_loads_its_torch_half() -> None:
    """In a fresh process: the registry and the option classes load no torch and no torch half; a kind's first loss
    imports its own torch half (only its own), and the value is the KD KL written out in torch."""
    code = ("import sys; import kdcache.stages.targets.logits as kinds, kdcache.stages.precompute.core.options, "
            "kdcache.stages.train.core.options, kdcache.pipeline.cli.commands.cache; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "halves = lambda: sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.endswith('_torch')); "
            "assert halves() == [], halves(); "
            "import torch; z, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7); m = torch.ones(2, 3); "
            "got = kinds.get('full').loss(z, {'logits/full': t}, m, kinds.KlSetup(2.0)); "
            "want = 4 * torch.nn.functional.kl_div((z / 2).log_softmax(-1), (t / 2).log_softmax(-1), "
            "log_target=True, reduction='sum') / 6; "
            "assert torch.allclose(got.double(), want.double(), rtol=1e-5), (got, want); "
            "assert halves() == ['full_torch'], halves(); print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_a_kind_finds_its_torch_half_by_its_module_s_name_and_one_from_elsewhere_is_told_what_it_lacks() -> None:
    class TopKElsewhere(type(logit_kinds.get("topk"))):  # defined here, it keeps its parent's torch half
        pass

    class Bare(logit_kinds.LogitKind):
        layout = LAYOUTS["full"]

    assert [k.torch_module.rsplit(".", 1)[1] for k in logit_kinds.kinds()] == [f"{n}_torch" for n in logit_kinds.names()]
    assert TopKElsewhere.torch_module == "kdcache.stages.targets.logits.topk_torch"
    with pytest.raises(LogitKindError, match="logit mode 'full' has no torch half: .* sets no torch_module"):
        Bare().capture(torch.zeros(2, V), SimpleNamespace())


def test_a_kind_from_elsewhere_that_overrides_its_chunk_term_computes_its_loss_and_eval_kl() -> None:
    """``loss`` and ``eval_kl`` take the one pass's ``term_value`` from stage two, not from a torch half: a plugin's
    kind with no torch half that overrides ``chunk_term`` gives the full KL's values."""
    full = logit_kinds.get("full")

    class Plugin(logit_kinds.LogitKind):
        layout = LAYOUTS["full"]

        def chunk_term(self, logits: Any, targets: Any, mask: torch.Tensor, setup: KlSetup) -> Any:
            return full.chunk_term(logits, targets, mask, setup)

    g = torch.Generator().manual_seed(3)
    z_s, z_t = torch.randn(B, L, V, generator=g), torch.randn(B, L, V, generator=g)
    targets, mask, setup = {"logits/full": z_t}, torch.ones(B, L), KlSetup(2.0)
    assert torch.equal(Plugin().loss(z_s, targets, mask, setup), full.loss(z_s, targets, mask, setup))
    assert torch.equal(Plugin().eval_kl(z_s, targets, mask, setup), full.eval_kl(z_s, targets, mask, setup))
    assert Plugin().loss(z_s, targets, mask, setup) > 0
