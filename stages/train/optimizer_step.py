"""What ``kdcache train`` does around the loss, in one place: its optimizer, schedule, clipping and dropout seeds.

``build_engine`` hands DeepSpeed the optimizer and schedule made here, and ``TrainStep`` gives a loop of your own
the same step, so that the loop reproduces ``kdcache train``'s losses (README, "In a loop of your own"):

* AdamW over the student's and the loss's (projectors') trainable parameters, one group, torch's betas and eps,
  weight decay ``--weight-decay`` (0; torch's own default is 0.01);
* the learning rate warmed up linearly over ``--warmup-steps`` optimizer steps (0), then constant (``Trainer``
  decays it linearly by default);
* every gradient clipped together to a norm of 1.0, as DeepSpeed's ``gradient_clipping`` does;
* dropout seeded before each micro-batch from (``--seed``, micro-step, rank) (``api.seed_dropout``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kdcache.stages.train.api import seed_dropout

MAX_GRAD_NORM = 1.0  # kdcache train's DeepSpeed "gradient_clipping"


def train_optimizer(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """``kdcache train``'s AdamW (``--lr``, ``--weight-decay``) over ``params``."""
    return torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay)


def train_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """``kdcache train``'s schedule (``--warmup-steps``): the LR factor of optimizer step ``step`` rises linearly
    over ``warmup_steps`` steps, then stays 1."""
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class TrainStep:
    """``kdcache train``'s optimizer step for a loop of your own, one micro-batch per step (see the module docstring).

    ``TrainStep(student, loss)`` puts the student in training mode and seeds the first micro-batch's dropout;
    ``step(terms["loss"])`` runs backward, clips, steps the optimizer and the schedule, clears the gradients and
    seeds the next micro-batch's dropout. ``micro_step`` counts the steps taken (resume: pass it back as
    ``micro_step=``, with the optimizer's and schedule's ``state_dict``).

    Args:
        student: the transformers model (or PEFT model) being trained.
        loss: the ``DistillationLoss`` (its projectors train with the student).
        lr, weight_decay, warmup_steps, seed: ``kdcache train``'s ``--lr`` (1e-4), ``--weight-decay`` (0),
            ``--warmup-steps`` (0) and ``--seed`` (0).
        rank: this process's rank (dropout differs per rank); None: ``torch.distributed``'s, else 0.
    """

    def __init__(self, student: nn.Module, loss: nn.Module, *, lr: float = 1e-4, weight_decay: float = 0.0,
                 warmup_steps: int = 0, seed: int = 0, rank: int | None = None, micro_step: int = 0):
        self.params = [p for p in (*student.parameters(), *loss.parameters()) if p.requires_grad]
        self.optimizer = train_optimizer(self.params, lr=lr, weight_decay=weight_decay)
        self.scheduler = train_schedule(self.optimizer, warmup_steps)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = (torch.distributed.get_rank() if distributed else 0) if rank is None else rank
        self.seed, self.micro_step = seed, micro_step
        student.train()
        seed_dropout(self.seed, self.micro_step, self.rank)

    def step(self, total: torch.Tensor) -> None:
        """Backward ``total`` (the loss's ``"loss"``), clip every gradient to norm 1.0, step, and seed the next
        micro-batch's dropout."""
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_step += 1
        seed_dropout(self.seed, self.micro_step, self.rank)
