"""CompoundLoss: the weighted sum, skipped terms, projectors, the wgan critic, and a real tiny HF student."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.common.option_groups import assemble
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.hidden.loss_terms import cka_loss, masked_mse
from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.targets.logits.topk_torch import topk_kl_renorm
from kdcache.stages.train.core.layer_maps import LayerMap
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.losses.logits import causal_ce
from kdcache.stages.train.objective.compound import CompoundLoss

B, L, V, D_S, D_T, H_S, H_T = 2, 5, 11, 4, 6, 2, 4
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])


def _options(**flat: object) -> LossOptions:
    """The run's loss options by their flag names (``--topk-kl`` as ``topk_kl``)."""
    return assemble(LossOptions, flat)


def _student(layers: int = 2, logits: bool = True, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        logits=torch.randn(B, L, V, generator=g, requires_grad=True) if logits else None,
        hidden_states=tuple(torch.randn(B, L, D_S, generator=g, requires_grad=True) for _ in range(layers + 1)),
        attentions=tuple(torch.softmax(torch.randn(B, H_S, L, L, generator=g), -1) for _ in range(layers)),
    )


def _targets(teacher_layers: int = 4, seed: int = 1, topk: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, L, V, generator=g)
    out = {"input_ids": torch.randint(0, V, (B, L), generator=g).float()}
    for j in range(teacher_layers + 1):
        out[f"hidden/{j}"] = torch.randn(B, L, D_T, generator=g)
    for j in range(1, teacher_layers + 1):
        out[f"attention/{j}"] = torch.softmax(torch.randn(B, H_T, L, L, generator=g), -1)
    if topk:
        values, ids = full.topk(3, dim=-1)
        out.update({"logits/topk_values": values, "logits/topk_ids": ids.float(),
                    "logits/lse": torch.logsumexp(full, -1)})
    else:
        out["logits/full"] = full
    return out


def test_total_is_the_weighted_sum_of_logged_terms():
    layer_map = LayerMap.parse("uniform").build(2, 4)  # (1, 2), (2, 4)
    loss = CompoundLoss(_options(alpha=0.3, beta=0.5, gamma=0.7, delta=0.2, temperature=2.0), layer_map=layer_map,
                        student_dim=D_S, teacher_dim=D_T)
    out, tg = _student(), _targets()
    result = loss(out, tg, MASK)
    ce = causal_ce(out.logits, tg["input_ids"], MASK)
    kl = kd_kl(out.logits, tg["logits/full"], MASK, 2.0)
    hidden = [masked_mse(loss.projectors.project(p, out.hidden_states[p[0]]), tg[f"hidden/{p[1]}"], MASK)
              for p in layer_map]
    attention = [attention_kl(out.attentions[s - 1], tg[f"attention/{t}"], MASK) for s, t in layer_map]
    expected = 0.3 * ce + 0.5 * kl + 0.7 * sum(hidden) + 0.2 * sum(attention)
    assert result["loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert result["ce"].item() == pytest.approx(ce.item()) and result["kl"].item() == pytest.approx(kl.item())
    assert result["hidden/s2_t4"].item() == pytest.approx(hidden[1].item(), rel=1e-6)
    assert result["attention/s1_t2"].item() == pytest.approx(attention[0].item(), rel=1e-6)
    assert not result["hidden"].requires_grad and result["loss"].requires_grad
    result["loss"].backward()
    assert all(p.grad is not None for p in loss.projectors.parameters())


def test_zero_weights_skip_terms_and_their_inputs():
    loss = CompoundLoss(_options(alpha=0.0, beta=1.0, gamma=0.0, delta=0.0, temperature=1.0), layer_map=[(1, 2)])
    tg = {"logits/full": _targets()["logits/full"]}  # no input_ids, no hidden, no attention needed
    out = SimpleNamespace(logits=_student().logits, hidden_states=None, attentions=None)
    result = loss(out, tg, MASK)
    assert set(result) == {"loss", "kl"}
    assert len(list(loss.parameters())) == 0  # gamma 0: no projectors


def test_encoder_without_logits_skips_ce_and_refuses_kl():
    loss = CompoundLoss(_options(alpha=1.0, beta=0.0, gamma=1.0, hidden_loss="cka"), layer_map=[(1, 2)])
    out, tg = _student(logits=False), _targets()
    result = loss(out, tg, MASK)
    assert "ce" not in result
    assert result["loss"].item() == pytest.approx(cka_loss(out.hidden_states[1], tg["hidden/2"], MASK).item())
    assert len(list(loss.parameters())) == 0  # CKA needs no projector
    with pytest.raises(LossError, match="no loss term"):
        CompoundLoss(_options(alpha=1.0, beta=0.0))(out, tg, MASK)
    with pytest.raises(LossError, match="logits"):
        CompoundLoss(_options(alpha=0.0, beta=1.0))(out, tg, MASK)


def test_topk_targets_use_topk_kl():
    loss = CompoundLoss(_options(alpha=0.0, beta=1.0, temperature=2.0, topk_kl="renorm"))
    out, tg = _student(), _targets(topk=True)
    result = loss(out, tg, MASK)
    expected = topk_kl_renorm(out.logits, tg["logits/topk_values"], tg["logits/topk_ids"], MASK, temperature=2.0)
    assert "kl" not in result and result["topk_kl"].item() == pytest.approx(expected.item())
    other = CompoundLoss(_options(alpha=0.0, beta=1.0, topk_kl="other", temperature=1.0))(out, tg, MASK)
    assert torch.isfinite(other["topk_kl"])
    hot = CompoundLoss(_options(alpha=0.0, beta=1.0, topk_kl="other", temperature=2.0))
    with pytest.raises(LossError, match="temperature 1"):
        hot(out, tg, MASK)
    full = _targets()  # with full logits the top-k variant is unused, so T = 2 is fine
    assert torch.isfinite(hot(out, full, MASK)["kl"])


@pytest.mark.parametrize(
    "flags, kwargs, message",
    [
        ({"hidden_loss": "l1"}, {}, "unknown hidden loss"),
        ({"topk_kl": "bucket"}, {}, "unknown top-k variant"),
        ({"gamma": 1.0}, {"layer_map": [(1, 2)]}, "student_dim"),
    ],
)
def test_bad_configs_are_refused_up_front(flags, kwargs, message):
    with pytest.raises(LossError, match=message):
        CompoundLoss(_options(**flags), **kwargs)


def test_bad_weights_and_temperature_are_refused_where_the_options_enter():
    """A negative weight or temperature is the options' own problem (config and Python API), before any loss."""
    problems = _options(alpha=-1.0, temperature=0.0).validate()
    assert "alpha must be >= 0, got -1.0" in problems and "temperature must be > 0, got 0.0" in problems
    problems = _options(gamma=float("nan"), temperature=float("nan")).validate()  # NaN compares false: refused too
    assert "gamma must be >= 0, got nan" in problems and "temperature must be > 0, got nan" in problems


def test_missing_outputs_and_targets_are_named():
    loss = CompoundLoss(_options(alpha=0.0, beta=0.0, gamma=1.0), layer_map=[(1, 3)], student_dim=D_S, teacher_dim=D_T)
    tg = _targets(teacher_layers=2)
    with pytest.raises(LossError, match="'hidden/3'"):
        loss(_student(), tg, MASK)
    with pytest.raises(LossError, match="output_hidden_states=True"):
        loss(SimpleNamespace(hidden_states=None), tg, MASK)
    attention = CompoundLoss(_options(alpha=0.0, beta=0.0, gamma=0.0, delta=1.0), layer_map=[(1, 1)])
    with pytest.raises(LossError, match="output_attentions=True"):
        attention(SimpleNamespace(attentions=None), tg, MASK)


def test_projectors_follow_the_map_and_init():
    loss = CompoundLoss(_options(gamma=1.0), layer_map=[(0, 0), (1, 2), (2, 4)], student_dim=D_T, teacher_dim=D_T)
    assert sorted(loss.projectors.layers) == ["s0_t0", "s1_t2", "s2_t4"]
    assert torch.equal(loss.projectors.layers["s1_t2"].weight, torch.eye(D_T))
    assert torch.all(loss.projectors.layers["s1_t2"].bias == 0)
    names = {n for n, _ in loss.named_parameters()}
    assert "projectors.layers.s1_t2.weight" in names


def test_wgan_runs_critic_steps_in_training_only():
    loss = CompoundLoss(_options(alpha=0.0, beta=0.0, gamma=1.0, hidden_loss="wgan", critic_steps=2),
                        layer_map=[(1, 2)], student_dim=D_S, teacher_dim=D_T)
    assert loss.critics is not None
    assert not any("critic" in n for n, _ in loss.named_parameters())  # the student optimizer never sees them
    out, tg = _student(), _targets()
    result = loss.train()(out, tg, MASK)
    assert "critic/s1_t2" in result
    first = next(loss.critics["s1_t2"].parameters())
    assert int(loss.critics.optimizer.state[first]["step"]) == 2
    result["loss"].backward()
    assert out.hidden_states[1].grad is not None and first.grad is None
    with torch.no_grad():
        evaluated = loss.eval()(out, tg, MASK)
    assert "critic/s1_t2" not in evaluated and int(loss.critics.optimizer.state[first]["step"]) == 2


def test_real_tiny_gpt2_student_trains_against_compound():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=V, n_embd=8, n_layer=2, n_head=H_S, n_positions=16,
                        attn_implementation="eager")
    student = GPT2LMHeadModel(config)
    loss = CompoundLoss(_options(alpha=1.0, beta=1.0, gamma=1.0, delta=1.0, temperature=2.0),
                        layer_map=[(0, 0), *LayerMap.parse("uniform").build(2, 4)], student_dim=8, teacher_dim=D_T)
    tg = _targets()
    params = list(student.parameters()) + list(loss.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-2)
    history = []
    for _ in range(15):
        out = student(input_ids=tg["input_ids"].long(), attention_mask=MASK, output_hidden_states=True,
                      output_attentions=True)
        result = loss(out, tg, MASK)
        optimizer.zero_grad()
        result["loss"].backward()
        optimizer.step()
        history.append(result["loss"].item())
    assert all(torch.isfinite(torch.tensor(history)))
    assert history[-1] < history[0]
