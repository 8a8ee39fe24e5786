"""Training progress on rank 0: a tqdm bar on a terminal, one line per logged step otherwise (batch logs).

Each update shows step / total, the loss and its terms, tokens per second, the share of time spent
waiting for data, and the time left. ``--quiet`` turns it off; metrics.jsonl is written either way.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from tqdm import tqdm

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
    """Progress of one run. Call ``tokens(n)`` per micro-step and ``update(step, values, wait_share)`` per log.

    Args:
        total: optimizer steps this run ends at; ``start``: the step it starts from (a resumed run).
        enabled: False on ranks other than 0 and with ``--quiet``.
        stream: where to write (stderr, like stage one's bar).
    """

    def __init__(self, total: int, start: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self._tokens, self._since, self._began = 0, time.perf_counter(), time.perf_counter()
        self._bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            width = shutil.get_terminal_size((120, 20)).columns or 120  # a pty without a size reports 0
            self._bar = tqdm(total=total, initial=start, unit="step", desc="kdcache train", file=self.stream,
                             ncols=width)

    def tokens(self, count: int) -> None:
        """Count the valid tokens of one micro-step (this rank's)."""
        self._tokens += count

    def update(self, step: int, values: Mapping[str, float], wait_share: float) -> None:
        """Report the logged step: the bar moves, or a line is printed."""
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = self._tokens / max(now - self._since, 1e-9)
        self._tokens, self._since = 0, now
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
