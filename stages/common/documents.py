"""Packed rows that keep documents apart, as both stages run them.

A row packed with ``--packing documents`` carries ``position_ids`` that restart at 0 where a document starts.
The teacher (stage one) and the student (stage two) run such a row with those positions and a 4-D mask that lets
a token attend only to tokens of its own document, so every document's outputs are those it has alone. The mask
is additive (0 or the dtype's minimum), the form both eager and SDPA attention in transformers take as given.
"""

from __future__ import annotations

import torch


def document_index(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` int64: which document of its row each token belongs to (a new one wherever a position is 0)."""
    return (position_ids == 0).long().cumsum(-1)


def document_attention_mask(position_ids: torch.Tensor, mask: torch.Tensor, *, causal: bool,
                            dtype: torch.dtype) -> torch.Tensor:
    """The 4-D attention mask of packed rows.

    Args:
        position_ids: ``[B, L]``, restarting at 0 at each document (anything at padding).
        mask: ``[B, L]``, 1 for a real token.
        causal: also forbid attending to later tokens (decoder LMs).
        dtype: the model's compute dtype.

    Returns:
        ``[B, 1, L, L]``: 0 where query q may attend key k (same document, real key, and k <= q when causal),
        ``finfo(dtype).min`` elsewhere. A padded query may attend itself only, so its row stays finite; its
        outputs are never read.
    """
    length = position_ids.shape[1]
    docs = document_index(position_ids)
    valid = mask.bool()
    allowed = (docs[:, :, None] == docs[:, None, :]) & valid[:, None, :] & valid[:, :, None]
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    allowed |= torch.eye(length, dtype=torch.bool, device=mask.device)[None] & ~valid[:, :, None]
    additive = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
