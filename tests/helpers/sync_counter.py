"""Counting the host syncs that kdcache's own code makes inside a training micro-step: reads of device values,
and results whose size depends on them (``nonzero``, a boolean index)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from kdcache.stages.train import loop

REPO = Path(loop.__file__).resolve().parents[2]  # the checkout whose stages/ and pipeline/ are kdcache
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")  # every way a tensor's value reaches the host
# Syncs without a read: the result's size depends on the values, so the host waits for the device to count them.
SIZED = ("nonzero", "masked_select")


def _boolean_index(index: object) -> bool:
    """Whether a ``__getitem__`` index holds a bool tensor (``x[mask]``: a ``nonzero`` underneath)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


class SyncCounter:
    """Counts the host reads of tensor values made by kdcache's own code inside ``_Trainer._micro_step`` and
    ``_Trainer._prepare`` (the next batch's copy and decode), from the second micro-step on (the first runs the
    one-off checks of the student); records ``file:line`` of each.
    Only the step's own thread counts: the reader's threads make batches on the host meanwhile (no device there)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside, self.micro_steps, self.calls = False, 0, []  # type: ignore[var-annotated]
        self.thread = threading.get_ident()
        for name in (*SYNCS, *SIZED):
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        for name in SIZED:
            monkeypatch.setattr(torch, name, self._counting(getattr(torch, name)))
        getitem = torch.Tensor.__getitem__
        counted_getitem = self._counting(getitem)
        monkeypatch.setattr(torch.Tensor, "__getitem__", lambda tensor, index: counted_getitem(tensor, index)
                            if _boolean_index(index) else getitem(tensor, index))
        original, prepare = loop._Trainer._micro_step, loop._Trainer._prepare

        def micro_step(trainer: loop._Trainer, *args: object) -> bool:
            self.inside, self.thread = self.micro_steps > 0, threading.get_ident()
            try:
                return original(trainer, *args)  # type: ignore[arg-type]
            finally:
                self.inside, self.micro_steps = False, self.micro_steps + 1

        def prepared(trainer: loop._Trainer, batch: dict) -> dict:  # the next batch's copy and decode count too
            self.inside, self.thread = self.micro_steps > 0, threading.get_ident()
            try:
                return prepare(trainer, batch)
            finally:
                self.inside = False
        monkeypatch.setattr(loop._Trainer, "_micro_step", micro_step)
        monkeypatch.setattr(loop._Trainer, "_prepare", prepared)

    def _counting(self, method):  # type: ignore[no-untyped-def]
        def counted(tensor: torch.Tensor, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            if self.inside and threading.get_ident() == self.thread:
                caller = sys._getframe(1)
                if caller.f_code.co_name == "<lambda>" and caller.f_code.co_filename == __file__:
                    caller = caller.f_back  # the __getitem__ filter above
                path = Path(caller.f_code.co_filename)
                if path.is_relative_to(REPO) and path.parts[len(REPO.parts)] in ("stages", "pipeline", "storage"):
                    self.calls.append(f"{path.relative_to(REPO)}:{caller.f_lineno}")
            return method(tensor, *args, **kwargs)
        return counted
