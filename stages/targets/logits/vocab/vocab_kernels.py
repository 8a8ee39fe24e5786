"""The two Triton kernels of the fused vocabulary pass (``fused_vocab``): per-row statistics, then the gradient.

Both run one program per row of a chunk's ``[C, V]`` student logits ``z`` and walk the row in blocks of
``block_v`` columns, reading each block once (liger-kernel's fused cross-entropy reads its rows twice the same
way). With a dense teacher (``--logits full`` or ``head``) its ``[C, V]`` logits ``z_t`` are read alongside.

- ``row_stats``: online max and sum-exp of ``z`` at T = 1 and at T, of ``z_t / T``, and the KL's cross term
  ``Σ_j softmax(z_t/T)_j (z_t − z)_j / T``. Every term's value is a function of these and of a gather of a few
  logits per row (``kernel_feeds``).
- ``write_grad``: ``dz = a·softmax(z) + a_T·softmax(z/T) + a_t·softmax(z_t/T)`` with per-row coefficients, written
  over ``z`` in place; at the sparse ids (a label, top-k or drawn ids) ``fused_vocab`` then writes the whole
  gradient, formed in float32, over what the kernel wrote. A coefficient of 0 adds exactly 0, even where its
  softmax is NaN (a masked row's garbage teacher), so rows that count nothing are masked, never selected: no host
  sync.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernels run on CPU tensors: that is how the
tests check their values and gradients on a machine without a GPU. This module imports triton at the top; it is
imported only when the fused pass runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdcache.stages.targets.logits.vocab.kernel_feeds import RowStats

MAX_BLOCK_V = 8192  # columns per block: [8192] fp32 per operand in registers; tune on the GPU (issue 42)
NUM_WARPS = 16


@triton.jit
def _online(m, s, x):
    """One block ``x`` folded into a running max ``m`` and sum ``s`` of ``exp(x − m)``; -inf-safe."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: exp(-inf - -inf) would be NaN
    s = s * tl.exp(m - base) + tl.sum(tl.exp(x - base), axis=0)
    return m_new, s


@triton.jit
def _row_stats_kernel(z_ptr, z_stride, t_ptr, t_stride, out_ptr, n_cols, inv_t,
                      SAME_T: tl.constexpr, TEACHER: tl.constexpr, BLOCK: tl.constexpr):
    """``out[row] = (max, sum, max_T, sum_T, teacher max, teacher sum, cross sum)`` for one row (program id)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    t_row = t_ptr + row * t_stride
    m1 = float("-inf")
    s1 = 0.0
    mt = float("-inf")
    st = 0.0
    mq = float("-inf")
    sq = 0.0
    cross = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m1, s1 = _online(m1, s1, z)
        if not SAME_T:
            mt, st = _online(mt, st, z * inv_t)
        if TEACHER:
            q = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
            mq_new = tl.maximum(mq, tl.max(q, axis=0))
            base = tl.where(mq_new == float("-inf"), 0.0, mq_new)
            w = tl.exp(q - base)
            # 0 · (−inf − z) is NaN: entries without teacher mass (and the padding columns) add exactly 0.
            term = tl.where(w > 0, w * (q - z * inv_t), 0.0)
            scale = tl.exp(mq - base)
            sq = sq * scale + tl.sum(w, axis=0)
            cross = cross * scale + tl.sum(term, axis=0)
            mq = mq_new
    out = out_ptr + row * 7
    tl.store(out, m1)
    tl.store(out + 1, s1)
    tl.store(out + 2, mt)
    tl.store(out + 3, st)
    tl.store(out + 4, mq)
    tl.store(out + 5, sq)
    tl.store(out + 6, cross)


@triton.jit
def _softmax_part(coef, x, lse):
    """``coef · exp(x − lse)``, exactly 0 where ``coef`` is 0 (whatever ``x`` or ``lse`` hold)."""
    return tl.where(coef != 0, coef * tl.exp(x - lse), 0.0)


@triton.jit
def _row_grad_kernel(z_ptr, z_stride, t_ptr, t_stride, coef_ptr, n_cols, inv_t,
                     SAME_T: tl.constexpr, TEACHER: tl.constexpr, BLOCK: tl.constexpr):
    """``z[row] ← a·softmax(z) + a_T·softmax(z/T) + a_t·softmax(z_t/T)``; ``coef[row] = (a, lse, a_T, lse_T,
    a_t, teacher lse)``."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    t_row = t_ptr + row * t_stride
    c = coef_ptr + row * 6
    a1 = tl.load(c)
    lse1 = tl.load(c + 1)
    at = tl.load(c + 2)
    lset = tl.load(c + 3)
    aq = tl.load(c + 4)
    lseq = tl.load(c + 5)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
        dz = _softmax_part(a1, z, lse1)
        if not SAME_T:
            dz += _softmax_part(at, z * inv_t, lset)
        if TEACHER:
            q = tl.load(t_row + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
            dz += _softmax_part(aq, q, lseq)
        tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=inside)


def _block(n_cols: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(n_cols))


def _lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return m + s.log()


def row_stats(z: torch.Tensor, teacher: torch.Tensor | None, temperature: float) -> RowStats:
    """Per-row statistics of student logits ``z [C, V]`` (rows contiguous) and teacher logits ``[C, V]``."""
    same_t = temperature == 1.0
    # NaN until the kernel writes it: a row it skipped could not pass for a statistic.
    out = torch.full((z.shape[0], 7), float("nan"), dtype=torch.float32, device=z.device)
    if z.shape[0]:
        t = z if teacher is None else teacher
        _row_stats_kernel[(z.shape[0],)](z, z.stride(0), t, t.stride(0), out, z.shape[1], 1.0 / temperature,
                                         SAME_T=same_t, TEACHER=teacher is not None, BLOCK=_block(z.shape[1]),
                                         num_warps=NUM_WARPS)
    lse = _lse(out[:, 0], out[:, 1])
    lse_t = lse if same_t else _lse(out[:, 2], out[:, 3])
    if teacher is None:
        return RowStats(lse, lse_t)
    return RowStats(lse, lse_t, _lse(out[:, 4], out[:, 5]), out[:, 6] / out[:, 5])


def write_grad(z: torch.Tensor, teacher: torch.Tensor | None, stats: RowStats, coefficients: torch.Tensor,
               temperature: float) -> None:
    """Overwrite ``z [C, V]`` with its dense gradient; ``coefficients [C, 3]`` are ``(a, a_T, a_t)`` per row."""
    if not z.shape[0]:
        return
    zero = torch.zeros_like(stats.lse)
    if temperature == 1.0:  # softmax(z / T) is softmax(z): one coefficient, one exp per element
        coefficients = torch.stack([coefficients[:, 0] + coefficients[:, 1], zero, coefficients[:, 2]], dim=1)
    packed = torch.stack([coefficients[:, 0], stats.lse, coefficients[:, 1], stats.lse_t, coefficients[:, 2],
                          zero if stats.teacher_lse is None else stats.teacher_lse], dim=1).contiguous()
    t = z if teacher is None else teacher
    _row_grad_kernel[(z.shape[0],)](z, z.stride(0), t, t.stride(0), packed, z.shape[1], 1.0 / temperature,
                                    SAME_T=temperature == 1.0, TEACHER=teacher is not None,
                                    BLOCK=_block(z.shape[1]), num_warps=NUM_WARPS)
