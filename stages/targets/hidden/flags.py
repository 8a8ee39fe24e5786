"""Stage two's hidden-state flags, declared in the family and held whole by stage two's options (``LossOptions``,
through ``option_group``: flags, YAML keys and ``RUN/options.json`` stay flat).

Two groups, because a group's flags are listed together and these are not: ``--hidden-loss`` heads the loss
options, and the wgan critic's two flags come after ``--topk-kl`` (``kdcache train --help`` and ``options.json``
keep their order).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdcache.stages.common.option_groups import option
from kdcache.stages.targets.hidden.hidden_losses import HiddenLoss, hidden_loss, hidden_loss_choices


@dataclass(frozen=True)
class HiddenLossFlags:
    """``--hidden-loss`` as the flag names it; its choices are the registry's live names."""

    hidden_loss: str = option("mse", "hidden-state loss", choices=hidden_loss_choices())

    def loss(self) -> HiddenLoss:
        """``--hidden-loss`` as its object, looked up here where the options are read (``LossError`` for a name no
        loss has, which the flag's choices report first)."""
        return hidden_loss(self.hidden_loss)


@dataclass(frozen=True)
class CriticFlags:
    """The wgan hidden loss's critic: its updates per student step and its learning rate."""

    critic_steps: int = option(1, "wgan: critic updates per student step")
    critic_lr: float = option(1e-4, "wgan: critic learning rate")

    def problems(self) -> list[str]:
        """Every problem of these flags."""
        return [f"critic_steps must be >= 1, got {self.critic_steps}"] if self.critic_steps < 1 else []
