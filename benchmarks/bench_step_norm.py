"""The host cost of normalising every term by its optimizer step (``stages/train/objective/step_norm.py``).

Per micro-batch the loop counts each term's rows from the host batch's masks (``term_counts``), once per step it
sums the step's counts (``StepCounts.scales``). This times both for one micro-batch of ``--batch`` rows of
``--length`` tokens, packed with documents kept apart and a loss mask (the most masks a batch has), for a loss with
all four families (CE, KL, hidden, attention), best of ``--repeats``; and beside it the host work the loop already
did per batch before (its token count over the masks), for a ratio.

    python benchmarks/bench_step_norm.py --batch 8 --length 2048
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from kdcache.stages.common.option_groups import assemble
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.objective.compound import CompoundLoss
from kdcache.stages.train.objective.step_norm import StepCounts, term_counts


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def host_batch(batch: int, length: int) -> dict[str, torch.Tensor]:
    """Rows of ``length`` tokens, ragged at the end, packed from documents of 300 tokens, every other one trained."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    position_ids = torch.arange(length).repeat(batch, 1) % 300
    loss_mask = ((torch.arange(length) // 300) % 2).repeat(batch, 1) * mask
    return {"mask": mask, "loss_mask": loss_mask, "position_ids": position_ids}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    options = assemble(LossOptions, {"alpha": 1.0, "beta": 1.0, "gamma": 1.0, "delta": 1.0, "temperature": 1.0})
    part = CompoundLoss(options, layer_map=[(1, 1)], student_dim=16, teacher_dim=16)
    loss = SimpleNamespace(streams=[""], cross_pairs=[], part=lambda _: part)  # the run's loss, as counts read it
    batch = host_batch(args.batch, args.length)
    counts = term_counts(loss, batch)
    count_s = best_of(lambda: term_counts(loss, batch), args.repeats)
    scales_s = best_of(lambda: StepCounts([counts, counts]).scales(counts, 1), args.repeats)
    tokens_s = best_of(lambda: int(batch["mask"].numpy().sum()), args.repeats)
    print(f"batch {args.batch} x {args.length}: term_counts {count_s * 1e6:,.0f} us, scales {scales_s * 1e6:,.1f} us, "
          f"the loop's token count {tokens_s * 1e6:,.0f} us; ratio {count_s / tokens_s:.1f}x")


if __name__ == "__main__":
    main()
