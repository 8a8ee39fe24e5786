"""The draft's reduced vocabulary: the N most frequent target tokens, with EAGLE-3's d2t / t2d maps, and the
target's next-token distribution restricted to it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdcache.storage import KdcacheError


class DraftInputError(KdcacheError, ValueError):
    """A draft cannot be built or run from what it was given (names the value and what was expected)."""


@dataclass(frozen=True)
class DraftVocab:
    """``ids [N]`` the target ids the draft predicts, ascending; ``d2t [N]`` offsets (``ids - arange(N)``, as
    EAGLE-3 checkpoints store them); ``t2d [V]`` bool membership; ``index [V]`` each id's draft index or -1."""

    ids: torch.Tensor
    vocab_size: int

    @classmethod
    def most_frequent(cls, counts: torch.Tensor, size: int) -> DraftVocab:
        """The ``size`` most frequent ids of ``counts [V]`` (ties to the lower id; unseen ids come last).

        Raises:
            DraftInputError: ``size`` outside 1..V.
        """
        vocab = int(counts.shape[0])
        if not 1 <= size <= vocab:
            raise DraftInputError(f"draft vocabulary: got {size} tokens, expected 1..{vocab} (the target's "
                                  f"vocabulary size V)")
        order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
        return cls(torch.sort(order).values, vocab)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(d2t.shape[0]) + d2t.to(torch.int64).cpu(), vocab_size)

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(self.ids.shape[0])

    @property
    def t2d(self) -> torch.Tensor:
        member = torch.zeros(self.vocab_size, dtype=torch.bool)
        member[self.ids] = True
        return member

    @property
    def index(self) -> torch.Tensor:
        index = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        index[self.ids] = torch.arange(self.ids.shape[0])
        return index


def restrict_logits(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full target logits ``[..., V]`` -> (probabilities over the draft ids ``[..., N]``, renormalised; ``[...]``
    bool: the target's most likely token is a draft token, the positions EAGLE-3 trains on)."""
    keep = logits.argmax(-1, keepdim=True)
    usable = (keep == ids.to(keep.device)).any(-1)
    return torch.softmax(logits.float().index_select(-1, ids.to(logits.device)), dim=-1), usable


def restrict_topk(logprobs: torch.Tensor, topk_ids: torch.Tensor, index: torch.Tensor, size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probabilities ``[..., k]`` (sorted, largest first) at ``topk_ids`` -> (probabilities over the
    ``size`` draft ids, the kept mass renormalised; usable positions as ``restrict_logits``). ``index [V]``
    maps a target id to its draft index or -1."""
    where = index.to(topk_ids.device)[topk_ids.long()]
    mass = torch.where(where >= 0, logprobs.float().exp(), torch.zeros((), device=logprobs.device))
    dense = torch.zeros(*logprobs.shape[:-1], size, device=logprobs.device)
    dense.scatter_add_(-1, where.clamp(min=0), mass)
    total = dense.sum(-1, keepdim=True)
    return dense / total.clamp(min=1e-30), where[..., 0] >= 0
