"""The Wasserstein critic (seed 003, DESIGN.md): gradient penalty, critic loss, its trainer, the student loss."""

from __future__ import annotations

import pytest
import torch

from kdcache.stages.targets.hidden.wgan import Critic, CriticTrainer, critic_loss, gradient_penalty, wgan_student_loss
from tests.stages.train.losses._loss_support import MASK, _poison, _valid


class _HalfSquaredNorm(torch.nn.Module):
    """c(x) = ½‖x‖², so ∇c(x) = x: the penalty's value tells where the gradient was taken."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x.pow(2).sum(-1)


def test_gradient_penalty_is_taken_at_the_interpolates():
    torch.manual_seed(16)
    real, fake, eps = torch.randn(5, 3), torch.randn(5, 3), torch.rand(5)
    expected = sum(
        ((eps[i] * real[i] + (1 - eps[i]) * fake[i]).norm().item() - 1) ** 2 for i in range(5)
    ) / 5
    assert gradient_penalty(_HalfSquaredNorm(), real, fake, eps).item() == pytest.approx(expected, rel=1e-5)


def test_critic_loss_matches_definition_and_ignores_padding():
    torch.manual_seed(17)
    h_s, h_t = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    rows = _valid(MASK)
    torch.manual_seed(99)
    eps = torch.rand(len(rows))  # the draw critic_loss makes after the same seeding
    c = _HalfSquaredNorm()
    w = sum(c(h_t[r]).item() for r in rows) / len(rows) - sum(c(h_s[r]).item() for r in rows) / len(rows)
    gp = sum(((eps[i] * h_t[r] + (1 - eps[i]) * h_s[r]).norm().item() - 1) ** 2 for i, r in enumerate(rows))
    expected = -w + 10.0 * gp / len(rows)
    torch.manual_seed(99)
    assert critic_loss(c, h_s, h_t, MASK, gp_weight=10.0).item() == pytest.approx(expected, rel=1e-5)
    torch.manual_seed(99)
    dirty = critic_loss(c, _poison(h_s, MASK), _poison(h_t, MASK, 1e30), MASK, gp_weight=10.0)
    assert dirty.item() == pytest.approx(expected, rel=1e-5)


def test_critic_loss_decreases_on_separable_data():
    torch.manual_seed(18)
    h_t = torch.randn(4, 8, 6) + 2.0
    h_s = torch.randn(4, 8, 6) - 2.0
    mask = torch.ones(4, 8)
    trainer = CriticTrainer(["s1_t2"], 6, n_steps=1, lr=1e-3, hidden_dims=(16,))
    losses = [trainer.step("s1_t2", h_s, h_t, mask) for _ in range(40)]
    assert losses[-1] < losses[0] - 1.0
    # A trained critic scores the teacher above the student: W estimate > 0.
    with torch.no_grad():
        assert trainer["s1_t2"](h_t).mean() > trainer["s1_t2"](h_s).mean()


def test_critic_trainer_takes_n_steps_and_round_trips():
    trainer = CriticTrainer(["a", "b"], 4, n_steps=3, hidden_dims=(8,))
    trainer.step("a", torch.randn(1, 5, 4), torch.randn(1, 5, 4), torch.ones(1, 5))
    first = next(trainer["a"].parameters())
    assert int(trainer.optimizer.state[first]["step"]) == 3
    assert next(trainer["b"].parameters()) not in trainer.optimizer.state  # only the named critic moved
    clone = CriticTrainer(["a", "b"], 4, n_steps=3, hidden_dims=(8,), seed=1)
    clone.load_state_dict(trainer.state_dict())
    assert torch.equal(next(clone["a"].parameters()), first)


def test_wgan_student_loss_reaches_the_student_only():
    torch.manual_seed(19)
    critic = Critic(3, hidden_dims=(8,))
    h_s = torch.randn(2, 4, 3)
    expected = -sum(critic(h_s[r]).item() for r in _valid(MASK)) / 5
    dirty = _poison(h_s, MASK).requires_grad_(True)
    loss = wgan_student_loss(critic, dirty, MASK)
    loss.backward()
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(dirty.grad).all() and dirty.grad[MASK.bool()].abs().sum() > 0
    assert all(p.grad is None and p.requires_grad for p in critic.parameters())
