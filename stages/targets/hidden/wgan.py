"""Wasserstein critic with gradient penalty as a hidden-state loss (seed 003, WGAN-GP).

The critic c: R^{d_t} -> R scores single token states. Over the valid tokens of a batch:

* critic loss  = −(E c(h_t) − E c(h_s)) + λ · E (‖∇c(x̂)‖₂ − 1)², x̂ = ε·h_t + (1−ε)·h_s, ε ~ U(0, 1) per token;
* student loss = −E c(h_s).

The critic has its own optimizer and takes n steps per student step on detached inputs (``CriticTrainer``).
It is deliberately *not* a submodule of the DeepSpeed-wrapped model: the student's optimizer must not touch it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, count_valid, valid_rows

# Keeps the gradient-norm's own gradient finite where ∇c(x̂) is exactly 0.
GRAD_NORM_EPS = 1e-12


class Critic(nn.Module):
    """A small MLP over one token state: ``[..., d_t] -> [...]``.

    Args:
        dim: d_t, the teacher's hidden size (the student is projected to it first).
        hidden_dims: widths of the hidden layers (seed 003 uses 512, 256, 128 for d = 768).
    """

    def __init__(self, dim: int, hidden_dims: Sequence[int] = (256, 128)):
        super().__init__()
        layers: list[nn.Module] = []
        width = dim
        for h in hidden_dims:
            # LeakyReLU rather than ReLU: the gradient penalty needs ∇c to be non-zero almost everywhere.
            layers += [nn.Linear(width, h), nn.LeakyReLU(0.2)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Score ``[..., d_t]`` states; returns ``[...]`` in the critic's dtype (inputs are cast to it)."""
        dtype = next(self.net.parameters()).dtype
        return self.net(x.to(dtype)).squeeze(-1)


def gradient_penalty(
    critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor | None = None
) -> torch.Tensor:
    """E (‖∇c(x̂)‖₂ − 1)² at x̂ = ε·real + (1−ε)·fake, one ε per row.

    Args:
        critic: maps ``[N, d]`` to ``[N]``.
        real: ``[N, d]`` teacher rows; fake: ``[N, d]`` student rows.
        eps: ``[N]`` interpolation weights in [0, 1]; drawn uniformly when None (tests pass their own).

    Returns:
        Scalar, differentiable with respect to the critic's parameters (create_graph=True).
    """
    if eps is None:
        eps = torch.rand(real.shape[0], device=real.device, dtype=real.dtype)
    x_hat = (eps[:, None] * real + (1.0 - eps[:, None]) * fake).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    norm = (grad.pow(2).sum(dim=-1) + GRAD_NORM_EPS).sqrt()
    return (norm - 1.0).pow(2).mean()


def critic_loss(
    critic: nn.Module, h_s_proj: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor, gp_weight: float = 10.0
) -> torch.Tensor:
    """−(E c(h_t) − E c(h_s)) + λ·GP over the valid tokens.

    Args:
        critic: a ``Critic``.
        h_s_proj: ``[B, L, d_t]`` projected student states (detach them when training the critic).
        h_t: ``[B, L, d_t]`` teacher states.
        mask: ``[B, L]``.
        gp_weight: λ.

    Returns:
        Scalar.
    """
    count_valid(bool_mask(mask, h_t))
    real = valid_rows(h_t, mask).float()
    fake = valid_rows(h_s_proj, mask).float()
    wasserstein = critic(real).mean() - critic(fake).mean()
    return -wasserstein + gp_weight * gradient_penalty(critic, real, fake)


def wgan_student_loss(critic: nn.Module, h_s_proj: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """−E c(h_s) over the valid tokens; gradients reach the student only, never the critic's parameters.

    Args:
        critic: a ``Critic``.
        h_s_proj: ``[B, L, d_t]`` projected student states.
        mask: ``[B, L]``.

    Returns:
        Scalar.
    """
    count_valid(bool_mask(mask, h_s_proj))
    with _frozen(critic):
        return -critic(valid_rows(h_s_proj, mask)).float().mean()


class CriticTrainer:
    """Owns one critic per layer pair and their optimizer; does ``n_steps`` critic updates per student step.

    Not an ``nn.Module`` on purpose, so a ``CompoundLoss`` holding it does not hand the critics to the
    student's (DeepSpeed) optimizer. Save ``state_dict()`` beside the DeepSpeed checkpoint to resume.
    Under torch.distributed, critic gradients are averaged over ranks so every rank keeps the same critic.

    Args:
        keys: one name per layer pair (e.g. ``"s2_t4"``).
        dim: d_t.
        n_steps: critic updates per call to ``step`` (seed 003: 5).
        gp_weight: λ (seed 003: 10).
        lr: learning rate of the critic's Adam (betas (0.5, 0.9), the WGAN-GP setting).
        hidden_dims: the critic MLP's widths.
        seed: seeds the critics' initial weights, the same on every rank.
    """

    def __init__(
        self,
        keys: Iterable[str],
        dim: int,
        *,
        n_steps: int = 5,
        gp_weight: float = 10.0,
        lr: float = 1e-4,
        hidden_dims: Sequence[int] = (256, 128),
        seed: int = 0,
    ):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.critics = nn.ModuleDict({k: Critic(dim, hidden_dims) for k in keys})
        self.n_steps = n_steps
        self.gp_weight = gp_weight
        self.optimizer = torch.optim.Adam(self.critics.parameters(), lr=lr, betas=(0.5, 0.9))

    def __getitem__(self, key: str) -> Critic:
        return self.critics[key]  # type: ignore[return-value]

    def step(self, key: str, h_s_proj: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> float:
        """Run ``n_steps`` updates of critic ``key`` on detached inputs; returns the last critic loss.

        Args:
            key: which pair's critic.
            h_s_proj: ``[B, L, d_t]``; h_t: ``[B, L, d_t]``; mask: ``[B, L]``.
        """
        critic = self.critics[key]
        self.to(h_t.device)
        fake, real = h_s_proj.detach(), h_t.detach()
        loss = torch.zeros(())
        with torch.autocast(device_type=h_t.device.type, enabled=False), torch.enable_grad():
            for _ in range(self.n_steps):
                self.optimizer.zero_grad(set_to_none=True)
                loss = critic_loss(critic, fake, real, mask, self.gp_weight)
                loss.backward()
                _average_over_ranks(critic)
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free them; nothing else should read critic gradients
        return float(loss.detach())

    def state_dict(self) -> dict:
        """Critic weights and optimizer state, for checkpoints."""
        return {"critics": self.critics.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.critics.load_state_dict(state["critics"])
        self.optimizer.load_state_dict(state["optimizer"])

    def to(self, device: torch.device) -> CriticTrainer:
        """Move the critics (and any optimizer state) to ``device``; ``step`` does this by itself."""
        # The training loop moves the wrapped model, not this helper. Module.to() swaps parameter data in
        # place, so the optimizer's references (and any state it already has) stay valid.
        if next(self.critics.parameters()).device != device:
            self.critics.to(device)
            for state in self.optimizer.state.values():
                for name, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[name] = value.to(device)
        return self


def _average_over_ranks(module: nn.Module) -> None:
    """All-reduce (mean) the gradients of ``module`` when running under torch.distributed with > 1 rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= dist.get_world_size()


@contextlib.contextmanager
def _frozen(module: nn.Module) -> Iterator[None]:
    """Build the graph without the module's parameters, so a student backward leaves no critic gradients."""
    flags = [p.requires_grad for p in module.parameters()]
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(module.parameters(), flags):
            p.requires_grad_(flag)
