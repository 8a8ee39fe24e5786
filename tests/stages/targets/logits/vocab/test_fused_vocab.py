"""The vocabulary losses from the student's last hidden state and LM head (``HeadLogits``, never ``[B, L, V]``)
against references written here on full logits, and against today's path on materialised logits: value and
gradient, with padding, a loss mask and packed rows, over several chunks (tolerances: docs/losses.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.targets.logits.head_torch import head_kl
from kdcache.stages.targets.logits.sampled_torch import sampled_kl
from kdcache.stages.targets.logits.topk_torch import topk_kl
from kdcache.stages.targets.logits.vocab import head_logits, loss_rows
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.losses.logits import causal_ce, token_ce

B, L, D, V, K, N_DRAWS = 2, 7, 6, 23, 5, 4
RTOL, ATOL = 1e-5, 1e-6  # float32; see docs/losses.md


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 rows (and 2 for gathers), so every loss crosses chunk boundaries."""
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 3)
    monkeypatch.setattr(head_logits, "IDS_CHUNK", 2)


def _setup(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 0]])  # row 0: two packed documents
    loss_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    return {"hidden": torch.randn(B, L, D, generator=g), "weight": torch.randn(V, D, generator=g),
            "bias": torch.randn(V, generator=g), "ids": torch.randint(0, V, (B, L), generator=g),
            "mask": mask, "position_ids": position_ids, "loss_mask": loss_mask,
            "teacher": torch.randn(B, L, V, generator=g) * 2}


def _grads(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
           s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The loss and its gradients w.r.t. the hidden state, the head's weight and bias."""
    h, w, b = (s[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    value = fn(h, w, b)
    value.backward()
    return (value.detach(), h.grad, w.grad, b.grad)


def _same(fn_fused: Callable, fn_reference: Callable, s: dict[str, torch.Tensor]) -> None:
    for got, want in zip(_grads(fn_fused, s), _grads(fn_reference, s)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _three_ways(loss: Callable[[object], torch.Tensor], reference: Callable[[torch.Tensor], torch.Tensor],
                s: dict[str, torch.Tensor]) -> None:
    """``loss(HeadLogits)`` equals ``reference(full logits)`` and today's ``loss(materialised logits)``."""
    fused = lambda h, w, b: loss(HeadLogits(h, w, b))  # noqa: E731
    _same(fused, lambda h, w, b: reference(F.linear(h, w, b)), s)
    _same(fused, lambda h, w, b: loss(F.linear(h, w, b)), s)


def _masks(s: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    return token_masks(s["mask"], s["loss_mask"], s["position_ids"], causal=True)


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return (log_p.exp() * (log_p - log_q)).sum()


def test_causal_ce_packed_rows_with_a_loss_mask() -> None:
    s = _setup()
    m = _masks(s)

    def reference(z: torch.Tensor) -> torch.Tensor:
        terms = [-F.log_softmax(z[b, t], -1)[s["ids"][b, t + 1]] for b in range(B) for t in range(L - 1)
                 if m.pairs[b, t]]
        return torch.stack(terms).mean()
    _three_ways(lambda z: causal_ce(z, s["ids"], s["mask"], pairs=m.pairs), reference, s)


def test_token_ce_ignores_minus_100() -> None:
    s = _setup(1)
    labels = s["ids"].clone()
    labels[0, 2] = -100

    def reference(z: torch.Tensor) -> torch.Tensor:
        keep = s["mask"].bool() & (labels != -100)
        return F.cross_entropy(z[keep], labels[keep], reduction="mean")
    _three_ways(lambda z: token_ce(z, labels, s["mask"]), reference, s)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_kl(temperature: float) -> None:
    s = _setup(2)
    m = _masks(s)

    def reference(z: torch.Tensor) -> torch.Tensor:
        sel = m.predicts
        log_t = F.log_softmax(s["teacher"][sel] / temperature, -1)
        return _kl_rows(log_t, F.log_softmax(z[sel] / temperature, -1)) / sel.sum() * temperature**2
    _three_ways(lambda z: kd_kl(z, s["teacher"], m.predicts, temperature), reference, s)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_head_kl(temperature: float) -> None:
    s = _setup(3)
    m = _masks(s)
    g = torch.Generator().manual_seed(9)
    hidden_t, w_t = torch.randn(B, L, 5, generator=g), torch.randn(V, 5, generator=g)

    def reference(z: torch.Tensor) -> torch.Tensor:
        sel = m.predicts
        log_t = F.log_softmax(hidden_t[sel] @ w_t.T / temperature, -1)
        return _kl_rows(log_t, F.log_softmax(z[sel] / temperature, -1)) / sel.sum() * temperature**2
    _three_ways(lambda z: head_kl(z, hidden_t, lambda x: x @ w_t.T, m.predicts, temperature), reference, s)


def _topk(s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, ids = s["teacher"].topk(K, dim=-1)
    return values, ids.to(torch.int32), torch.logsumexp(s["teacher"], -1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_renorm(temperature: float) -> None:
    s = _setup(4)
    m = _masks(s)
    values, ids, lse = _topk(s)

    def reference(z: torch.Tensor) -> torch.Tensor:
        sel = m.predicts
        log_t = F.log_softmax(values[sel] / temperature, -1)
        log_s = F.log_softmax(z[sel].gather(1, ids[sel].long()) / temperature, -1)
        return _kl_rows(log_t, log_s) / sel.sum() * temperature**2
    _three_ways(lambda z: topk_kl(z, values, ids, m.predicts, lse, variant="renorm", temperature=temperature),
                reference, s)


def test_topk_other() -> None:
    s = _setup(5)
    m = _masks(s)
    values, ids, lse = _topk(s)

    def reference(z: torch.Tensor) -> torch.Tensor:
        sel = m.predicts
        p_t = (values[sel] - lse[sel][:, None]).exp()
        p_t = torch.cat([p_t, 1 - p_t.sum(-1, keepdim=True)], -1)
        p_s_all = F.softmax(z[sel], -1)
        p_s = p_s_all.gather(1, ids[sel].long())
        p_s = torch.cat([p_s, 1 - p_s.sum(-1, keepdim=True)], -1)
        return (p_t * (p_t.log() - p_s.log())).sum() / sel.sum()
    _three_ways(lambda z: topk_kl(z, values, ids, m.predicts, lse, variant="other"), reference, s)


def test_sampled() -> None:
    s = _setup(6)
    m = _masks(s)
    g = torch.Generator().manual_seed(3)
    draw_ids = torch.randint(0, V, (B, L, N_DRAWS), generator=g)
    counts = torch.randint(0, 3, (B, L, N_DRAWS), generator=g)
    counts[..., 0] = 1
    logp = -torch.rand(B, L, N_DRAWS, generator=g) * 3

    def reference(z: torch.Tensor) -> torch.Tensor:
        sel = m.predicts
        log_s = F.log_softmax(z[sel] / 2.0, -1).gather(1, draw_ids[sel])
        c = counts[sel].float()
        return ((c / c.sum(-1, keepdim=True)) * (logp[sel] - log_s)).sum() / sel.sum() * 4.0
    _three_ways(lambda z: sampled_kl(z, draw_ids, counts, logp, m.predicts, 2.0), reference, s)


def test_nothing_to_count_is_a_zero_tied_to_the_graph() -> None:
    s = _setup(7)
    h = s["hidden"].clone().requires_grad_(True)
    none = torch.zeros(B, L, dtype=torch.long)
    value = causal_ce(HeadLogits(h, s["weight"]), s["ids"], s["mask"], pairs=none[:, :-1].bool())
    value.backward()
    assert value.item() == 0.0 and h.grad is not None and not h.grad.any()


def test_bfloat16_head_matches_materialised_bfloat16_logits() -> None:
    """A bf16 student (DeepSpeed's bf16): the chunks build bf16 logits as the model's head does, then fp32."""
    s = _setup(8)
    m = _masks(s)
    h, w = s["hidden"].bfloat16(), s["weight"].bfloat16()
    values, ids, lse = _topk(s)
    for loss in (lambda z: causal_ce(z, s["ids"], s["mask"], pairs=m.pairs),
                 lambda z: topk_kl(z, values, ids, m.predicts, lse, variant="other")):
        torch.testing.assert_close(loss(HeadLogits(h, w)), loss(F.linear(h, w)), rtol=2e-3, atol=1e-4)


def test_head_rows_peak_memory_is_one_chunk() -> None:
    """Each chunk's logits are dropped once summed: autograd keeps nothing of size [N, V] for the head path."""
    s = _setup(9)
    h, w = s["hidden"].clone().requires_grad_(True), s["weight"].clone().requires_grad_(True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kd_kl(HeadLogits(h, w), s["teacher"], s["mask"])
    assert max(saved) < s["mask"].sum() * V  # the materialised path keeps the [N_v, V] logits


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
                                      eos_token_id=0)).eval()  # eval: no dropout, so the two forwards agree


def test_the_student_runs_its_base_model_and_the_loss_is_today_s() -> None:
    """CE + top-k KL + hidden MSE of a real HF student: base model + ``HeadLogits`` equals its own forward."""
    from kdcache.stages.common.option_groups import assemble
    from kdcache.stages.train.core.options import LossOptions
    from kdcache.stages.train.core.student_head import base_forward, choose_head
    from kdcache.stages.train.objective.compound import CompoundLoss

    s = _setup(10)
    model = _gpt2()
    values, ids, lse = _topk(s)
    targets = {"input_ids": s["ids"].float(), "logits/topk_values": values, "logits/topk_ids": ids.float(),
               "logits/lse": lse, "hidden/1": torch.randn(B, L, 16), "loss_mask": s["loss_mask"]}
    options = assemble(LossOptions, {"gamma": 1.0, "topk_kl": "other", "temperature": 1.0})
    loss = CompoundLoss(options, layer_map=[(1, 1)], student_dim=16, teacher_dim=16)
    inputs = {"input_ids": s["ids"], "attention_mask": s["mask"]}
    head = choose_head(model, inputs, one_stream=True)
    assert head is model.lm_head
    results = []
    for out in (base_forward(model, head, inputs, hidden=True, attentions=False),
                model(**inputs, output_hidden_states=True)):
        model.zero_grad()
        terms = loss(out, targets, s["mask"])
        terms["loss"].backward()
        results.append((terms, model.lm_head.weight.grad.clone(), model.transformer.wte.weight.grad.clone()))
    (fused, head_grad, embed_grad), (today, head_grad_today, embed_grad_today) = results
    assert isinstance(base_forward(model, head, inputs, hidden=False, attentions=False).logits, HeadLogits)
    for name in ("loss", "ce", "topk_kl", "hidden"):
        torch.testing.assert_close(fused[name], today[name], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(head_grad, head_grad_today, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(embed_grad, embed_grad_today, rtol=1e-4, atol=1e-6)


def test_a_student_whose_logits_are_not_its_head_keeps_its_own_forward(capsys: pytest.CaptureFixture[str]) -> None:
    """Soft-capped logits (Gemma 2) are not the head on the last hidden state: the materialised path, said so."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from kdcache.stages.train.core.student_head import choose_head

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=0.5))
    s = _setup(11)
    assert choose_head(model, {"input_ids": s["ids"], "attention_mask": s["mask"]}, one_stream=True) is None
    assert "materialised logits from Gemma2ForCausalLM" in capsys.readouterr().err


def test_logits_at_ids_match_a_gather_of_full_logits_in_value_and_gradient() -> None:
    """``HeadRows.on_ids`` (one float32 accumulator for the head's gradient) against a gather from full logits,
    with ids repeated across rows and within a row (unused top-k slots repeat the last id), over several chunks."""
    from kdcache.stages.targets.logits.vocab.head_logits import IDS_CHUNK, HeadRows

    torch.manual_seed(0)
    n, d, v, k = 2 * IDS_CHUNK + 5, 16, 50, 6
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, v, (n, k))
    ids[:, -2:] = ids[:, -3:-2]  # repeats within a row
    upstream = torch.randn(n, k, dtype=torch.float64)
    got = HeadRows(hidden, weight, bias).on_ids(ids)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
    want = (hidden @ weight.T + bias).gather(1, ids)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)  # float32 out
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
