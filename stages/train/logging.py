"""Run logs: per-term metrics as JSONL (RUN/metrics.jsonl), mirrored to trackers, and sample traces.

Only rank 0 writes metrics (the values are already averaged over ranks by the loop). Sample traces
(``RUN/samples-rank{r}.jsonl``: which sequence ids each micro-step consumed) are written by every rank when
asked for; the resumption test compares them between an interrupted and an uninterrupted run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepspeed.monitor.monitor import MonitorMaster


class MetricsLogger:
    """Appends one JSON object per logged step, and hands the scalars to DeepSpeed's monitor (the trackers
    ``--report-to`` enabled: TensorBoard, W&B, CSV), which writes and flushes them on rank 0.

    Appending (never truncating) keeps a resumed run's log continuous with the interrupted one. The JSONL stays
    the source of ``kdcache report``.
    """

    def __init__(self, run_dir: str | Path, *, rank: int = 0, monitor: MonitorMaster | None = None,
                 file: str = "metrics.jsonl", group: str = "train"):
        """``file`` under ``run_dir`` and the trackers' ``group/`` of the tags: a held-out cache's scores go to
        ``eval.jsonl`` and ``eval/``, apart from the training log that ``kdcache report`` reads."""
        self.run_dir = Path(run_dir)
        self.rank, self.group = rank, group
        self.path = self.run_dir / file
        self._monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self._start = time.perf_counter()

    def log(self, step: int, values: dict[str, float], **extra: object) -> None:
        """Write ``{"step": step, "time_s": ..., **values, **extra}`` (rank 0 only)."""
        if self.rank != 0:
            return
        record = {"step": step, "time_s": round(time.perf_counter() - self._start, 4), **values, **extra}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._monitor is not None:
            scalars = {**values, **{k: v for k, v in extra.items() if isinstance(v, (int, float))}}
            self._monitor.write_events([(f"{self.group}/{name}", float(value), step)
                                        for name, value in scalars.items()])


class SampleTrace:
    """Per-rank record of the sequence ids of each micro-step, for checking exact resumption."""

    def __init__(self, run_dir: str | Path, rank: int, enabled: bool):
        self.path = Path(run_dir) / f"samples-rank{rank}.jsonl"
        self.enabled = enabled

    def record(self, micro_step: int, epoch: int, step_in_epoch: int, sample_ids: list[int], loss: float) -> None:
        """Append one micro-step; the loop calls it only when ``enabled`` (the loss read costs a sync)."""
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"micro_step": micro_step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                 "sample_ids": sample_ids, "loss": loss}) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file written by this module (empty list if it does not exist); see ``read_records``."""
    return read_records(path)[0]


def read_records(path: str | Path) -> tuple[list[Any], int]:
    """Every line of a JSONL file that parses, and how many did not.

    A run still writing (or killed mid-write) may leave a truncated last line; it is counted, not an error.
    """
    p = Path(path)
    if not p.is_file():
        return [], 0
    records, skipped = [], 0
    for line in p.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            skipped += 1
    return records, skipped

