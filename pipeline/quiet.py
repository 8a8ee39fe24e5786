"""``--quiet``: a command that succeeds prints nothing but kdcache's own notes about the run (a cached target left
unused, a temperature chosen for you): no summary, no progress, and none of the lines of the libraries it drives.

kdcache's own output goes through ``print`` and tqdm, which write to whatever ``sys.stdout`` / ``sys.stderr`` are
when they run, so the command's work runs with stdout pointed at a sink and stderr at a filter that passes only
lines beginning ``kdcache `` (every stage's notes do). The libraries need more, because they bind their streams
early:

* transformers: its logging handler holds the real stderr from import time (``Loading weights`` bars, load
  reports), so its verbosity goes to error and its progress bars off;
* datasets: its ``Generating train split`` bars, off (the switch, or the environment variable for a first import);
* DeepSpeed: its logger writes to the stdout of its import and announces the accelerator at import, so a
  filter on the ``DeepSpeed`` logger, set before that import, lets only errors through; its
  ``... built successfully`` is a plain print, caught by the sink.

Errors still reach the terminal: ``cli.main`` prints them after the quiet block has restored the streams.
Everything set here is undone on the way out (the CLI is also called in-process, by tests and the sweep).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO

NOTE_PREFIX = "kdcache "  # how every note of kdcache's stages begins ("kdcache train: note: ...")
_BARS_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# KDCACHE_QUIET: our own progress lines (a log's stand-in for a bar) stay off, though they begin "kdcache ".
_ENV = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "KDCACHE_QUIET": "1",
        **_BARS_ENV}


class _Sink(io.TextIOBase):
    """A text stream that drops what it is given; never closed, so a handler bound to it stays harmless. Not a
    terminal (``TextIOBase.isatty``), so tqdm and our progress display draw nothing to it."""

    def write(self, text: str) -> int:
        return len(text)


_SINK = _Sink()


class _NotesOnly(io.TextIOBase):
    """stderr under --quiet: kdcache's own notes about the run (lines starting ``kdcache ``: cached targets left
    unused, the temperature a cache chose) reach ``target``; everything else (bars, library chatter) is dropped.
    Text is held until its line ends, since ``print`` and tqdm write a line in pieces."""

    def __init__(self, target: TextIO):
        super().__init__()
        self.target, self.line = target, ""

    def write(self, text: str) -> int:
        self.line += text
        *done, self.line = self.line.split("\n")
        for line in done:
            if line.startswith(NOTE_PREFIX):
                self.target.write(line + "\n")
        if self.line and not NOTE_PREFIX.startswith(self.line[:len(NOTE_PREFIX)]):
            self.line = self.line[:len(NOTE_PREFIX)]  # not a note: keep only what decides that (tqdm redraws)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


_DEEPSPEED = logging.getLogger("DeepSpeed")  # the name DeepSpeed's LoggerFactory gives its logger
_DEEPSPEED_FORMAT = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                      "%(message)s")


def _deepspeed_to_stderr(record: logging.LogRecord) -> bool:
    """A filter on DeepSpeed's logger: its records go to stderr, never to the stdout its own handler holds, and
    below ERROR only when stderr is a terminal (a log file keeps no accelerator banner). Returns False so that
    its handler never sees them."""
    if record.levelno >= logging.ERROR or sys.stderr.isatty():
        sys.stderr.write(_DEEPSPEED_FORMAT.format(record) + "\n")
    return False


@contextlib.contextmanager
def libraries_on_terminal() -> Iterator[None]:
    """Every command, quiet or not: the libraries' banners and progress bars go to stderr when it is a terminal,
    and nowhere otherwise; never to stdout, which holds kdcache's own lines (a summary, JSON) and nothing else."""
    with contextlib.ExitStack() as stack:
        if not sys.stderr.isatty():  # carriage-return bars make a log file unreadable
            stack.enter_context(_libraries(_BARS_ENV, verbosity=False))
        _DEEPSPEED.addFilter(_deepspeed_to_stderr)
        stack.callback(_DEEPSPEED.removeFilter, _deepspeed_to_stderr)
        yield


def is_quiet(value: object) -> bool:
    """Whether a ``--quiet`` value asks for quiet: the flag alone (True), or ``true`` / ``yes`` / ``1``."""
    return value is True or str(value).strip().lower() in ("true", "yes", "1", "on")


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """Run the block with kdcache and its libraries silent (a no-op when not ``enabled``)."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_libraries())
        _DEEPSPEED.addFilter(_errors_only)
        stack.callback(_DEEPSPEED.removeFilter, _errors_only)
        stack.enter_context(contextlib.redirect_stdout(_SINK))
        stack.enter_context(contextlib.redirect_stderr(_NotesOnly(sys.stderr)))
        yield


@contextlib.contextmanager
def _libraries(values: dict[str, str] = _ENV, verbosity: bool = True) -> Iterator[None]:
    """The libraries' progress bars off (with ``verbosity``, transformers' logs to errors) for the block: the
    environment ``values`` for a library first imported later, here or in a child process (transformers:
    ``HF_HUB_DISABLE_PROGRESS_BARS``), and transformers' and datasets' switches where already imported (the CLI's
    parser may import transformers). Their logging modules are looked up in ``sys.modules`` (each package loads its
    own on import), never imported: a switch acts on a library only where this process has loaded it already."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        with contextlib.ExitStack() as undo:
            for library in filter(None, map(sys.modules.get, ("transformers.utils.logging", "datasets.utils.logging"))):
                bars = library.is_progress_bar_enabled()
                library.disable_progress_bar()
                undo.callback(library.enable_progress_bar if bars else library.disable_progress_bar)
            hf_logging = sys.modules.get("transformers.utils.logging")
            if verbosity and hf_logging is not None:
                undo.callback(hf_logging.set_verbosity, hf_logging.get_verbosity())
                hf_logging.set_verbosity_error()
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
