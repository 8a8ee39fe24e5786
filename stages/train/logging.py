"""Run logs: per-term metrics as JSONL (RUN/metrics.jsonl), mirrored to trackers, sample traces, and the progress
on rank 0 (``TrainProgress``: a tqdm bar on a terminal, one line per logged step otherwise; ``--quiet`` turns it
off, metrics.jsonl is written either way).

Only rank 0 writes metrics (the values are already averaged over ranks by the loop). Sample traces
(``RUN/samples-rank{r}.jsonl``: which sequence ids each micro-step consumed) are written by every rank when
asked for; the resumption test compares them between an interrupted and an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

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
        self.rank, self.group = rank, group
        self.path = Path(run_dir) / file
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


# Logged values that are not loss terms: shown apart from the losses, by these words.
METRICS = {"aligned_share": "aligned share"}


def describe(values: Mapping[str, float], tokens_per_s: float, wait_share: float) -> str:
    """``loss 2.31 (ce 1.90, hidden 0.2, kl 0.41) | aligned share 0.92 | 5,120 tok/s | data wait 3%``: every
    whole loss term, by name, so each line shows the same ones in the same places."""
    # Whole terms only (ce, kl, hidden...): per-pair terms such as hidden/s1_t2 stay in metrics.jsonl.
    terms = [(k, v) for k, v in sorted(values.items()) if k != "loss" and "/" not in k and k not in METRICS]
    detail = f" ({', '.join(f'{k} {v:.3g}' for k, v in terms)})" if terms else ""
    loss = values.get("loss", float("nan"))
    metrics = "".join(f" | {words} {values[k]:.3g}" for k, words in METRICS.items() if k in values)
    return f"loss {loss:.4g}{detail}{metrics} | {tokens_per_s:,.0f} tok/s | data wait {wait_share:.0%}"


class TrainProgress:
    """Progress of one run. Call ``update(step, values, wait_share, tokens)`` per log.

    Args:
        total: optimizer steps this run ends at; ``start``: the step it starts from (a resumed run).
        enabled: False on ranks other than 0 and with ``--quiet``.
        stream: where to write (stderr, like stage one's bar).
    """

    def __init__(self, total: int, start: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self._since, self._began = time.perf_counter(), time.perf_counter()
        self._bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            width = shutil.get_terminal_size((120, 20)).columns or 120  # a pty without a size reports 0
            self._bar = tqdm(total=total, initial=start, unit="step", desc="kdcache train", file=self.stream,
                             ncols=width)

    def update(self, step: int, values: Mapping[str, float], wait_share: float, tokens: int) -> None:
        """Report the logged step: the bar moves, or a line is printed; ``tokens``: this rank's valid tokens since the
        last report."""
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = tokens / max(now - self._since, 1e-9)
        self._since = now
        text = describe(values, rate, wait_share)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        done = step - self.start
        left = (now - self._began) / max(done, 1) * (self.total - step)
        print(f"kdcache train: step {step}/{self.total} | {text} | eta {tqdm.format_interval(left)}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
