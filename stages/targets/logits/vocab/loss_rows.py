"""Helpers shared by stage two's loss modules and the logit kinds' torch halves, beside the pass they serve: masks,
valid-row selection, safe KL terms, the chunk size of the vocabulary pass (``vocab_pass``)."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.autograd.function import BackwardCFunction, FunctionCtx, once_differentiable

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits


def bool_mask(mask: torch.Tensor, like: torch.Tensor | HeadLogits, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as bool after checking it matches the leading ``[B, L]`` of ``like``.

    Args:
        mask: ``[B, L]``, 1 (or True) for a real token; any numeric or bool dtype.
        like: a tensor whose first two dimensions must be ``[B, L]``.
        name: how to call the mask in an error message.
    """
    if mask.dim() != 2 or tuple(like.shape[:2]) != tuple(mask.shape):
        raise LossError(f"{name} has shape {tuple(mask.shape)} but the tensor it masks has {tuple(like.shape)}")
    return mask.bool() if mask.dtype != torch.bool else mask


def valid_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Select the valid token rows of ``x``.

    Selection (rather than multiplying by the mask) is what keeps inf or NaN at padded positions out of both
    the value and the gradient: ``0 * nan`` is ``nan``, a row that is never read is nothing.

    Args:
        x: ``[B, L, ...]``.
        mask: ``[B, L]``.

    Returns:
        ``[N_v, ...]`` in batch-major token order.
    """
    return x[bool_mask(mask, x)]


def tied_zero(logits: torch.Tensor | HeadLogits) -> torch.Tensor:
    """A 0 tied to the student's graph: a term with nothing to count still lets ``backward()`` run."""
    # An empty slice sums to an exact 0 with a grad_fn, whatever garbage (NaN) the padded positions hold.
    return (logits.hidden if isinstance(logits, HeadLogits) else logits)[:, :0].sum(dtype=torch.float32)


LOSS_CHUNK = 256  # valid tokens per chunk of a term over the full vocabulary: [256, 128k] fp32 is 128 MiB


def count_valid(mask: torch.Tensor) -> int:
    """N_v, refusing an all-padding batch (every mean here would be 0/0). Reads the device: a host sync."""
    n = int(mask.sum().item())
    if n == 0:
        raise LossError("the batch has no valid tokens (the mask is all zeros)")
    return n


def valid_count(mask: torch.Tensor) -> torch.Tensor:
    """N_v as a float32 tensor on the mask's device, at least 1: the divisor of a mean that needs no host sync
    (a batch with nothing to count sums no rows, and 0 / 1 is the 0 it should add)."""
    return mask.sum(dtype=torch.float32).clamp_min(1.0)


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Elementwise ``p * (log p - log q)`` with the convention ``0 * log 0 = 0``.

    ``log_p`` may hold ``-inf`` where the target has no mass (a causal row, an empty leftover bucket); those
    entries contribute exactly 0 to the value and to the gradient, never NaN.

    Args:
        log_p: target log-probabilities, any shape.
        log_q: model log-probabilities, same shape, finite where ``p > 0``.
    """
    has_mass = log_p > float("-inf")
    safe_log_p = torch.where(has_mass, log_p, torch.zeros_like(log_p))
    safe_log_q = torch.where(has_mass, log_q, torch.zeros_like(log_q))
    return torch.where(has_mass, safe_log_p.exp() * (safe_log_p - safe_log_q), torch.zeros_like(log_p))


def check_temperature(temperature: float) -> None:
    """Refuse a KD temperature that is not > 0."""
    if not temperature > 0:
        raise LossError(f"the temperature must be > 0, got {temperature}")


def kl_row_values(z: torch.Tensor, z_t: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[C]`` KL(softmax(z_t/T) ‖ softmax(z/T)) per row of student logits ``z [C, V]`` and teacher's ``z_t [C, V]``.

    Through ``SoftmaxKl`` (its gradient written out) unless the teacher's logits take a gradient too; then
    through autograd's chain of ``kl_terms``, which is also the reference the tests hold ``SoftmaxKl`` to.

    Raises:
        LossError: the two differ in shape (the student and the cache must share one vocabulary).
    """
    if z.shape != z_t.shape:
        raise LossError(f"student logits {tuple(z.shape)} and teacher logits {tuple(z_t.shape)} differ on the "
                        f"valid tokens; the student and the cache must share one vocabulary")
    if z_t.requires_grad:
        return kl_terms(_log_softmax(z_t, temperature), _log_softmax(z, temperature)).sum(-1)
    return SoftmaxKl.apply(z, z_t, temperature)


def _log_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(x / T)`` in float32; no scaled copy at T = 1 (one ``[C, V]`` buffer less at the peak)."""
    x = x.float()
    return F.log_softmax(x if temperature == 1 else x / temperature, -1)


class SoftmaxKl(torch.autograd.Function):
    """``[C]`` KL(p ‖ q) per row, p = softmax(z_t/T), q = softmax(z/T), with the student's gradient written out:
    ∂KL/∂z = (q − p) / T (since Σ p = 1). It keeps two ``[C, V]`` float32 buffers for the backward pass (p and
    log q) and at most four at once, where autograd's chain of ``kl_terms`` keeps about eight: at V = 128k and
    256-row chunks that is the difference between 0.5 and 1 GiB per chunk. Rows where p is 0 add exactly 0, as
    in ``kl_terms``; the teacher's logits take no gradient here (``kl_row_values`` routes those elsewhere)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, z_t: torch.Tensor, temperature: float) -> torch.Tensor:
        log_q = _log_softmax(z, temperature)
        log_p = _log_softmax(z_t, temperature)
        diff = torch.sub(log_p, log_q).masked_fill_(log_p == float("-inf"), 0.0)  # 0·log 0 = 0 (also -inf - -inf)
        p = log_p.exp_()  # in place: log p is not needed again
        values = diff.mul_(p).sum(-1)
        ctx.save_for_backward(p, log_q)
        ctx.temperature, ctx.dtype = temperature, z.dtype
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        p, log_q = ctx.saved_tensors
        scale = (grad / ctx.temperature).unsqueeze(-1)
        dz = log_q.exp().sub_(p).mul_(scale)
        # A row the pass drops (grad 0) gets exactly 0, as autograd's chain gave, even where its p is NaN.
        return dz.masked_fill_(scale == 0, 0.0).to(ctx.dtype), None, None


class BucketLogProbs(torch.autograd.Function):
    """``[C, k+1]`` student log-probabilities of the other-bucket top-k KL's buckets: the k ids' full-vocabulary
    log-probabilities ``z[ids] − lse(z)`` and the leftover ``lse(z without the ids) − lse(z)``, from ``z [C, V]``
    and ``ids [C, k]`` (distinct per row, k < V), with the gradient written out.

    Autograd's chain (a logsumexp, a ``[C, V]`` scatter of −inf for the tail and its logsumexp) kept the scattered
    copy for its backward pass and built three more ``[C, V]`` buffers in it. Here only ``z`` (the chunk's logits,
    alive anyway) is kept, and the backward pass holds two ``[C, V]`` buffers: with g the incoming ``[C, k+1]``
    gradient and G = Σ g, ∂/∂z_j = g_i [j = ids_i] + g_tail · exp(z_j − lse_tail) [j ∉ ids] − G · exp(z_j − lse).
    The tail's logsumexp is taken over the scattered logits, as before: ``log(1 − Σ p)`` would cancel to noise.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        lse_tail = torch.logsumexp(z.scatter(1, ids, float("-inf")), dim=-1, keepdim=True)  # the copy dies here
        ctx.save_for_backward(z, ids, lse, lse_tail)
        return torch.cat([torch.gather(z, 1, ids) - lse, lse_tail - lse], dim=-1)

    @staticmethod
    @once_differentiable
    def backward(ctx: BackwardCFunction, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        z, ids, lse, lse_tail = cast(tuple[torch.Tensor, ...], ctx.saved_tensors)
        g_top, g_tail = grad[:, :-1], grad[:, -1:]
        dz = torch.sub(z, lse).exp_().mul_(-grad.sum(-1, keepdim=True))  # −G · softmax(z)
        tail = torch.sub(z, lse_tail).exp_().mul_(g_tail).scatter_(1, ids, 0.0)  # the tail's softmax, 0 at the ids
        dz.add_(tail)
        del tail
        return dz.scatter_add_(1, ids, g_top).to(z.dtype), None
