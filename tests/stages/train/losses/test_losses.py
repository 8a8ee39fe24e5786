"""Each loss of the registry against a reference written independently: plain loops over the valid tokens."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.attention.maps_loss import attention_kl, group_teacher_heads
from kdcache.stages.targets.hidden.loss_terms import cka_loss, cka_sqrt_loss, cosine_loss, masked_mse
from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.targets.logits.topk_torch import topk_kl, topk_kl_other, topk_kl_renorm
from kdcache.stages.train.losses import get_loss, registered_losses
from kdcache.stages.train.losses.logits import causal_ce, token_ce
from kdcache.storage.core.errors import KdcacheError
from tests.stages.train.losses._loss_support import MASK, _poison, _valid, assert_blind_to_padding


def _log_softmax(v: list[float]) -> list[float]:
    top = max(v)
    z = math.log(sum(math.exp(x - top) for x in v)) + top
    return [x - z for x in v]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


# ---------------------------------------------------------------- registry


def test_registry_lists_every_definition():
    for name in ("ce", "kl", "topk_kl", "mse", "cosine", "cka", "cka_sqrt", "attention_kl", "wgan"):
        assert name in registered_losses()
        assert callable(get_loss(name))


def test_unknown_loss_names_the_registered_ones():
    with pytest.raises(LossError) as info:
        get_loss("kld")
    assert isinstance(info.value, KdcacheError)
    assert "kld" in str(info.value) and "cka_sqrt" in str(info.value) and "attention_kl" in str(info.value)



def test_vocabulary_losses_keep_their_names_and_keywords():
    """A vocabulary loss is its term's value (``vocab_pass.as_loss``) but keeps its own name, a keyword first
    argument and a scalar's signature; ``topk_kl_other`` without the logsumexp is a LossError, not a crash."""
    torch.manual_seed(0)
    z, t, m = torch.randn(2, 3, 11), torch.randn(2, 3, 11), torch.ones(2, 3)
    values, ids = torch.topk(t, 4)
    for loss, name in ((kd_kl, "kd_kl"), (topk_kl, "topk_kl"), (topk_kl_renorm, "topk_kl_renorm"),
                       (topk_kl_other, "topk_kl_other")):
        assert loss.__name__ == name and "-> torch.Tensor" in str(inspect.signature(loss))
    positional = kd_kl(z, t, m, temperature=2.0)
    by_keyword = kd_kl(student_logits=z, teacher_logits=t, mask=m, temperature=2.0)
    assert torch.equal(positional, by_keyword) and positional.dim() == 0
    with pytest.raises(LossError, match="logsumexp"):
        topk_kl_other(z, values, ids, None, m)

# ---------------------------------------------------------------- CE


def test_causal_ce_matches_loop_and_hf_shift():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    terms = [
        -_log_softmax(logits[b, t].tolist())[int(ids[b, t + 1])]
        for b, t in _valid(MASK)
        if t + 1 < 4 and MASK[b, t + 1]
    ]
    assert causal_ce(logits, ids, MASK).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    labels = ids.masked_fill(MASK == 0, -100)  # HF's recipe, right padding
    hf = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert causal_ce(logits, ids.float(), MASK).item() == pytest.approx(hf.item(), rel=1e-5)


def test_causal_ce_left_padding_ignores_predictions_from_pads():
    torch.manual_seed(1)
    logits, ids = torch.randn(1, 4, 5), torch.randint(0, 5, (1, 4))
    mask = torch.tensor([[0, 1, 1, 1]])
    expected = sum(-_log_softmax(logits[0, t].tolist())[int(ids[0, t + 1])] for t in (1, 2)) / 2
    assert causal_ce(_poison(logits, mask), ids, mask).item() == pytest.approx(expected, rel=1e-5)


def test_causal_ce_single_token_sequences_give_zero_with_graph():
    logits = torch.randn(2, 1, 5, requires_grad=True)
    loss = causal_ce(logits, torch.zeros(2, 1), torch.ones(2, 1))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logits.grad == 0)


def test_token_ce_is_unshifted_and_skips_ignored_labels():
    torch.manual_seed(2)
    logits, labels = torch.randn(2, 4, 6), torch.randint(0, 6, (2, 4))
    labels[0, 1] = -100
    keep = [(b, t) for b, t in _valid(MASK) if labels[b, t] != -100]
    expected = sum(-_log_softmax(logits[b, t].tolist())[int(labels[b, t])] for b, t in keep) / len(keep)
    assert token_ce(_poison(logits, MASK), labels, MASK).item() == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- KD KL


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_kl_matches_loop(temperature):
    torch.manual_seed(3)
    z_s, z_t = torch.randn(2, 4, 6) * 3, torch.randn(2, 4, 6) * 3
    per_token = [
        _kl(
            [math.exp(x) for x in _log_softmax((z_t[b, t] / temperature).tolist())],
            [math.exp(x) for x in _log_softmax((z_s[b, t] / temperature).tolist())],
        )
        for b, t in _valid(MASK)
    ]
    expected = temperature**2 * sum(per_token) / len(per_token)  # batchmean over N_v = 5 rows, not B = 2
    assert kd_kl(z_s, z_t, MASK, temperature).item() == pytest.approx(expected, rel=1e-5)


def test_kd_kl_zero_for_equal_inputs_and_blind_to_padding():
    torch.manual_seed(4)
    z = torch.randn(2, 4, 6)
    assert kd_kl(z, z.clone(), MASK, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    assert_blind_to_padding(kd_kl, torch.randn(2, 4, 6), z, rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_kl_gradient_matches_float64_autograd(temperature):
    """The written-out gradient (``SoftmaxKl``: (q - p) / T) against autograd through a float64 KL, with teacher
    entries of no mass (-inf) and a student of -inf where the teacher has none."""
    torch.manual_seed(5)
    z_s, z_t = torch.randn(2, 4, 7) * 3, torch.randn(2, 4, 7) * 3
    z_t[0, 1, :3] = float("-inf")
    z_s[0, 1, 0] = float("-inf")
    student = z_s.clone().requires_grad_(True)
    kd_kl(student, z_t, MASK, temperature).backward()
    ref = z_s.double().requires_grad_(True)
    rows = MASK.bool()
    log_p = torch.log_softmax(z_t.double()[rows] / temperature, -1)
    log_q = torch.log_softmax(ref[rows] / temperature, -1)
    terms = torch.where(log_p > float("-inf"), log_p.exp() * (log_p - log_q), torch.zeros_like(log_p))
    (temperature**2 * terms.sum() / rows.sum()).backward()
    assert torch.isfinite(student.grad).all()
    torch.testing.assert_close(student.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)


def test_kd_kl_gives_rows_it_drops_a_zero_gradient_even_with_a_nan_teacher():
    """A row outside the mask is evaluated by the shared pass (CE may count it) and dropped; a teacher row there
    that is not finite must not put NaN into the student's gradient."""
    from kdcache.stages.targets.logits.vocab.loss_rows import SoftmaxKl

    torch.manual_seed(7)
    z_s, z_t = torch.randn(3, 6).requires_grad_(True), torch.randn(3, 6)
    z_t[1] = float("-inf")  # every entry: p is NaN on that row
    values = SoftmaxKl.apply(z_s, z_t, 2.0)
    torch.where(torch.tensor([True, False, True]), values, torch.zeros_like(values)).sum().backward()
    assert torch.isfinite(z_s.grad).all() and torch.all(z_s.grad[1] == 0) and z_s.grad[0].abs().sum() > 0


def test_kd_kl_with_a_teacher_that_takes_a_gradient():
    """Online KD's teacher logits with a gradient take autograd's road: both sides get theirs."""
    torch.manual_seed(6)
    z_s, z_t = torch.randn(2, 4, 6).requires_grad_(True), torch.randn(2, 4, 6).requires_grad_(True)
    kd_kl(z_s, z_t, MASK).backward()
    assert z_t.grad is not None and z_t.grad[MASK.bool()].abs().sum() > 0
    assert torch.all(z_t.grad[~MASK.bool()] == 0) and torch.all(z_s.grad[~MASK.bool()] == 0)


def test_kd_kl_refuses_vocab_mismatch():
    with pytest.raises(LossError, match="vocabulary"):
        kd_kl(torch.randn(1, 2, 5), torch.randn(1, 2, 6), torch.ones(1, 2))


# ---------------------------------------------------------------- top-k KL


def _teacher_topk(z_t: torch.Tensor, k: int):
    values, ids = z_t.topk(k, dim=-1)
    return values, ids.to(torch.int32), torch.logsumexp(z_t, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_topk_renorm_matches_loop(temperature):
    torch.manual_seed(5)
    z_s, z_t = torch.randn(2, 4, 9) * 2, torch.randn(2, 4, 9) * 2
    values, ids, _ = _teacher_topk(z_t, 3)
    per_token = []
    for b, t in _valid(MASK):
        p = [math.exp(x) for x in _log_softmax([v / temperature for v in values[b, t].tolist()])]
        q = [math.exp(x) for x in _log_softmax([z_s[b, t, int(i)].item() / temperature for i in ids[b, t]])]
        per_token.append(_kl(p, q))
    expected = temperature**2 * sum(per_token) / len(per_token)
    got = topk_kl_renorm(z_s, values, ids, MASK, temperature=temperature)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    assert topk_kl(z_s, values, ids.float(), MASK, variant="renorm", temperature=temperature).item() == pytest.approx(
        got.item()
    )


def test_topk_other_matches_full_vocab_buckets():
    torch.manual_seed(6)
    z_s, z_t = torch.randn(2, 4, 9) * 2, torch.randn(2, 4, 9) * 2
    values, ids, lse = _teacher_topk(z_t, 3)
    per_token = []
    for b, t in _valid(MASK):
        p_full = [math.exp(x) for x in _log_softmax(z_t[b, t].tolist())]
        q_full = [math.exp(x) for x in _log_softmax(z_s[b, t].tolist())]
        top = [int(i) for i in ids[b, t]]
        p = [p_full[i] for i in top] + [sum(p_full[i] for i in range(9) if i not in top)]
        q = [q_full[i] for i in top] + [sum(q_full[i] for i in range(9) if i not in top)]
        per_token.append(_kl(p, q))
    got = topk_kl_other(z_s, values, ids.to(torch.uint8), lse, MASK)
    assert got.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-5)


def test_topk_other_zero_when_student_equals_teacher_and_k_equals_vocab():
    torch.manual_seed(7)
    z = torch.randn(2, 4, 6)
    for k in (2, 6):
        values, ids, lse = _teacher_topk(z, k)
        assert topk_kl_other(z.clone(), values, ids, lse, MASK).item() == pytest.approx(0.0, abs=1e-6)
    z_s = torch.randn(2, 4, 6, requires_grad=True)
    values, ids, lse = _teacher_topk(z, 6)
    topk_kl_other(z_s, values, ids, lse, MASK).backward()
    assert torch.isfinite(z_s.grad).all()


def test_topk_other_refuses_temperature_other_than_one():
    z = torch.randn(1, 2, 6)
    values, ids, lse = _teacher_topk(z, 2)
    with pytest.raises(LossError, match="temperature 1"):
        topk_kl(z, values, ids, torch.ones(1, 2), lse, variant="other", temperature=2.0)
    with pytest.raises(LossError, match="logsumexp"):
        topk_kl(z, values, ids, torch.ones(1, 2), None, variant="other")
    with pytest.raises(LossError, match="renorm, other"):
        topk_kl(z, values, ids, torch.ones(1, 2), lse, variant="bucket")


@pytest.mark.parametrize("variant", ["renorm", "other"])
def test_topk_blind_to_padding_garbage(variant):
    torch.manual_seed(8)
    z_s, z_t = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    values, ids, lse = _teacher_topk(z_t, 3)
    clean = topk_kl(z_s, values, ids, MASK, lse, variant=variant)
    bad_ids = ids.float()
    bad_ids[~MASK.bool()] = float("nan")  # would be an out-of-range index if it were ever cast and read
    z_dirty = _poison(z_s, MASK).requires_grad_(True)
    dirty = topk_kl(z_dirty, _poison(values, MASK, 1e30), bad_ids, MASK, _poison(lse, MASK), variant=variant)
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item(), rel=1e-6)
    assert torch.isfinite(z_dirty.grad).all()


# ---------------------------------------------------------------- hidden


def test_mse_and_cosine_match_loops():
    torch.manual_seed(9)
    h_s, h_t = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    rows = _valid(MASK)
    sq = sum(((h_s[b, t] - h_t[b, t]) ** 2).sum().item() for b, t in rows)
    assert masked_mse(h_s, h_t, MASK).item() == pytest.approx(sq / (len(rows) * 5), rel=1e-5)
    cos = [
        (h_s[b, t] @ h_t[b, t]).item() / (h_s[b, t].norm().item() * h_t[b, t].norm().item()) for b, t in rows
    ]
    assert cosine_loss(h_s, h_t, MASK).item() == pytest.approx(sum(1 - c for c in cos) / len(rows), rel=1e-5)


def test_mse_gradient_is_the_analytic_one_on_valid_rows():
    """The MSE masks rather than selects (no host sync); its gradient is 2 (h_s - h_t) / (N_v d) on valid rows
    (padding poisoned on either side is ``test_hidden_losses_blind_to_padding_garbage``'s)."""
    torch.manual_seed(10)
    h_s, h_t = torch.randn(2, 4, 5).requires_grad_(True), torch.randn(2, 4, 5)
    masked_mse(h_s, h_t, MASK).backward()
    expected = 2 * (h_s - h_t).detach()[MASK.bool()] / (MASK.sum() * 5)
    torch.testing.assert_close(h_s.grad[MASK.bool()], expected)
    assert torch.all(h_s.grad[~MASK.bool()] == 0)


def test_mse_refuses_unprojected_student():
    with pytest.raises(LossError, match="project"):
        masked_mse(torch.randn(1, 2, 3), torch.randn(1, 2, 4), torch.ones(1, 2))


def _cka_by_gram(x: torch.Tensor, y: torch.Tensor) -> float:
    """Kornblith's linear CKA via HSIC on N x N Gram matrices (independent of the d x d form under test)."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    kx, ky = h @ x @ x.T @ h, h @ y @ y.T @ h
    return ((kx * ky).sum() / torch.sqrt((kx * kx).sum() * (ky * ky).sum())).item()


def _valid_stack(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.stack([h[b, t] for b, t in _valid(mask)])


def test_cka_and_cka_sqrt_match_gram_form_with_different_widths():
    torch.manual_seed(10)
    h_s, h_t = torch.randn(2, 4, 3), torch.randn(2, 4, 6)
    h_s[..., 0] += h_t[..., 0]  # some shared signal, so CKA is well inside (0, 1)
    cka = _cka_by_gram(_valid_stack(h_t, MASK), _valid_stack(h_s, MASK))
    assert 0.05 < cka < 0.95
    assert cka_loss(h_s, h_t, MASK).item() == pytest.approx(1 - cka, rel=1e-4)
    assert cka_sqrt_loss(h_s, h_t, MASK).item() == pytest.approx(1 - math.sqrt(cka), rel=1e-4)


def test_cka_invariant_to_rotation_scaling_and_padding():
    torch.manual_seed(11)
    h_s, h_t = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    h_s = h_s + 0.5 * h_t
    base = cka_loss(h_s, h_t, MASK).item()
    rotation, _ = torch.linalg.qr(torch.randn(6, 6))
    assert cka_loss(7.5 * h_s @ rotation + 3.0, h_t, MASK).item() == pytest.approx(base, abs=1e-5)
    assert cka_loss(h_s, 0.01 * h_t @ rotation.T, MASK).item() == pytest.approx(base, abs=1e-5)
    assert cka_loss(_poison(h_s, MASK, 1e30), _poison(h_t, MASK), MASK).item() == pytest.approx(base, abs=1e-6)
    assert cka_loss(h_t, h_t @ rotation, MASK).item() == pytest.approx(0.0, abs=1e-5)


def test_cka_constant_input_gives_finite_gradient():
    h_s = torch.ones(2, 4, 3, requires_grad=True)
    for loss_fn in (cka_loss, cka_sqrt_loss):
        loss = loss_fn(h_s, torch.randn(2, 4, 5), MASK)
        loss.backward()
        assert loss.item() == pytest.approx(1.0) and torch.isfinite(h_s.grad).all()


@pytest.mark.parametrize("name", ["mse", "cosine", "cka", "cka_sqrt"])
def test_hidden_losses_blind_to_padding_garbage(name):
    torch.manual_seed(12)
    assert_blind_to_padding(get_loss(name), torch.randn(2, 4, 5), torch.randn(2, 4, 5), rel=1e-5)


# ---------------------------------------------------------------- attention


def _softmax_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention-like maps: softmax over valid keys, exactly 0 on padded keys."""
    keys = mask.bool()[:, None, None, :]
    return torch.softmax(x.masked_fill(~keys, float("-inf")), dim=-1)


def _attention_reference(a_s: torch.Tensor, a_t: torch.Tensor, mask: torch.Tensor) -> float:
    h_s, group = a_s.shape[1], a_t.shape[1] // a_s.shape[1]
    total, n = 0.0, 0
    for b in range(mask.shape[0]):
        keys = [k for k in range(mask.shape[1]) if mask[b, k]]
        for q in keys:
            n += 1
            for h in range(h_s):
                teacher = [sum(a_t[b, h * group + g, q, k].item() for g in range(group)) / group for k in keys]
                student = [a_s[b, h, q, k].item() for k in keys]
                total += _kl([p / sum(teacher) for p in teacher], [p / sum(student) for p in student])
    return total / (n * h_s)


def test_attention_kl_matches_loop_with_head_groups():
    torch.manual_seed(13)
    a_s = _softmax_rows(torch.randn(2, 2, 4, 4), MASK)
    a_t = _softmax_rows(torch.randn(2, 6, 4, 4), MASK)
    got = attention_kl(a_s, a_t, MASK).item()
    assert got == pytest.approx(_attention_reference(a_s, a_t, MASK), rel=1e-5)


def test_head_groups_are_contiguous_means():
    a_t = torch.arange(6.0).reshape(1, 6, 1, 1).expand(1, 6, 2, 2)
    grouped = group_teacher_heads(a_t, 2)
    assert grouped[0, :, 0, 0].tolist() == [1.0, 4.0]  # mean(0, 1, 2), mean(3, 4, 5)
    assert group_teacher_heads(a_t, 6) is a_t


def test_attention_kl_refuses_uneven_head_counts():
    a_s, a_t = torch.rand(1, 4, 3, 3), torch.rand(1, 6, 3, 3)
    with pytest.raises(LossError) as info:
        attention_kl(a_s, a_t, torch.ones(1, 3))
    assert "6 teacher heads" in str(info.value) and "4 student heads" in str(info.value)


def test_attention_kl_zero_for_equal_maps_and_causal_teacher_has_no_nan():
    torch.manual_seed(14)
    causal = torch.tril(torch.ones(4, 4)).bool()
    scores = torch.randn(2, 3, 4, 4).masked_fill(~causal, float("-inf"))
    a = _softmax_rows(scores, MASK)  # exact zeros above the diagonal and on padded keys
    assert attention_kl(a, a.clone(), MASK).item() == pytest.approx(0.0, abs=1e-7)
    a_s = _softmax_rows(torch.randn(2, 3, 4, 4), MASK).requires_grad_(True)
    loss = attention_kl(a_s, a, MASK)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a_s.grad).all()
    assert loss.item() == pytest.approx(_attention_reference(a_s.detach(), a, MASK), rel=1e-5)


def test_attention_kl_blind_to_padding_garbage():
    torch.manual_seed(15)
    a_s = _softmax_rows(torch.randn(2, 2, 4, 4), MASK)
    a_t = _softmax_rows(torch.randn(2, 4, 4, 4), MASK)
    clean = attention_kl(a_s, a_t, MASK).item()
    pad = ~MASK.bool()
    dirty_s, dirty_t = a_s.clone(), a_t.clone()
    for x in (dirty_s, dirty_t):
        x.permute(0, 2, 1, 3)[pad] = float("nan")  # padded query rows
        x.permute(0, 3, 1, 2)[pad] = float("inf")  # padded key columns
    dirty_s.requires_grad_(True)
    loss = attention_kl(dirty_s, dirty_t, MASK)
    loss.backward()
    assert loss.item() == pytest.approx(clean, rel=1e-6)
    assert torch.isfinite(dirty_s.grad).all()
