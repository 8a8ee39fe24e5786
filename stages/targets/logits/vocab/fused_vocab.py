"""The vocabulary pass's chunk gradient through the fused Triton kernel (``vocab_kernels``), for every term at once.

Per chunk of ``C`` rows: the student's ``[C, V]`` logits come from one matmul (``vocab_pass.HeadPass``); the
kernel's first pass gives each row's log-sum-exps (T = 1 and T; the dense teacher's at T and the KL's cross
term); each term's feed (``kernel_feeds``) turns those and a gather of its few logits per row into its value and
the coefficients of its gradient; the second pass writes ``dz`` over the logits in place, and the gradient at the
terms' sparse ids (labels, top-k and drawn ids) is formed in float32 and written once (``_at_ids``). Where the
pure-torch pass runs a dozen float32 ``[C, V]`` kernels per term and keeps their buffers for autograd, this reads
the chunk twice and keeps nothing.

It runs on CUDA with triton installed, for a pass whose terms all have feeds (every KL kind but the top-k KL's
``other`` variant, and CE), at most one dense teacher and one temperature among the terms that read statistics at T;
otherwise the pure-torch pass runs (the CPU's path, and the reference the tests hold this to).
On the CPU it runs only where ``INTERPRET_ON_CPU`` is set, under ``TRITON_INTERPRET=1``: the tests' way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.vocab import kernel_guard
from kdcache.stages.targets.logits.vocab.head_logits import fused_ce_available
from kdcache.stages.targets.logits.vocab.kernel_feeds import ChunkView, KernelFeed, RowGrad, RowStats
from kdcache.stages.targets.logits.vocab.kernel_guard import ChunkGrad, VocabRoad, split_rows

# The tests turn this on (with TRITON_INTERPRET=1 set before triton is imported) to run the kernels on the CPU.
INTERPRET_ON_CPU = False


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run on ``device``."""
    on = device.type == "cuda" or (device.type == "cpu" and INTERPRET_ON_CPU)
    return on and importlib.util.find_spec("triton") is not None


def use_road(road: VocabRoad | str, device: torch.device) -> VocabRoad:
    """Set this process's road (``--vocab-kernel``) for a run on ``device``; ``fused`` where the kernel cannot run
    is refused here, before the run starts, rather than quietly taking the pure-torch pass."""
    road = VocabRoad.of(road)
    if road is VocabRoad.FUSED and not available(device):
        need = "a CUDA device" if device.type != "cuda" else "the triton package"
        raise LossError(f"--vocab-kernel fused needs {need} (this run is on {device.type}); use --vocab-kernel "
                        "auto (the kernel where it can run) or torch")
    kernel_guard.set_road(road)
    return road


def takes(device: torch.device, feeds: Sequence[KernelFeed | None]) -> bool:
    """Whether a pass of terms with these feeds runs fused: the road allows the kernel, every term has a feed, at
    most one reads a dense teacher, and the feeds that read the statistics at T (``KernelFeed.temperature`` not
    None) ask for one T."""
    if not kernel_guard.GUARD.allows() or not available(device) or any(feed is None for feed in feeds):
        return False
    known = [feed for feed in feeds if feed is not None]
    teachers = sum(feed.teacher is not None for feed in known)
    return teachers <= 1 and len({feed.temperature for feed in known} - {None}) <= 1


def temperature_of(feeds: Sequence[KernelFeed]) -> float:
    """The pass's temperature: the one its T-reading feeds share (1 when none reads T)."""
    return next((feed.temperature for feed in feeds if feed.temperature is not None), 1.0)


def chunk_grad(feeds: Sequence[KernelFeed], scales: torch.Tensor, widths: Sequence[int]) -> ChunkGrad:
    """``grad(z [C, V], weights [T], *rows) -> (values [T], dz [C, V])`` for ``vocab_pass.HeadPass``; ``rows`` are,
    per term, its ``[C]`` counted mask and then its ``widths[t]`` targets' rows. ``dz`` is ``z``, overwritten."""
    from kdcache.stages.targets.logits.vocab import vocab_kernels  # imports triton: only when the kernel runs

    temperature = temperature_of(feeds)

    def grad(z: torch.Tensor, weights: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keeps, targets = split_rows(rows, widths)
        teacher = next((f.teacher(*t) for f, t in zip(feeds, targets) if f.teacher is not None), None)
        teacher = None if teacher is None else teacher.contiguous()
        stats = vocab_kernels.row_stats(z, teacher, temperature)
        parts = [f.rows(ChunkView(stats, z, keep), *t) for f, keep, t in zip(feeds, keeps, targets)]
        values = torch.stack([torch.where(keep, p.value, torch.zeros_like(p.value)).sum()
                              for p, keep in zip(parts, keeps)]) * scales
        per_row = [torch.where(keep, c, torch.zeros_like(c)) for keep, c in zip(keeps, weights * scales)]
        coefficients, ids, at_ids = _combine(parts, per_row, stats.lse)
        exact = None if ids is None or at_ids is None else _at_ids(z, teacher, stats, coefficients, ids, at_ids,
                                                                   temperature)
        vocab_kernels.write_grad(z, teacher, stats, coefficients, temperature)  # z holds dz from here on
        if exact is not None:
            z.scatter_(1, ids, exact.to(z.dtype))  # type: ignore[arg-type]  # set with exact
        return values, z
    return grad


def _at_ids(z: torch.Tensor, teacher: torch.Tensor | None, stats: RowStats, coefficients: torch.Tensor,
            ids: torch.Tensor, at_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[C, K]`` float32: the whole gradient at ``ids`` (the kernel's dense part there, recomputed from the logits
    before they are overwritten, plus every sparse part at that id), to be written once in the logits' dtype.

    Adding the sparse parts to bf16 dense values would round twice: CE's label at s_y = 0.9995 would read
    bf16(0.9995) - 1 = 0, where liger's kernel and the pure-torch pass give -0.0005. An id listed twice in a row (a
    label among the top-k, a sampled id repeated in unused slots) gets the sum of all its parts in each slot."""
    z_ids = z.gather(1, ids).float()
    dense = _part(coefficients[:, 0:1], z_ids, stats.lse[:, None])
    dense = dense + _part(coefficients[:, 1:2], z_ids / temperature, stats.lse_t[:, None])  # lse_t is lse at T = 1
    if teacher is not None and stats.teacher_lse is not None:
        t_ids = teacher.gather(1, ids).float() / temperature
        dense = dense + _part(coefficients[:, 2:3], t_ids, stats.teacher_lse[:, None])
    return dense + _summed_per_id(ids, at_ids)


def _summed_per_id(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[C, K]``: in each slot, the sum of ``values`` over the row's slots holding the same id. Sorted runs of equal
    ids are summed (``scatter_add``) and put back in place: ``[C, K]`` work, not the ``[C, K, K]`` of comparing every
    pair (38 MB and 58 ms a chunk at C = 256, K = 193 on a CPU), and no host sync."""
    order = ids.argsort(dim=1)
    sorted_ids = ids.gather(1, order)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = starts.cumsum(1) - 1  # [C, K]: each sorted slot's run of equal ids
    sums = torch.zeros_like(values).scatter_add_(1, run, values.gather(1, order))
    return torch.empty_like(values).scatter_(1, order, sums.gather(1, run))


def _part(coefficient: torch.Tensor, x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``coefficient · exp(x − lse)``, exactly 0 where the coefficient is 0 (the kernel's rule)."""
    return torch.where(coefficient != 0, coefficient * torch.exp(x - lse), torch.zeros_like(x))


def _combine(parts: Sequence[RowGrad], per_row: Sequence[torch.Tensor],
             like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every term's coefficients weighted by ``per_row [C]`` (weight × scale where it counts, else exactly 0):
    ``[C, 3]`` dense coefficients ``(a, a_T, a_t)``, and the sparse ids and values ``[C, Σk]`` (None: none)."""
    dense = torch.zeros((like.shape[0], 3), dtype=torch.float32, device=like.device)
    ids, values = [], []
    for part, c in zip(parts, per_row):
        live = c != 0
        for column, coefficient in enumerate((part.a, part.a_t, part.a_teacher)):
            if coefficient is not None:  # where, not a product: a row that counts nothing may hold NaN
                dense[:, column] += torch.where(live, c * coefficient, torch.zeros_like(c))
        if part.ids is not None and part.at_ids is not None:
            ids.append(part.ids)
            values.append(torch.where(live[:, None], c[:, None] * part.at_ids, torch.zeros_like(part.at_ids)))
    if not ids:
        return dense, None, None
    return dense, torch.cat(ids, dim=1), torch.cat(values, dim=1)


def vocab_path(device: torch.device) -> str:
    """The path the vocabulary losses take from the last hidden state, in words (train's first lines say it)."""
    if available(device) and kernel_guard.GUARD.allows():
        return ("fused: every vocabulary term of the step in one Triton kernel per chunk of the LM head, which "
                "writes the logits' gradient in place, checked against the pure-torch pass on its first chunk "
                f"(--vocab-kernel {kernel_guard.GUARD.road.value}; a cross-tokenizer term and the top-k KL's other "
                "variant keep the pure-torch pass)")
    if fused_ce_available(device):
        return ("fused: cross-entropy in liger-kernel's fused linear cross-entropy, beside a renormalised top-k KL "
                "on its k logits; with any other KL term, one pass of the LM head in chunks for every term (pure "
                "torch)")
    return "chunked: one pass of the LM head in chunks for every vocabulary term, [B, L, V] never built (pure torch)"
