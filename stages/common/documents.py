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


def documents_apart_problem(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor,
                            position_ids: torch.Tensor, *, causal: bool) -> str | None:
    """Why ``model`` does not keep packed documents apart, or None when it does.

    Some families compute positions or attention biases their own way (RoBERTa offsets positions by its padding
    id, ALiBi models build their bias from a 2-D mask), and a sliding window shorter than the rows is not in the
    4-D mask, so restarting positions and that mask do not give them per-document outputs. This runs the base
    model on the first row with two documents, packed and the second document alone, and compares that
    document's last hidden states.

    Args:
        input_ids, mask, position_ids: ``[B, L]`` a padded batch of packed rows.
        causal: whether the model attends causally.
    """
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window < mask.shape[1] and getattr(config, "use_sliding_window", True) is not False:
        return f"its sliding window of {window} tokens is shorter than these rows, and the 4-D mask does not carry it"
    starts = ((position_ids == 0) & mask.bool()).sum(1)
    row = int(starts.argmax())
    if int(starts[row]) < 2:
        return None  # no row holds two documents: nothing to compare
    length = int(mask[row].sum())
    edges = torch.nonzero(position_ids[row, :length] == 0).flatten().tolist() + [length]
    doc = slice(edges[1], edges[2])
    ids, pos = input_ids[row:row + 1, :length], position_ids[row:row + 1, :length]
    dtype = getattr(model, "dtype", torch.float32)
    base = getattr(model, "base_model", model)
    extra = {"use_cache": False} if causal else {}
    try:
        packed = base(input_ids=ids, position_ids=pos, attention_mask=document_attention_mask(
            pos, mask[row:row + 1, :length], causal=causal, dtype=dtype), **extra).last_hidden_state[0, doc]
        alone = base(input_ids=ids[:, doc], attention_mask=torch.ones_like(ids[:, doc]), **extra).last_hidden_state[0]
    except Exception as exc:  # a family that cannot take a 4-D mask fails in its own way
        return f"{type(exc).__name__}: {exc}"
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    gap = float((packed.float() - alone.float()).abs().max())
    return None if gap <= tolerance * max(1.0, float(alone.float().abs().max())) else (
        f"a packed document's outputs differ from the document's own by up to {gap:.3g}")
