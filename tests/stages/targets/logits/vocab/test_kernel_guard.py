"""The guard of the fused vocabulary kernel (``stages/targets/logits/vocab/kernel_guard.py``), on the CPU under Triton's
interpreter (and on a CUDA device compiled, where there is one: ``kernel_device``): a planted kernel that raises and one that writes wrong values are caught on their first chunk; on
``auto`` the pass goes on with the pure-torch road, saying so in one line, and equals that road's result; on
``fused`` the pass stops with ``KernelCheckFailed``; on ``torch`` the kernel never runs. A kernel that passes is
checked once per kind of pass, not per chunk."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kdcache.stages.targets.logits.vocab import fused_vocab, kernel_guard, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.losses.logits import causal_ce_term
from tests.helpers.kernel_devices import on_device
from tests.stages.targets.logits.vocab import test_vocab_pass as ref
from tests.stages.targets.logits.vocab.test_fused_kernel import KINDS

pytest.importorskip("triton")
pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kdcache.stages.targets.logits.vocab import vocab_kernels

    monkeypatch.setattr(fused_vocab, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(vocab_kernels, "MAX_BLOCK_V", 8)
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 5)  # 14 rows: three chunks
    yield


def _plant(monkeypatch: pytest.MonkeyPatch, wrong: Callable[[torch.Tensor], None]) -> list[int]:
    """Replace the kernel's gradient launcher by the real one followed by ``wrong(z)``; the calls are counted."""
    from kdcache.stages.targets.logits.vocab import vocab_kernels

    real, calls = vocab_kernels.write_grad, []

    def planted(z: torch.Tensor, *args: object) -> None:
        calls.append(len(z))
        real(z, *args)
        wrong(z)
    monkeypatch.setattr(vocab_kernels, "write_grad", planted)
    return calls


def _raise(z: torch.Tensor) -> None:
    raise RuntimeError("triton.runtime.errors.OutOfResources: shared memory, Required: 262144")


def _off_by_two_percent(z: torch.Tensor) -> None:
    z.mul_(1.02)


def _pass(s: dict[str, torch.Tensor], kind: str = "renorm_t2", alpha: float = ref.ALPHA) -> tuple[torch.Tensor, ...]:
    """α·CE + β·KL through ``vocab_pass``: the value, the per-term values and the gradients of hidden, weight, bias."""
    values: list[torch.Tensor] = []

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = HeadLogits(h, w, b)
        terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), KINDS[kind][0](z, s)]
        total, per_term = vocab_pass.vocab_pass(z, terms, [alpha, ref.BETA])
        values.append(per_term)
        return total
    total, *grads = ref._grads(loss, s)
    return (total, values[0], *grads)


def _torch_road(s: dict[str, torch.Tensor], kind: str = "renorm_t2") -> tuple[torch.Tensor, ...]:
    kernel_guard.set_road("torch")
    try:
        return _pass(s, kind)
    finally:
        kernel_guard.set_road("auto")


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("wrong, said", [(_raise, "raised RuntimeError: triton.runtime.errors.OutOfResources"),
                                         (_off_by_two_percent, "disagrees with the pure-torch pass: dz ")])
def test_a_failing_kernel_on_auto_says_so_once_and_the_pass_is_the_pure_torch_one(
        wrong: Callable[[torch.Tensor], None], said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], kernel_device: torch.device) -> None:
    s = on_device(ref._setup(0), kernel_device)
    want = _torch_road(s)
    calls = _plant(monkeypatch, wrong)
    _same(_pass(s), want)
    _same(_pass(s), want)  # a second pass: the kernel is not tried again
    assert len(calls) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], lines
    assert "goes on with the pure-torch pass" in lines[0] and "Please report this line" in lines[0]
    assert kernel_guard.GUARD.given_up is not None and not fused_vocab.takes(torch.device("cpu"), [None])


@pytest.mark.parametrize("wrong", [_raise, _off_by_two_percent])
def test_a_failing_kernel_on_fused_stops_the_pass(wrong: Callable[[torch.Tensor], None],
                                                  monkeypatch: pytest.MonkeyPatch, kernel_device: torch.device) -> None:
    kernel_guard.set_road("fused")
    _plant(monkeypatch, wrong)
    with pytest.raises(kernel_guard.KernelCheckFailed, match="--vocab-kernel fused stops here"):
        _pass(on_device(ref._setup(0), kernel_device))


def test_a_bfloat16_kernel_off_by_two_percent_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                        kernel_device: torch.device) -> None:
    """The bf16 bound (1.6% of the largest |dz|) passes the real kernel (tests/stages/targets/logits/vocab/test_fused_kernel.py runs every
    bf16 case on ``fused``) and refuses one that scales dz by 1.02."""
    s = on_device(ref._setup(5), kernel_device)
    for k in ("hidden", "weight", "bias"):
        s[k] = s[k].bfloat16()
    kernel_guard.set_road("fused")
    _plant(monkeypatch, _off_by_two_percent)
    with pytest.raises(kernel_guard.KernelCheckFailed, match="bfloat16"):
        _pass(s, "full_t2")


def test_the_torch_road_never_runs_the_kernel(monkeypatch: pytest.MonkeyPatch, kernel_device: torch.device) -> None:
    calls = _plant(monkeypatch, _raise)
    kernel_guard.set_road("torch")
    _pass(on_device(ref._setup(0), kernel_device))
    assert calls == [] and "pure torch" in fused_vocab.vocab_path(torch.device("cpu"))


def _count_reference_chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each chunk the pure-torch road computes from now on (the kernel's checks), appended as they run."""
    reference_chunks: list[int] = []
    real = vocab_pass._autograd_grad

    def counted(fn: Callable[..., torch.Tensor]) -> kernel_guard.ChunkGrad:
        grad = real(fn)
        return lambda z, *rest: reference_chunks.append(len(z)) or grad(z, *rest)
    monkeypatch.setattr(vocab_pass, "_autograd_grad", counted)
    return reference_chunks


def test_a_kernel_that_passes_is_checked_once_per_kind_of_pass(monkeypatch: pytest.MonkeyPatch,
                                                               kernel_device: torch.device) -> None:
    """The pure-torch chunk runs beside the kernel's first chunk only; a new kind of pass (another KL) is checked
    again."""
    reference_chunks = _count_reference_chunks(monkeypatch)
    s = on_device(ref._setup(0), kernel_device)
    for _ in range(2):
        _pass(s)
    assert reference_chunks == [5] and len(kernel_guard.GUARD.trusted) == 1
    _pass(s, "sampled_t1")
    assert reference_chunks == [5, 5] and len(kernel_guard.GUARD.trusted) == 2


def test_teacher_rows_of_another_dtype_are_checked_again(monkeypatch: pytest.MonkeyPatch,
                                                        kernel_device: torch.device) -> None:
    """Triton compiles a kernel per argument dtype: a full KL trusted on float32 teacher rows is checked once more
    when the rows come as stored (fp16, issue 63), and then trusted too."""
    reference_chunks = _count_reference_chunks(monkeypatch)
    s = on_device(ref._setup(0), kernel_device)
    _pass(s, "full_t2")
    _pass(s, "full_t2")
    assert reference_chunks == [5] and len(kernel_guard.GUARD.trusted) == 1
    half = {**s, "teacher": s["teacher"].half()}
    _pass(half, "full_t2")
    _pass(half, "full_t2")
    assert reference_chunks == [5, 5] and len(kernel_guard.GUARD.trusted) == 2


def test_fused_where_the_kernel_cannot_run_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_vocab, "INTERPRET_ON_CPU", False)
    with pytest.raises(kernel_guard.LossError, match="--vocab-kernel fused needs a CUDA device"):
        fused_vocab.use_road("fused", torch.device("cpu"))
    with pytest.raises(kernel_guard.LossError, match="vocab_kernel 'fast' is not a road"):
        fused_vocab.use_road("fast", torch.device("cpu"))
    assert fused_vocab.use_road("auto", torch.device("cpu")) is kernel_guard.VocabRoad.AUTO


def test_a_kernel_writing_at_rows_no_term_counts_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                           kernel_device: torch.device) -> None:
    """One chunk of all 14 rows, the last two padding: a kernel that writes there (the head's bias gradient sums
    every row) is refused, however small what it writes."""
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 14)
    kernel_guard.set_road("fused")
    _plant(monkeypatch, lambda z: z[-1].add_(1e-6))
    with pytest.raises(kernel_guard.KernelCheckFailed, match="non-zero gradients at rows no term counts"):
        _pass(on_device(ref._setup(0), kernel_device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_student_equal_to_its_teacher_passes_the_check(dtype: torch.dtype, kernel_device: torch.device) -> None:
    """KL alone (α = 0) against a teacher whose logits are the student's within 1e-5: dz is then mostly float32
    noise on both roads, far below the softmax entries it cancels (in fp32 the roads differ by 1.4e-8 where dz is
    8.8e-7). The bound's share of the heaviest coefficient lets the real kernel pass; without it (a bound taken on
    |dz| alone) the check refused it."""
    s = on_device(ref._setup(7), kernel_device)
    student = torch.nn.functional.linear(s["hidden"], s["weight"], s["bias"]).nan_to_num(0.0)
    s["teacher"] = student + 1e-5 * torch.randn(student.shape, generator=torch.Generator().manual_seed(0)).to(student)
    for k in ("hidden", "weight", "bias"):
        s[k] = s[k].to(dtype)
    kernel_guard.set_road("fused")
    _pass(s, "full_t1", alpha=0.0)
    assert kernel_guard.GUARD.trusted and kernel_guard.GUARD.given_up is None
