"""One pass over the LM head for every vocabulary term of a step (CE, the full, top-k, sampled and head KLs).

Each term is a ``ChunkTerm``: a function of one chunk's ``[C, V]`` student logits (float32) and the chunk's targets
that gives a value per row, the rows it counts and its normalisation (1/n_valid, T²). ``vocab_pass`` selects the
union of the terms' rows once, builds each chunk's logits once, evaluates every term on them and takes the gradient
of their weighted sum (α·CE + β·KL) in the forward pass (``HeadPass``, liger-kernel's way): per token three
``[d × V]`` matmuls for all the terms together, where one pass per term cost three each. The per-term values come
back detached, for logging.

A row a term does not count (CE at the end of a document, where the KL still counts) is evaluated on targets that
are finite there (the cache holds every real token; CE's label is made 0) and dropped with ``torch.where``: no host
sync decides which rows a chunk holds. A term with a cheaper road of its own (``ChunkTerm.alone``: liger-kernel's
fused CE on a GPU, the renormalised top-k KL's k logits per token) takes it when every term of the pass has one;
beside a term that builds the full logits anyway, it joins the pass, where it costs a gather. On an H200 (issue 31's
student, CE + top-128 renormalised KL) liger's CE beside the k-logit KL ran at 63,700 tokens/s and the one shared
pure-torch pass at 60,100 (benchmarks/RESULTS.md): liger's fused softmax outweighs the second pass's gather.

On CUDA with triton, a pass whose terms all have a ``ChunkTerm.feed`` takes the fused kernel instead (``_fused``,
``fused_vocab``): the same ``HeadPass`` over every row, the rows no term counts masked rather than selected.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, cast

import torch
from torch.utils.checkpoint import checkpoint

from kdcache.stages.targets.logits.vocab import fused_vocab, kernel_guard, loss_rows
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits, HeadRows
from kdcache.stages.targets.logits.vocab.kernel_feeds import KernelFeed

P = ParamSpec("P")


@dataclass(frozen=True)
class ChunkTerm:
    """One vocabulary term as the pass evaluates it.

    Attributes:
        fn: ``fn(z [C, V] float32, *targets' chunks) -> [C]`` the term's value per row.
        counts: ``[B, L]`` bool, the rows the term counts.
        targets: ``[B, L, ...]`` each; the pass selects its rows. Finite at every real token.
        scale: the sum over counted rows times this (a float, or a 0-dim tensor on the device: 1/n_valid, T²).
        alone: the term's value (with its graph) by a cheaper road, taken when it is the only term of a pass over
            ``HeadLogits``; None: none.
        feed: how the fused kernel computes it (``kernel_feeds``); None: the pure-torch pass only.
    """

    fn: Callable[..., torch.Tensor]
    counts: torch.Tensor
    targets: tuple[torch.Tensor, ...] = ()
    scale: torch.Tensor | float = 1.0
    alone: Callable[[], torch.Tensor] | None = None
    feed: KernelFeed | None = None


def vocab_pass(logits: torch.Tensor | HeadLogits, terms: Sequence[ChunkTerm],
               weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_t weights[t] · value_t with its graph, values [T] detached)`` in one pass over ``logits``.

    Args:
        logits: ``[B, L, V]`` student logits, or the ``HeadLogits`` behind them.
        terms: the terms, each ``value_t = scale_t · Σ_{counted rows} fn_t(row)``.
        weights: one per term (α, β).
    """
    feeds = [term.feed for term in terms]
    # HeadPass's case: the student's head rows take a gradient and no target does.
    wants_grad = isinstance(logits, HeadLogits) and torch.is_grad_enabled() and (
        logits.hidden.requires_grad or logits.weight.requires_grad) and not any(
        t.requires_grad for term in terms for t in term.targets)
    if wants_grad and fused_vocab.takes(logits.device, feeds):
        return _fused(logits, terms, feeds, weights)  # type: ignore[arg-type]  # takes() checked every feed
    if isinstance(logits, HeadLogits) and all(term.alone is not None for term in terms):
        alone = [term.alone() for term in terms]  # type: ignore[misc]  # checked just above
        total = torch.stack([w * value for w, value in zip(weights, alone)]).sum()  # Python floats: no copy
        return total + loss_rows.tied_zero(logits), torch.stack(alone).detach()
    # One index of the union's rows for every selection (a boolean index syncs with the device each time).
    index = _union(logits, terms).flatten().nonzero().squeeze(1)
    rows = _select(logits, index)
    scales, w = _scales_and_weights(terms, weights, logits.device)
    fn = _combined(terms, scales, [len(t.targets) for t in terms])
    # Targets stay whole ([B·L, ...] views); each chunk gathers its own rows, so full teacher logits are never
    # copied whole: [N_v, V] float32 is 512 MiB at 1,024 tokens and V = 128k.
    flat = [r.flatten(0, 1) for term in terms for r in (term.counts, *term.targets)]
    total, values = _run(fn, rows, flat, index, w)
    return total + loss_rows.tied_zero(logits), values


def _fused(logits: HeadLogits, terms: Sequence[ChunkTerm], feeds: Sequence[KernelFeed],
           weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass through the fused kernel: every row of ``[B·L]`` goes through the head and the rows a term does
    not count are masked in the kernel's coefficients, so no index of valid rows (a host sync) is built."""
    scales, w = _scales_and_weights(terms, weights, logits.device)
    widths = [len(t.targets) for t in terms]
    # The kernel on its first chunk of each kind of pass is checked against the pure-torch chunk (kernel_guard).
    facts = kernel_guard.PassFacts(tuple(widths), _kind(feeds), scales, fused_vocab.temperature_of(feeds))
    grad = kernel_guard.GUARD.guarded(fused_vocab.chunk_grad(feeds, scales, widths),
                                      _autograd_grad(_combined(terms, scales, widths)), facts)
    flat = [r.flatten(0, 1) for term in terms for r in (term.counts, *term.targets)]
    union = _union(logits, terms)
    # A row no term counts adds 0 to dz, and 0 · its hidden state to the head's gradient: zeroed here, since a
    # padded position's hidden state may be NaN (a fully masked attention row) and 0 · NaN is NaN.
    hidden = torch.where(union[..., None], logits.hidden, torch.zeros_like(logits.hidden)).flatten(0, 1)
    total, values = HeadPass.apply(hidden, logits.weight, logits.bias, grad, w, loss_rows.LOSS_CHUNK, None, *flat)
    return total + loss_rows.tied_zero(logits), values


def _kind(feeds: Sequence[KernelFeed]) -> tuple[object, ...]:
    """What sets one fused pass apart from another for the guard: each feed's code (a full and a head KL share the
    kernel but not their teacher's logits), the temperature and which feeds read a dense teacher. A dense teacher's
    code is a function's own name, or a module's class (a ``head`` cache's ``TeacherHead``, which as an instance has
    no ``__qualname__``)."""
    teachers = [None if f.teacher is None else getattr(f.teacher, "__qualname__", None) or type(f.teacher).__qualname__
                for f in feeds]
    return (tuple((f.rows.__qualname__, t) for f, t in zip(feeds, teachers)), fused_vocab.temperature_of(feeds))


def _union(logits: torch.Tensor | HeadLogits, terms: Sequence[ChunkTerm]) -> torch.Tensor:
    """``[B, L]`` bool: the rows some term counts."""
    union = loss_rows.bool_mask(terms[0].counts, logits)
    for term in terms[1:]:
        union = union | term.counts
    return union


def _scales_and_weights(terms: Sequence[ChunkTerm], weights: Sequence[float],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T], [T])`` float32 on ``device``: each term's scale and its weight in the pass."""
    return (torch.stack([_scalar(t.scale, device) for t in terms]),
            torch.stack([_scalar(x, device) for x in weights]))


def _select(logits: torch.Tensor | HeadLogits, index: torch.Tensor) -> torch.Tensor | HeadRows:
    """The rows ``index [N]`` of the logits ``[N, V]``, or of the hidden state behind them (``HeadRows [N, d]``)."""
    if isinstance(logits, HeadLogits):
        return HeadRows(logits.hidden.flatten(0, 1).index_select(0, index), logits.weight, logits.bias)
    return logits.flatten(0, 1).index_select(0, index)


def _chunk_rows(flat: Sequence[torch.Tensor], index: torch.Tensor | None, start: int,
                chunk: int) -> list[torch.Tensor]:
    """The rows ``index[start:start + chunk]`` of each ``[B·L, ...]`` tensor of ``flat`` (None: every row)."""
    if index is None:
        return [r[start:start + chunk] for r in flat]
    part = index[start:start + chunk]
    return [r.index_select(0, part) for r in flat]


def _scalar(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor on ``device``; a Python number is filled there, never copied from pageable host
    memory (a copy the host would wait on)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), float(value), dtype=torch.float32, device=device)


def term_value(logits: torch.Tensor | HeadLogits, term: ChunkTerm) -> torch.Tensor:
    """One term on its own: its value with its graph (0 tied to the graph when it counts nothing)."""
    return vocab_pass(logits, [term], [1.0])[0]


def as_loss(term: Callable[P, ChunkTerm], name: str) -> Callable[P, torch.Tensor]:
    """The scalar loss ``name`` of a term builder whose first argument is the student's logits ``[B, L, V]`` (or
    the ``HeadLogits`` behind them): ``term_value`` of its term. A loss is defined once, as its ``*_term``; the
    loss keeps the term's parameters (positional or by keyword) and docs under its own name, returning a scalar."""
    signature = inspect.signature(term)
    first = next(iter(signature.parameters))

    def loss(*args: P.args, **kwargs: P.kwargs) -> torch.Tensor:
        logits = kwargs[first] if first in kwargs else args[0]
        return term_value(cast("torch.Tensor | HeadLogits", logits), term(*args, **kwargs))
    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = term.__doc__
    loss.__module__ = term.__module__
    vars(loss)["__signature__"] = signature.replace(return_annotation=torch.Tensor)  # what help() shows
    return loss


def _combined(terms: Sequence[ChunkTerm], scales: torch.Tensor,
              widths: Sequence[int]) -> Callable[..., torch.Tensor]:
    """``fn(z [C, V], *flat chunk rows) -> [T]``: every term's scaled sum over its counted rows of the chunk; the
    flat rows are, per term, its ``[C]`` counted mask and then its targets."""

    def fn(z: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        z = z.float()  # once for every term (a no-op for fp32 heads)
        values = []
        for term, keep, own in zip(terms, *kernel_guard.split_rows(flat, widths)):
            per_row = term.fn(z, *own)
            values.append(torch.where(keep, per_row, torch.zeros_like(per_row)).sum())
        return torch.stack(values) * scales
    return fn


def _run(fn: Callable[..., torch.Tensor], rows: torch.Tensor | HeadRows, flat: Sequence[torch.Tensor],
         index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks: ``HeadPass`` when the student's head rows are all that takes a gradient, else activation
    checkpointing (materialised logits, or targets with a gradient of their own); a plain loop without grad.
    ``rows`` are the selected ``[N, ...]``; ``flat`` the whole ``[B·L, ...]`` targets, gathered by ``index [N]``."""
    chunk = loss_rows.LOSS_CHUNK
    if isinstance(rows, HeadRows):
        wants = torch.is_grad_enabled() and (rows.hidden.requires_grad or rows.weight.requires_grad)
        if not wants:
            with torch.no_grad():
                values = _sum_chunks(lambda h, *o: fn(replace(rows, hidden=h).logits(), *o), rows.hidden, flat, index,
                                     chunk, len(weights))
            return (weights * values).sum(), values
        if not any(r.requires_grad for r in flat):
            total, values = HeadPass.apply(rows.hidden, rows.weight, rows.bias, _autograd_grad(fn), weights, chunk,
                                           index, *flat)
            return total, values

    def build(first: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        z = replace(rows, hidden=first).logits() if isinstance(rows, HeadRows) else first
        return fn(z, *others)

    def run(first: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        return checkpoint(build, first, *others, use_reentrant=False)
    values = _sum_chunks(run, rows.hidden if isinstance(rows, HeadRows) else rows, flat, index, chunk,
                         len(weights))
    return (weights * values).sum(), values.detach()


def _sum_chunks(fn: Callable[..., torch.Tensor], first: torch.Tensor, flat: Sequence[torch.Tensor],
                index: torch.Tensor, chunk: int, n_terms: int) -> torch.Tensor:
    """``Σ fn(first chunk, *flat's rows of the chunk)`` over chunks of ``chunk`` rows of ``first [N, ...]``
    (``flat``'s rows ``index [N]``): ``[T]`` float32 (zeros for no rows)."""
    total: torch.Tensor | None = None
    for start in range(0, first.shape[0], chunk):
        part = fn(first[start:start + chunk], *_chunk_rows(flat, index, start, chunk))
        total = part if total is None else total + part
    return first.new_zeros(n_terms, dtype=torch.float32) if total is None else total


def _autograd_grad(fn: Callable[..., torch.Tensor]) -> kernel_guard.ChunkGrad:
    """``HeadPass``'s chunk gradient by autograd over ``fn(z [C, V], *rows) -> [T]`` (the pure-torch terms)."""

    def grad(z: torch.Tensor, weights: torch.Tensor, *part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            z = z.detach().requires_grad_(True)
            values = fn(z, *part)
            (dz,) = torch.autograd.grad((weights * values).sum(), z)
        return values.detach(), dz
    return grad


class HeadPass(torch.autograd.Function):
    """``Σ_chunks fn(chunk's [C, V] logits, *chunk's rows)`` (``[T]``) and its weighted sum, over chunks of
    ``hidden [N, d]``; the gradient of the weighted sum is taken chunk by chunk in the forward pass, so the chunk's
    logits live only while it is evaluated and the backward pass only scales the stored ``[N, d]`` and ``[V, d]``
    gradients: three matmuls per chunk for every term together. ``rows`` are whole ``[B·L, ...]`` targets (no
    gradient), each chunk gathering its rows ``index[start:start + chunk]`` (None: the chunk's own rows).
    ``grad(z [C, V], weights [T], *chunk's rows) -> (values [T], dz [C, V])`` takes a chunk's gradient: autograd
    over the pure-torch terms (``_autograd_grad``) or the fused kernel (``fused_vocab.chunk_grad``)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grad: kernel_guard.ChunkGrad, weights: torch.Tensor, chunk: int, index: torch.Tensor | None,
                *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad_h = torch.zeros_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)  # fp32: summed over every chunk
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        values = torch.zeros(len(weights), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, part = hidden[start:start + chunk], _chunk_rows(rows, index, start, chunk)
            chunk_values, dz = grad(torch.nn.functional.linear(h, weight, bias), weights, *part)
            grad_h[start:start + chunk] = dz @ weight
            grad_w += dz.t() @ h
            if grad_b is not None:
                grad_b += dz.float().sum(0)
            values += chunk_values
            del dz  # else this chunk's [C, V] gradient lives on while the next chunk's logits and gradient are built
        ctx.save_for_backward(grad_h, grad_w, *(() if grad_b is None else (grad_b,)))
        ctx.weight_dtype, ctx.extra = weight.dtype, len(rows)
        ctx.mark_non_differentiable(values)
        return (weights * values).sum(), values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _values: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, *grad_b = ctx.saved_tensors
        bias = (grad_b[0] * grad).to(ctx.weight_dtype) if grad_b else None
        return (grad_h * grad.to(grad_h.dtype), (grad_w * grad).to(ctx.weight_dtype), bias, None, None, None, None,
                *(None,) * ctx.extra)
