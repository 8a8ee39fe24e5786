"""One optimizer step, whatever the batch is split into: each term normalised by the count of its whole step.

A term of the loss is a mean over the rows it counts: tokens (CE, the KLs, the hidden losses) or query rows
(attention). Averaging the micro-batches' means weighs a micro-batch with few counted rows as much as one with
many, so gradient accumulation and data parallelism would train on another objective than one big batch: the bug
transformers fixed in 4.46 with ``num_items_in_batch``. Here each term carries its own count, since CE, the KL and
the hidden terms count different rows of the same micro-batch (a document's last token predicts nothing, a chat
row trains on the assistant's tokens only).

For a step of ``m`` micro-batches on each of ``w`` ranks, with ``n`` rows counted by a term in one micro-batch and
``N`` in the whole step, the micro-batch's mean is multiplied by ``n / R``, ``R = N / (m · w)`` (the mean count of
a micro-batch). DeepSpeed and ``Trainer`` divide the loss by ``m`` before backward and the ranks average their
gradients (÷ w), so the step's gradient is that of Σ(row terms) / N, the big batch's. The scaled values are what
is logged: their mean over the micro-batches and ranks of a step is the step's per-row mean. With one micro-batch
on one rank ``n / R`` is exactly 1.

CKA is a statistic of a micro-batch's pooled rows, not a mean of row terms: it is weighed by its token share the
same way, which makes the split an average of CKAs, not the CKA of the big batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kdcache.stages.train.core.masks import stream_masks
from kdcache.storage import prefixed

if TYPE_CHECKING:
    from kdcache.stages.train.objective.compound import RunLoss

Counts = dict[str, float]  # term key (``ce``, ``kl``, ``hidden``, ``attention``, stream-prefixed) -> counted rows
STEP_COUNTS = "step_counts"  # a host batch's key for (its own counts, the counts of every batch of its step)


def term_counts(criterion: RunLoss, batch: Mapping[str, torch.Tensor]) -> Counts:
    """The rows each term of ``criterion`` averages over in ``batch`` (host or device tensors), from its masks.

    Keys are the families the weights name (``ce``, ``kl``, ``hidden``, ``attention``), prefixed with their stream
    (``decoder/ce``), and ``cross_attention``; the same for every batch of a run, so ranks reduce them in step.
    """
    counts: Counts = {}
    for stream in criterion.streams:
        part = criterion.part(stream)
        masks = stream_masks(batch, prefixed(stream, ""), causal=part.ce == "causal")
        rows = {"ce": masks.pairs if part.ce == "causal" else masks.trained, "kl": masks.predicts,
                "hidden": masks.trained, "attention": masks.trained}
        for family, mask in rows.items():
            if part.weights[family] > 0:  # each weighed family, with the rows its terms count
                counts[prefixed(stream, family)] = float(mask.sum())
    if criterion.cross_pairs:
        counts["cross_attention"] = float(stream_masks(batch, "decoder/", causal=False).trained.sum())
    return counts


@dataclass
class StepCounts:
    """The counts of every micro-batch of one optimizer step on this rank, and (once asked) the step's reference
    count R per term over every rank, shared by the step's micro-batches."""

    step: list[Counts]
    reference: Counts | None = field(default=None)

    def scales(self, own: Counts, world_size: int, device: torch.device | str = "cpu") -> Counts:
        """``n / R`` per term for the micro-batch counting ``own`` (see the module docstring). The first call of a
        step sums its counts over the ranks in one all-reduce on ``device`` (every rank calls it at the same
        micro-batch; NCCL reduces device tensors only, so a multi-GPU step reads the sums back once). A term no row
        of the step counts keeps scale 1 (it adds a 0 tied to the graph)."""
        if self.reference is None:
            names = sorted(own)
            totals = [sum(c[n] for c in self.step) for n in names]
            if world_size > 1:
                summed = torch.tensor(totals, dtype=torch.float64, device=device)
                dist.all_reduce(summed, op=dist.ReduceOp.SUM)
                totals = summed.tolist()
            shares = len(self.step) * world_size
            self.reference = {n: float(t) / shares for n, t in zip(names, totals)}
        return {n: own[n] / r if r > 0 else 1.0 for n, r in self.reference.items()}


def with_step_counts(batches: Iterable[dict[str, object]], grad_accum: int,
                     count: Callable[[Mapping[str, torch.Tensor]], Counts]) -> Iterator[dict[str, object]]:
    """Host batches ``grad_accum`` at a time (one optimizer step), each holding under ``STEP_COUNTS`` its own counts
    and its step's ``StepCounts``, counted before the step's first forward as ``Trainer.get_batch_samples`` does."""
    host = iter(batches)
    while group := list(islice(host, grad_accum)):
        counts = [count(batch) for batch in group]  # type: ignore[arg-type]
        step = StepCounts(counts)
        for batch, own in zip(group, counts):
            batch[STEP_COUNTS] = (own, step)
            yield batch
