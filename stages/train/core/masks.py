"""Which positions each loss term counts, from a batch's masks: the one place where "valid" is decided.

A cache row has real tokens (``mask``), a loss mask (``loss_mask``: 1 = train on this token; all ones for plain
text, the assistant's tokens for conversations; absent in caches before format 4, meaning all ones) and, for rows
packed with documents kept apart, ``position_ids`` restarting at each document. From them, per token stream:

* ``trained [B, L]``: real and trained tokens. The rows of hidden-state losses, the query rows of attention
  losses, and the positions of per-token logits (encoders, encoder-decoder decoders).
* ``predicts [B, L]`` (causal LMs): position t's logits count when the token they predict, t+1, is trained and
  continues t's document; at the end of a document or row, where nothing of the same document follows, when t
  itself is trained. With every token trained and no packing this is every real token, as DESIGN's KD KL says.
* ``pairs [B, L-1]`` (causal CE): (t, t+1) counts when both are real, t+1 is trained and continues t's document.

The teacher saw the whole context either way; only what is counted changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenMasks:
    """The counted positions of one stream of a batch (see the module docstring); all bool."""

    real: torch.Tensor
    trained: torch.Tensor
    predicts: torch.Tensor
    pairs: torch.Tensor

    def counted(self) -> tuple[bool, bool]:
        """Whether any token is trained, and any prediction counted, in one host sync for the whole step."""
        trained, predicts = torch.stack([self.trained.any(), self.predicts.any()]).tolist()
        return bool(trained), bool(predicts)


def token_masks(mask: torch.Tensor, loss_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, causal: bool) -> TokenMasks:
    """Args: ``mask``, ``loss_mask``, ``position_ids``: ``[B, L]`` (the last two may be None); ``causal``: logits
    at t predict token t+1."""
    real = mask.bool()
    trained = real if loss_mask is None else real & loss_mask.bool()
    continues = real[:, 1:].clone()
    if position_ids is not None:
        continues &= position_ids[:, 1:] != 0
    pairs = real[:, :-1] & continues & trained[:, 1:]
    if not causal:
        return TokenMasks(real, trained, trained, pairs)
    predicts = trained.clone()
    predicts[:, :-1] = real[:, :-1] & torch.where(continues, trained[:, 1:], trained[:, :-1])
    return TokenMasks(real, trained, predicts, pairs)


def stream_masks(batch: Mapping[str, torch.Tensor], prefix: str = "", *, causal: bool) -> TokenMasks:
    """The masks of one stream of a collated batch (``prefix`` ``""``, ``encoder/`` or ``decoder/``)."""
    return token_masks(batch[prefix + "mask"], batch.get(prefix + "loss_mask"), batch.get(prefix + "position_ids"),
                       causal=causal)
