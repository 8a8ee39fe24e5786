"""Hidden-state losses: masked MSE, cosine, and linear CKA in its standard and square-root forms.

Shapes: ``h_s [B, L, d_s]`` (already projected to ``d_t`` for ``mse`` and ``cosine``), ``h_t [B, L, d_t]``,
``mask [B, L]``. Rows are the valid tokens pooled over the batch; padded rows are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, count_valid, valid_count, valid_rows

# Guards the CKA denominators and the centring norm: a constant batch (zero variance) gives CKA = 0, not NaN.
CKA_EPS = 1e-12
COSINE_EPS = 1e-8


def masked_mse(h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over valid tokens and dims of (h_s − h_t)², divided by N_v · d_t: a scalar (``h_s [B, L, d_t]``
    projected, ``h_t [B, L, d_t]``, ``mask [B, L]``)."""
    _check_same_shape(h_s, h_t, "mse")
    m = bool_mask(mask, h_s)
    n_valid = valid_count(m)  # on the device: no host sync
    # Masked with torch.where, not selected: a boolean index waits for the device to count the rows (a host sync
    # per layer and side). Padded positions (NaN or inf alike) add exactly 0 to the value and to the gradient:
    # nothing between the subtraction and the square multiplies by them.
    diff = torch.where(m.unsqueeze(-1), h_s.float() - h_t.float(), 0.0)
    return diff.pow(2).sum() / (n_valid * h_t.shape[-1])


def cosine_loss(h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens of 1 − cos(h_s, h_t): a scalar in [0, 2] (``h_s [B, L, d_t]`` projected,
    ``h_t [B, L, d_t]``, ``mask [B, L]``)."""
    _check_same_shape(h_s, h_t, "cosine")
    n_valid = valid_count(bool_mask(mask, h_s))
    s, t = valid_rows(h_s, mask).float(), valid_rows(h_t, mask).float()
    return (1.0 - F.cosine_similarity(s, t, dim=-1, eps=COSINE_EPS)).sum() / n_valid


def cka_loss(h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Standard (Kornblith) linear CKA loss: 1 − ‖ΣTS‖²_F / (‖ΣTT‖_F · ‖ΣSS‖_F). No projector needed.

    Args:
        h_s: ``[B, L, d_s]`` raw student states; h_t: ``[B, L, d_t]``; mask: ``[B, L]``.

    Returns:
        Scalar in [0, 1].
    """
    return 1.0 - linear_cka(h_s, h_t, mask)


def cka_sqrt_loss(h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The form of seed 001: 1 − ‖ΣTS‖_F / sqrt(‖ΣTT‖_F · ‖ΣSS‖_F), which equals 1 − sqrt(CKA).

    Computed from the unsquared norm as written rather than as sqrt(CKA): the norm's gradient at 0 is 0 in
    torch, while sqrt's is infinite, so a batch with CKA = 0 still gives a finite gradient and an exact value.

    Args:
        h_s: ``[B, L, d_s]``; h_t: ``[B, L, d_t]``; mask: ``[B, L]``.

    Returns:
        Scalar in [0, 1].
    """
    with torch.autocast(device_type=h_s.device.type, enabled=False):
        cross, norm_t, norm_s = _cka_norms(h_s, h_t, mask)
        return 1.0 - cross / (norm_t * norm_s + CKA_EPS).sqrt()


def linear_cka(h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Linear CKA between the valid rows of two representations: ‖XᵀY‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F).

    Returns:
        Scalar in [0, 1].
    """
    with torch.autocast(device_type=h_s.device.type, enabled=False):
        cross, norm_t, norm_s = _cka_norms(h_s, h_t, mask)
        return cross.pow(2) / (norm_t * norm_s + CKA_EPS)


def _cka_norms(
    h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖XᵀY‖_F, ‖XᵀX‖_F and ‖YᵀY‖_F in the cheap d x d form (call with autocast off: in bf16 they lose accuracy).

    X: the centred teacher rows ``[N_v, d_t]``, Y: the centred student rows ``[N_v, d_s]``; the 1/(N−1)
    covariance factors cancel in every ratio. The cost is O(N_v · (d_t + d_s)²) and the memory
    O((d_t + d_s)²), never an N_v x N_v Gram matrix. Each side is first divided by its Frobenius norm: CKA is
    invariant to that scaling, and it keeps the fourth-power sums near 1 instead of overflowing float32.
    """
    if h_s.shape[:2] != h_t.shape[:2]:
        raise LossError(f"CKA needs the same [B, L]: student {tuple(h_s.shape)}, teacher {tuple(h_t.shape)}")
    count_valid(bool_mask(mask, h_s))
    x = _centred_unit(valid_rows(h_t, mask).float())
    y = _centred_unit(valid_rows(h_s, mask).float())
    return (
        torch.linalg.matrix_norm(x.T @ y),
        torch.linalg.matrix_norm(x.T @ x),
        torch.linalg.matrix_norm(y.T @ y),
    )


def _centred_unit(rows: torch.Tensor) -> torch.Tensor:
    """Centre ``[N, d]`` rows over N, then scale the whole matrix to unit Frobenius norm."""
    centred = rows - rows.mean(dim=0, keepdim=True)
    return centred / centred.norm().clamp_min(CKA_EPS)


def _check_same_shape(h_s: torch.Tensor, h_t: torch.Tensor, name: str) -> None:
    if h_s.shape != h_t.shape:
        raise LossError(
            f"the {name} hidden loss needs equal shapes, got student {tuple(h_s.shape)} and teacher "
            f"{tuple(h_t.shape)}; project the student to d_t first (Projectors)"
        )
