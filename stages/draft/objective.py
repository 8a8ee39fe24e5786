"""The draft's loss from a cache batch: soft cross-entropy against the target's next-token distribution restricted to
the draft vocabulary, over the training-time-test steps.

Step k at position t predicts ``x_{t+2+k}``; its target is the cached distribution at position ``t+1+k`` (what the
target predicted there), renormalised over the draft tokens. As in EAGLE-3's trainers, a position counts only if
the target's most likely token is a draft token (the draft could never propose it otherwise), and step k weighs
``0.8 ** k`` (EAGLE's decay: later steps matter for fewer rounds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kdcache.stages.draft.vocab import DraftInputError, DraftVocab, restrict_logits, restrict_topk

if TYPE_CHECKING:
    from kdcache.stages.draft.model import Eagle3Draft
    from kdcache.stages.targets.logits import LogitKind
    from kdcache.stages.targets.logits.teacher_head import TeacherHead
    from kdcache.storage import CacheSpec

STEP_DECAY = 0.8


def distribution_arrays(spec: CacheSpec, kind: LogitKind | None) -> list[str]:
    """The cache arrays the target's distribution is read from, for a cache of logit ``kind``.

    Raises:
        DraftInputError: a cache without logits, or whose logits are not a distribution per token (sampled draws).
    """
    if kind is not None and kind.teacher_head:
        return [f"hidden/{max(spec.hidden_layers)}"]
    if kind is not None and (kind.exact_vocab or kind.ranked) and kind.key_array:
        return list(spec.logit_arrays())
    got = "no logits" if kind is None else f"--logits {kind.name}"
    raise DraftInputError(f"this cache has {got}; a draft learns the target's next-token distribution, so write the "
                          f"cache with --features hidden,logits and --logits head (exact) or topk")


class DraftObjective(nn.Module):
    """``forward(batch) -> {"loss", "accuracy"}``: the draft under training, the target's head (a ``head`` cache)
    as buffers, and how to read the target's distribution."""

    ids: torch.Tensor
    index: torch.Tensor

    def __init__(self, draft: Eagle3Draft, kind: LogitKind, head: TeacherHead | None, steps: int):
        super().__init__()
        self.draft, self.kind, self.head, self.steps = draft, kind, head, steps
        self.vocab = DraftVocab.from_d2t(draft.d2t, int(draft.t2d.shape[0]))
        self.register_buffer("ids", self.vocab.ids, persistent=False)
        self.register_buffer("index", self.vocab.index, persistent=False)

    def target(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution over the draft tokens ``[B, L, N]`` and usable positions ``[B, L]``."""
        if self.head is not None:
            return restrict_logits(self.head(batch[f"hidden/{self.head.layer}"]), self.ids)
        if self.kind.exact_vocab and self.kind.key_array:
            return restrict_logits(batch[self.kind.key_array], self.ids)
        values = batch["logits/topk_values"].float()
        lse = batch.get("logits/lse")  # absent when the values are log-probabilities already
        logprobs = values if lse is None else values - lse.float()[..., None]
        return restrict_topk(logprobs, batch["logits/topk_ids"], self.index, int(self.ids.shape[0]))

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        layers = self.draft.shape.layers
        features = torch.cat([batch[f"hidden/{j}"] for j in layers], dim=-1)
        probs, usable = self.target(batch)
        valid = usable & batch["mask"].bool()
        total, correct, counted = features.new_zeros(()), features.new_zeros(()), features.new_zeros(())
        for k, logits in enumerate(self.draft.unrolled(features, batch["input_ids"], self.steps)):
            p, keep = _shift(probs, 1 + k), _shift(valid, 1 + k)
            ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)
            n = keep.sum().clamp(min=1)
            total = total + STEP_DECAY ** k * (ce * keep).sum() / n
            correct = correct + ((logits.argmax(-1) == p.argmax(-1)) & keep).sum()
            counted = counted + keep.sum()
        return {"loss": total, "accuracy": correct / counted.clamp(min=1)}


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x [B, L, ...]`` moved ``by`` positions left along L, zero-filled at the end."""
    out = torch.zeros_like(x)
    if by < x.shape[1]:
        out[:, :x.shape[1] - by] = x[:, by:]
    return out
