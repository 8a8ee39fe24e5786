"""The fused Triton kernel of the vocabulary pass (``stages/targets/logits/vocab/vocab_kernels.py``, ``fused_vocab``), run on the
CPU under Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``): every term, alone and together
with CE, at T = 1 and 2, in float32 and bfloat16, against a float64 reference written from the formulas and
against the pure-torch pass: value and gradient w.r.t. the hidden state, the head's weight and bias. Padded rows
hold NaN targets (and here a NaN hidden state) that must not leak; chunks of 3 rows and vocabulary blocks of 8
columns put boundaries everywhere. The kernel's statistics start as NaN, so a row it skipped fails.

Each test runs on every device the process can run the kernel on (``kernel_device``): the CPU under the interpreter, and
a CUDA device compiled, where there is one (conftest then leaves the interpreter off and the CPU cases skip). The
GPU's own shapes are in tests/stages/targets/logits/vocab/test_fused_kernel_gpu.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kdcache.stages.targets.logits.full_torch import kd_kl_term
from kdcache.stages.targets.logits.head_torch import head_kl_term
from kdcache.stages.targets.logits.sampled_torch import sampled_kl_term
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.topk_torch import topk_kl_term
from kdcache.stages.targets.logits.vocab import fused_vocab, kernel_guard, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.losses.logits import causal_ce_term
from tests.helpers.kernel_devices import on_device
from tests.stages.targets.logits.vocab import (
    test_vocab_pass as ref,  # its setup (garbage at padding) and references by formula
)

pytest.importorskip("triton")
pytestmark = pytest.mark.triton
ALPHA, BETA = ref.ALPHA, ref.BETA

# name -> (the KL's chunk term, its reference on full logits): ref.KINDS plus the renormalised and sampled KLs at T=1
KINDS: dict[str, tuple[Callable, Callable]] = {
    **{name: kind for name, kind in ref.KINDS.items() if name != "other"},  # "other" keeps the pure-torch pass
    "renorm_t3": (lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], variant="renorm",
                                            temperature=3.0), lambda z, s: ref._renorm(z, s, 3.0)),
    "renorm_t1": (lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], variant="renorm"),
                  lambda z, s: ref._renorm(z, s, 1.0)),
    "sampled_t1": (lambda z, s: sampled_kl_term(z, s["draws"], s["counts"], s["logp"], s["predicts"], 1.0),
                   lambda z, s: ref._sampled(z, s, 1.0)),
    "head_t1": (lambda z, s: head_kl_term(z, s["hidden_t"], lambda x: x @ s["w_t"].T, s["predicts"], 1.0),
                lambda z, s: ref._full(z, s, 1.0, s["hidden_t"] @ s["w_t"].T)),
    # the head as training builds it: a ``head`` cache's TeacherHead module (an instance, not a function)
    "head_module_t2": (lambda z, s: head_kl_term(z, s["hidden_t"], TeacherHead({"weight": s["w_t"]}, {"layer": 1}),
                                                 s["predicts"], 2.0),
                       lambda z, s: ref._full(z, s, 2.0, s["hidden_t"] @ s["w_t"].T)),
}


@pytest.fixture(autouse=True)
def _kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdcache.stages.targets.logits.vocab import vocab_kernels

    monkeypatch.setattr(fused_vocab, "INTERPRET_ON_CPU", True)
    # fused: a guard check that fails raises, so no test here can pass on the pure-torch road the guard falls back to
    kernel_guard.set_road("fused")
    monkeypatch.setattr(vocab_kernels, "MAX_BLOCK_V", 8)  # V = 23: three blocks, the last one partial
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 3)  # 14 rows: five chunks, the last one of 2


def _double(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 copies on the CPU (the references' place, whatever device the kernel ran on)."""
    return {k: v.cpu().double() if v.is_floating_point() else v.cpu() for k, v in s.items()}


def _reference(s: dict[str, torch.Tensor], kind: str, alpha: float = ALPHA) -> tuple[torch.Tensor, ...]:
    """α·CE + β·KL from the formulas on float64 full logits: value and gradients. A NaN hidden state at a padded
    position is 0 here (the formulas' own gradient would carry 0 · NaN into the head's)."""
    d = _double(s)
    d["hidden"] = d["hidden"].nan_to_num(0.0)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.linear(h, w, b)
        return alpha * ref._ce(z, d) + BETA * KINDS[kind][1](z, d)
    return ref._grads(loss, d)


def _torch_pass(s: dict[str, torch.Tensor], kind: str, alpha: float = ALPHA) -> tuple[torch.Tensor, ...]:
    """The same pass on the pure-torch road (the guard's reference, on any device)."""
    kernel_guard.set_road("torch")
    try:
        return _fused(s, kind, alpha)
    finally:
        kernel_guard.set_road("fused")


def _fused(s: dict[str, torch.Tensor], kind: str, alpha: float = ALPHA) -> tuple[torch.Tensor, ...]:
    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = HeadLogits(h, w, b)
        terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), KINDS[kind][0](z, s)]
        return vocab_pass.vocab_pass(z, terms, [alpha, BETA])[0]
    return ref._grads(loss, s)


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], rtol: float, atol: float) -> None:
    for name, g, w in zip(("value", "hidden", "weight", "bias"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.cpu().double(), w.cpu().double(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernel's launchers as they are called (so a test knows the kernel ran, not the torch pass)."""
    from kdcache.stages.targets.logits.vocab import vocab_kernels

    calls: list[str] = []
    for name in ("row_stats", "write_grad"):
        real = getattr(vocab_kernels, name)
        monkeypatch.setattr(vocab_kernels, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    return calls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ce_and_each_kl_match_the_float64_reference(kind: str, kernel_calls: list[str],
                                                    kernel_device: torch.device) -> None:
    s = on_device(ref._setup(0), kernel_device)
    s["hidden"][1, 6] = float("nan")  # a padded position's hidden state (a fully masked attention row)
    _close(_fused(s, kind), _reference(s, kind), rtol=2e-5, atol=2e-6)
    assert kernel_calls[:2] == ["row_stats", "write_grad"] and len(kernel_calls) == 2 * 5  # 14 rows, chunks of 3


@pytest.mark.parametrize("kind", ["renorm_t2", "full_t2", "head", "sampled"])
def test_each_kl_alone_matches_the_reference(kind: str, kernel_device: torch.device) -> None:
    s = on_device(ref._setup(1), kernel_device)
    _close(_fused(s, kind, alpha=0.0), _reference(s, kind, alpha=0.0), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["renorm_t2", "full_t1", "sampled"])
def test_the_kernel_equals_the_pure_torch_pass(kind: str, kernel_device: torch.device) -> None:
    s = on_device(ref._setup(2), kernel_device)
    _close(_fused(s, kind), _torch_pass(s, kind), rtol=1e-5, atol=1e-6)


def test_every_term_in_one_pass(kernel_calls: list[str], kernel_device: torch.device) -> None:
    """CE, the renormalised KL at T = 3 (it reads no statistic at T, so it joins any pass), and the sampled and the
    head's KL at T = 2 in one pass: the weighted sum of each."""
    s = on_device(ref._setup(3), kernel_device)
    names, weights = ["renorm_t3", "sampled", "head"], [0.5, 0.25, 1.5]

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = HeadLogits(h, w, b)
        terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), *(KINDS[n][0](z, s) for n in names)]
        return vocab_pass.vocab_pass(z, terms, [ALPHA, *weights])[0]

    def reference(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z, d = torch.nn.functional.linear(h, w, b), _double(s)
        return ALPHA * ref._ce(z, d) + sum(c * KINDS[n][1](z, d) for c, n in zip(weights, names))
    _close(ref._grads(loss, s), ref._grads(reference, _double(s)), rtol=2e-5, atol=2e-6)
    assert "row_stats" in kernel_calls


def test_a_term_that_counts_nothing_adds_exactly_zero(kernel_calls: list[str], kernel_device: torch.device) -> None:
    """The KL counts no row (its mask all 0, its targets all NaN): the pass is CE's alone, bit for bit finite."""
    s = on_device(ref._setup(4), kernel_device)
    s["predicts"] = torch.zeros_like(s["predicts"])
    s["values"].fill_(float("nan"))

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = HeadLogits(h, w, b)
        terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), KINDS["renorm_t2"][0](z, s)]
        total, values = vocab_pass.vocab_pass(z, terms, [ALPHA, BETA])
        assert values[1] == 0
        return total

    def ce(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ALPHA * ref._ce(torch.nn.functional.linear(h, w, b), _double(s))
    _close(ref._grads(loss, s), ref._grads(ce, _double(s)), rtol=2e-5, atol=2e-6)
    assert kernel_calls


@pytest.mark.parametrize("kind", ["renorm_t2", "full_t2", "sampled"])
def test_bfloat16_head_matches_the_pure_torch_pass_in_bfloat16(kind: str, kernel_device: torch.device) -> None:
    """bf16 logits (the kernel writes dz in bf16, as liger does) against the pure-torch pass on the same logits."""
    s = on_device(ref._setup(5), kernel_device)
    for k in ("hidden", "weight", "bias"):
        s[k] = s[k].bfloat16()
    _close(_fused(s, kind), _torch_pass(s, kind), rtol=3e-2, atol=3e-2)


def test_two_temperatures_or_a_term_without_a_feed_take_the_pure_torch_pass(kernel_calls: list[str]) -> None:
    """Two terms reading the statistics at different T (the full KL at 2, the sampled at 1), a term without a feed,
    and the other-bucket KL (its tail mass needs a masked logsumexp the kernel lacks): the pure-torch pass."""
    s = ref._setup(6)
    z = HeadLogits(*(s[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")))
    two_t = [kd_kl_term(z, s["teacher"], s["predicts"], 2.0), KINDS["sampled_t1"][0](z, s)]
    vocab_pass.vocab_pass(z, two_t, [1.0, 1.0])
    assert kernel_calls == []
    no_feed = vocab_pass.ChunkTerm(lambda z_, _y: z_.logsumexp(-1), s["predicts"], (s["ids"],))
    vocab_pass.vocab_pass(z, [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), no_feed], [1.0, 1.0])
    assert kernel_calls == []
    other = topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], s["lse"], variant="other")
    vocab_pass.vocab_pass(z, [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), other], [1.0, 1.0])
    assert kernel_calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_confident_row_keeps_its_label_gradient_in_the_logits_dtype(dtype: torch.dtype, kernel_device: torch.device) -> None:
    """s_y = 0.999: bf16(s_y) is 1.0, so a label's -1 added to the stored dense part would give 0; the kernel's
    gradient at the ids is formed in float32 and rounded once, as the pure-torch pass and liger do. A label that is
    also a top-k id gets both parts."""
    from kdcache.stages.targets.logits.vocab.kernel_feeds import ce_feed

    V, y = 23, 5
    z = torch.zeros(2, V, device=kernel_device)
    z[:, y] = 10.0
    want = torch.softmax(z, -1)
    want[:, y] -= 1.0
    grad = fused_vocab.chunk_grad([ce_feed(), ce_feed()], torch.ones(2), [1, 1])
    keep, labels = torch.ones(2, dtype=torch.bool, device=kernel_device), torch.full((2,), y, device=kernel_device)
    _, dz = grad(z.to(dtype), torch.tensor([1.0, 0.5], device=kernel_device), keep, labels, keep, labels)
    torch.testing.assert_close(dz.float(), 1.5 * want.to(dtype).float(), rtol=1e-2, atol=1e-6)
    assert (dz[:, y].float() < -1e-3).all() and abs(float(dz[:, y][0]) - 1.5 * float(want[0, y])) < 2e-5
