"""One pass over the LM head for every vocabulary term (``stages/targets/logits/vocab/vocab_pass.py``): α·CE + β·KL in one pass
equals the weighted sum of the terms written here from their formulas on full logits (value and gradient w.r.t. the
hidden state, the head's weight and bias; padding, a loss mask and packed rows, over several chunks), through a real
student in train mode with dropout on, and builds each chunk's logits once (the head's matmuls counted)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kdcache.stages.targets.logits.full_torch import kd_kl_term
from kdcache.stages.targets.logits.head_torch import head_kl_term
from kdcache.stages.targets.logits.sampled_torch import sampled_kl_term
from kdcache.stages.targets.logits.topk_torch import topk_kl_term
from kdcache.stages.targets.logits.vocab import head_logits, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.losses.logits import causal_ce_term

B, L, D, V, K, DRAWS, ALPHA, BETA = 2, 7, 6, 23, 5, 4, 0.7, 1.3
RTOL, ATOL = 1e-5, 1e-6  # float32; docs/losses.md


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 3)  # 3 rows a chunk: every pass crosses chunk boundaries
    monkeypatch.setattr(head_logits, "IDS_CHUNK", 2)


def _setup(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    teacher = torch.randn(B, L, V, generator=g) * 2
    values, ids = teacher.topk(K, -1)
    counts = torch.randint(0, 3, (B, L, DRAWS), generator=g)
    counts[..., 0] = 1
    s = {"hidden": torch.randn(B, L, D, generator=g), "weight": torch.randn(V, D, generator=g),
         "bias": torch.randn(V, generator=g), "ids": torch.randint(0, V, (B, L), generator=g).float(),
         "teacher": teacher, "values": values, "topk_ids": ids.float(), "lse": torch.logsumexp(teacher, -1),
         "draws": torch.randint(0, V, (B, L, DRAWS), generator=g), "counts": counts,
         "logp": -torch.rand(B, L, DRAWS, generator=g) * 3, "hidden_t": torch.randn(B, L, 5, generator=g),
         "w_t": torch.randn(V, 5, generator=g)}
    # Padding holds garbage (NaN ids and targets) that no row of any term may read.
    for k in ("ids", "teacher", "values", "topk_ids", "lse", "logp", "hidden_t"):
        s[k][1, 5:] = float("nan")
    masks = token_masks(mask, torch.tensor([[1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]),
                        torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 0]]), causal=True)  # 2 documents
    return {**s, "real": masks.real, "pairs": masks.pairs, "predicts": masks.predicts}


# ---- the terms from their formulas, on full logits z [B, L, V] ------------------------------------------------
def _ce(z: torch.Tensor, s: dict[str, torch.Tensor]) -> torch.Tensor:
    rows = [-F.log_softmax(z[b, t], -1)[int(s["ids"][b, t + 1])] for b in range(B) for t in range(L - 1)
            if s["pairs"][b, t]]
    return torch.stack(rows).mean()


def _kl(log_t: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    return (log_t.exp() * (log_t - log_s)).sum()


def _full(z: torch.Tensor, s: dict[str, torch.Tensor], t: float, teacher: torch.Tensor) -> torch.Tensor:
    sel = s["predicts"]
    return _kl(F.log_softmax(teacher[sel] / t, -1), F.log_softmax(z[sel] / t, -1)) / sel.sum() * t**2


def _renorm(z: torch.Tensor, s: dict[str, torch.Tensor], t: float) -> torch.Tensor:
    sel = s["predicts"]
    z_k = z[sel].gather(1, s["topk_ids"][sel].long())
    return _kl(F.log_softmax(s["values"][sel] / t, -1), F.log_softmax(z_k / t, -1)) / sel.sum() * t**2


def _other(z: torch.Tensor, s: dict[str, torch.Tensor]) -> torch.Tensor:
    sel = s["predicts"]
    p_t = (s["values"][sel] - s["lse"][sel][:, None]).exp()
    p_s = F.softmax(z[sel], -1).gather(1, s["topk_ids"][sel].long())
    p_t, p_s = (torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1) for p in (p_t, p_s))
    return (p_t * (p_t.log() - p_s.log())).sum() / sel.sum()


def _sampled(z: torch.Tensor, s: dict[str, torch.Tensor], t: float) -> torch.Tensor:
    sel = s["predicts"]
    c = s["counts"][sel].float()
    log_s = F.log_softmax(z[sel] / t, -1).gather(1, s["draws"][sel])
    return ((c / c.sum(-1, keepdim=True)) * (s["logp"][sel] - log_s)).sum() / sel.sum() * t**2


# name -> (the KL's chunk term, its reference)
KINDS: dict[str, tuple[Callable, Callable]] = {
    "renorm_t2": (lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], variant="renorm",
                                            temperature=2.0), lambda z, s: _renorm(z, s, 2.0)),
    "other": (lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], s["lse"], variant="other"),
              _other),
    "full_t1": (lambda z, s: kd_kl_term(z, s["teacher"], s["predicts"], 1.0),
                lambda z, s: _full(z, s, 1.0, s["teacher"])),
    "full_t2": (lambda z, s: kd_kl_term(z, s["teacher"], s["predicts"], 2.0),
                lambda z, s: _full(z, s, 2.0, s["teacher"])),
    "head": (lambda z, s: head_kl_term(z, s["hidden_t"], lambda x: x @ s["w_t"].T, s["predicts"], 2.0),
             lambda z, s: _full(z, s, 2.0, s["hidden_t"] @ s["w_t"].T)),
    "sampled": (lambda z, s: sampled_kl_term(z, s["draws"], s["counts"], s["logp"], s["predicts"], 2.0),
                lambda z, s: _sampled(z, s, 2.0)),
}


def _grads(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
           s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    h, w, b = (s[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    value = fn(h, w, b)
    value.backward()
    return value.detach(), h.grad, w.grad, b.grad


def _pass(z: torch.Tensor | HeadLogits, s: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), KINDS[kind][0](z, s)]
    return vocab_pass.vocab_pass(z, terms, [ALPHA, BETA])


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_pass_equals_the_weighted_sum_of_the_terms(kind: str) -> None:
    """Against the formulas on full logits, over HeadLogits (HeadPass) and over materialised logits (checkpoints)."""
    s = _setup(list(KINDS).index(kind))
    reference = lambda h, w, b: ALPHA * _ce(F.linear(h, w, b), s) + BETA * KINDS[kind][1](F.linear(h, w, b), s)  # noqa: E731
    want = _grads(reference, s)
    for build in (HeadLogits, F.linear):
        values: list[torch.Tensor] = []

        def combined(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, build: Callable = build,
                     values: list[torch.Tensor] = values) -> torch.Tensor:
            total, per_term = _pass(build(h, w, b), s, kind)
            values.append(per_term)
            return total
        for got, expected in zip(_grads(combined, s), want):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        with torch.no_grad():
            z = F.linear(s["hidden"], s["weight"], s["bias"])
            separate = torch.stack([_ce(z, s), KINDS[kind][1](z, s)])
        torch.testing.assert_close(values[0], separate, rtol=RTOL, atol=ATOL)
        assert not values[0].requires_grad


def test_under_no_grad_the_pass_gives_the_same_values() -> None:
    s = _setup(11)
    with torch.no_grad():
        total, values = _pass(HeadLogits(s["hidden"], s["weight"], s["bias"]), s, "other")
        z = F.linear(s["hidden"], s["weight"], s["bias"])
        torch.testing.assert_close(values, torch.stack([_ce(z, s), _other(z, s)]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(total, ALPHA * values[0] + BETA * values[1], rtol=RTOL, atol=ATOL)


class _HeadCalls:
    """Counts ``F.linear`` calls on the head's weight (each builds one chunk's logits) and ``HeadPass`` passes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, weight: torch.Tensor) -> None:
        self.linear = self.passes = 0
        linear, apply = F.linear, vocab_pass.HeadPass.apply

        def counted_linear(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
            self.linear += w is weight
            return linear(x, w, *args)

        def counted_apply(*args: object) -> object:
            self.passes += 1
            return apply(*args)
        monkeypatch.setattr(torch.nn.functional, "linear", counted_linear)
        monkeypatch.setattr(vocab_pass.HeadPass, "apply", counted_apply)


@pytest.mark.parametrize("kind", ["renorm_t2", "other", "full_t1", "sampled"])
def test_ce_and_a_kl_build_each_chunk_s_logits_once(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _setup(12)
    w = s["weight"].clone().requires_grad_(True)
    calls = _HeadCalls(monkeypatch, w)
    total, _ = _pass(HeadLogits(s["hidden"].requires_grad_(True), w), s, kind)
    total.backward()
    rows = int(s["predicts"].sum())  # the KL's rows hold the CE's: the union is the KL's
    assert calls.passes == 1
    assert calls.linear == -(-rows // loss_rows.LOSS_CHUNK)  # one matmul per chunk of rows, for both terms


def test_the_renormalised_kl_alone_builds_only_its_k_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, the renorm KL reads k logits per token (a gather of head rows): no pass over the full head."""
    s = _setup(13)
    w = s["weight"].clone().requires_grad_(True)
    calls = _HeadCalls(monkeypatch, w)
    z = HeadLogits(s["hidden"], w)
    total, _ = vocab_pass.vocab_pass(z, [KINDS["renorm_t2"][0](z, s)], [BETA])
    total.backward()
    assert (calls.passes, calls.linear) == (0, 0)
    torch.testing.assert_close(total, BETA * _renorm(F.linear(s["hidden"], s["weight"]), s, 2.0), rtol=RTOL,
                               atol=ATOL)


def test_a_step_with_dropout_is_its_terms_weighted_sum() -> None:
    """A real student in train mode, dropout on: ``CompoundLoss``'s α·CE + β·top-k KL (one pass) equals the sum of
    the formulas on the same forward's full logits, in value and in the gradient of every parameter."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kdcache.stages.common.option_groups import assemble
    from kdcache.stages.train.core.options import LossOptions
    from kdcache.stages.train.core.student_head import base_forward
    from kdcache.stages.train.objective.compound import CompoundLoss

    s = _setup(14)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.3,
                                       embd_pdrop=0.3, attn_pdrop=0.3, bos_token_id=0, eos_token_id=0)).train()
    loss_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    mask = s["real"].long()
    targets = {"input_ids": torch.nan_to_num(s["ids"]), "logits/topk_values": s["values"],
               "logits/topk_ids": s["topk_ids"], "logits/lse": s["lse"], "loss_mask": loss_mask,
               "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 0]])}
    loss = CompoundLoss(assemble(LossOptions, {"alpha": ALPHA, "beta": BETA, "topk_kl": "other", "temperature": 1.0}))
    inputs = {"input_ids": targets["input_ids"].long(), "attention_mask": mask}
    out = base_forward(model, model.lm_head, inputs, hidden=False, attentions=False)
    assert isinstance(out.logits, HeadLogits)
    terms = loss(out, targets, mask)
    got = torch.autograd.grad(terms["loss"], list(model.parameters()), retain_graph=True)
    z = model.lm_head(out.logits.hidden)  # the same forward (one dropout draw), its logits built whole
    want_value = ALPHA * _ce(z, s) + BETA * _other(z, s)
    want = torch.autograd.grad(want_value, list(model.parameters()))
    torch.testing.assert_close(terms["loss"], want_value, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(terms["ce"], _ce(z, s).detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(terms["topk_kl"], _other(z, s).detach(), rtol=RTOL, atol=ATOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_terms_that_each_have_a_road_of_their_own_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """When every term has its own cheaper road (a GPU with liger's CE beside the renorm KL), each takes it: no
    shared pass, and the weighted total, its values and gradients are the shared pass's (the same terms with
    their roads removed)."""
    from dataclasses import replace

    s = _setup(15)
    runs = []
    for apart in (True, False):
        w = s["weight"].clone().requires_grad_(True)
        h = s["hidden"].clone().requires_grad_(True)
        calls = _HeadCalls(monkeypatch, w)
        z = HeadLogits(h, w)
        terms = [KINDS["renorm_t2"][0](z, s), KINDS["renorm_t2"][0](z, s)]
        terms = terms if apart else [replace(t, alone=None) for t in terms]
        total, values = vocab_pass.vocab_pass(z, terms, [ALPHA, BETA])
        total.backward()
        assert calls.passes == (0 if apart else 1) and not values.requires_grad
        runs.append((total.detach(), values, h.grad, w.grad))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_a_full_kl_on_the_teacher_rows_as_stored_is_the_kl_on_their_float32_copy(stored: torch.dtype) -> None:
    """``to_device`` hands a full cache's fp16 / bf16 rows over as stored and each chunk widens its own (issue 63):
    value and gradients equal those from the whole float32 copy to the bit, train and no-grad, and stay within
    float32's tolerance of the formulas in float64."""
    s = _setup(5)
    narrow = {**s, "teacher": s["teacher"].to(stored)}  # the padding's NaN stays NaN
    wide = {**s, "teacher": narrow["teacher"].float()}
    wide64 = {k: v.double() if v.is_floating_point() else v for k, v in wide.items()}
    reference = lambda h, w, b: (ALPHA * _ce(F.linear(h, w, b), wide64)  # noqa: E731
                                 + BETA * _full(F.linear(h, w, b), wide64, 2.0, wide64["teacher"]))
    want64 = _grads(reference, wide64)
    for build in (HeadLogits, F.linear):
        got, same = (_grads(lambda h, w, b, t=t, build=build: _pass(build(h, w, b), t, "full_t2")[0], s)
                     for t in (narrow, wide))
        assert all(torch.equal(a, b) for a, b in zip(got, same))
        for a, b in zip(got, want64):
            torch.testing.assert_close(a.double(), b, rtol=RTOL, atol=ATOL)
        with torch.no_grad():
            values = [_pass(build(s["hidden"], s["weight"], s["bias"]), t, "full_t2")[1] for t in (narrow, wide)]
        assert torch.equal(values[0], values[1])
        z64 = F.linear(*(wide64[k] for k in ("hidden", "weight", "bias")))
        torch.testing.assert_close(values[0].double(), torch.stack([_ce(z64, wide64), _full(z64, wide64, 2.0,
                                                                                            wide64["teacher"])]),
                                   rtol=RTOL, atol=ATOL)
