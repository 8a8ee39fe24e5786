"""The hidden-state losses of stage two (``--hidden-loss``) as a family of objects: one ``HiddenLoss`` per loss, in
one registry, holding everything the rest of stage two asks of it.

A loss is registered once, here (or from a test, which deletes its entry again): its name is the flag's value, and
the flag's choices are the registry's live names (``hidden_loss_choices``). Past the edge where the options are read
(``HiddenLossFlags.loss()``) code holds the object and reads its attributes; it never compares the name.

Stage two's hidden flags are declared here too, held whole by its options (``LossOptions``, through
``option_group``: flags, YAML keys and ``RUN/options.json`` stay flat). Two groups, because a group's flags are
listed together and these are not: ``--hidden-loss`` (``HiddenLossFlags``) heads the loss options, and the wgan
critic's two flags (``CriticFlags``) come after ``--topk-kl`` (``kdcache train --help`` and ``options.json`` keep
their order).

This module imports no torch, so that the option classes and ``kdcache train --help`` list the losses without it.
A built-in loss therefore names its function the way an entry point does, ``"module:function"``, and the function
is imported the first time a loss is computed (the losses run on torch tensors, so torch is loaded by then).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.common.option_groups import option
from kdcache.storage import Registry

if TYPE_CHECKING:
    import torch

HIDDEN = "kdcache.stages.targets.hidden.loss_terms"  # the torch half of the built-in losses (but wgan's)


@dataclass(frozen=True)
class HiddenLoss:
    """One hidden-state loss.

    Args:
        name: the ``--hidden-loss`` value, the name in messages and in ``RUN/options.json``.
        function: ``(h_s [B, L, d], h_t [B, L, d_t], mask [B, L]) -> scalar``, or, for an adversarial loss, the
            student's side ``(critic, h_s [B, L, d_t], mask [B, L]) -> scalar``; a callable, or its
            ``"module:attribute"`` when the module imports torch.
        projector: the student's states are projected to the teacher's width first (``Projectors``); a loss that
            compares the two spaces without one (CKA) says False.
        empty_safe: the function itself gives 0 (tied to the graph) on a micro-batch with no trained token, with no
            host sync; the compound loss asks the others' counts first and adds that 0 for them.
        adversarial: the loss is a critic's (WGAN-GP): ``CompoundLoss`` trains one critic per layer pair
            (``CriticTrainer``) and ``function`` is the student's side against it.
    """

    name: str
    function: Callable[..., torch.Tensor] | str = field(repr=False, compare=False)
    projector: bool = True
    empty_safe: bool = False
    adversarial: bool = False

    def resolved(self) -> Callable[..., torch.Tensor]:
        """``function`` itself: imported from its module on the first call when it is named."""
        if isinstance(self.function, str):
            # Resolved once; the entry stays the same object (the registry's, and every holder's).
            object.__setattr__(self, "function", pkgutil.resolve_name(self.function))
        return cast("Callable[..., torch.Tensor]", self.function)


HIDDEN_LOSSES: Registry[HiddenLoss] = Registry("hidden loss", LossError)


def register_hidden_loss(loss: HiddenLoss) -> HiddenLoss:
    """Add ``loss`` under its name (a later entry of the same name replaces it); returns it."""
    return HIDDEN_LOSSES.add(loss.name, loss)


# The registered names as a live view: the flag's choices, which follow a loss registered later (a test's).
hidden_loss_choices = HIDDEN_LOSSES.keys


def unknown_hidden_loss(name: object) -> str:
    """The message for a hidden loss no entry has."""
    return f"unknown hidden loss {name!r}; choose one of {', '.join(HIDDEN_LOSSES)}"


def hidden_loss(name: object) -> HiddenLoss:
    """The loss registered as ``name``.

    Raises:
        LossError: ``unknown_hidden_loss(name)``, naming every registered loss.
    """
    if not isinstance(name, str) or name not in HIDDEN_LOSSES:
        raise LossError(unknown_hidden_loss(name))
    return HIDDEN_LOSSES[name]


# The built-in losses, in the order the flag lists them (docs/losses.md defines each).
register_hidden_loss(HiddenLoss("mse", f"{HIDDEN}:masked_mse", empty_safe=True))
register_hidden_loss(HiddenLoss("cosine", f"{HIDDEN}:cosine_loss", empty_safe=True))
register_hidden_loss(HiddenLoss("cka", f"{HIDDEN}:cka_loss", projector=False))
register_hidden_loss(HiddenLoss("cka_sqrt", f"{HIDDEN}:cka_sqrt_loss", projector=False))
register_hidden_loss(HiddenLoss("wgan", "kdcache.stages.targets.hidden.wgan:wgan_student_loss", adversarial=True))


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
