"""Shards encoded, checksummed and committed in worker processes (``--writer-processes``), so that none of the host
work after the teacher's forward holds the teacher process's GIL.

The teacher's process copies each shard's arrays once into a block of shared memory and releases the reused
buffers they were views of; a worker process maps the block, commits the shard through the same code a writer
thread runs (``storage.ShardCommitter``: encode, pack, put the files, the sidecar last), and answers with the
shard's record. The part's lock, the manifest and the run's statistics stay with the teacher's process.

What a thread pool did, this does too: at most ``queue_size`` shards wait beside one in each worker's hands, an
error in a worker is raised at the next ``submit`` or at ``close``, and ``close`` waits for every queued shard
(Ctrl-C included: the workers ignore SIGINT, and the teacher's process decides). A worker that dies (kill -9,
out of memory) is an error that names it: its shard was not committed, every committed one stays, and the same
command resumes.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait as ready
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.storage import ShardRecord, format_bytes

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

    from kdcache.storage import CacheSpec

# Set in a worker's environment: what tells a writer process from the process's other children (a monitoring
# script, a test that kills one).
WORKER_MARK = "KDCACHE_SHARD_WRITER"
Layout = list[tuple[int, str, str, tuple[int, ...], int]]  # (sequence, array name, dtype, shape, byte offset)


def pack(items: list[dict[str, np.ndarray]]) -> tuple[SharedMemory, Layout]:
    """One shard's arrays copied once into a new shared-memory block, and where each one lies in it."""
    layout: Layout = []
    offset = 0
    for i, item in enumerate(items):
        for name, array in item.items():
            layout.append((i, name, array.dtype.str, tuple(array.shape), offset))
            offset += -(-array.nbytes // 64) * 64  # 64-byte aligned: each view starts on a cache line
    block = SharedMemory(create=True, size=max(offset, 1))
    try:
        _claim(block, offset)
        for i, name, dtype, shape, start in layout:
            np.copyto(np.ndarray(shape, dtype, buffer=block.buf, offset=start), items[i][name])
    except BaseException:  # Ctrl-C in the copy included: the block is nobody's yet
        _free(block)
        raise
    return block, layout


def _claim(block: SharedMemory, size: int) -> None:
    """Claim the block's pages now: a tmpfs claims them only when written, and a write past a full one kills the
    process with SIGBUS instead of raising (ranks on one host share /dev/shm, so free space checked before is no
    guarantee)."""
    fd = getattr(block, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate") or size == 0:  # not POSIX shared memory: nothing to claim
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise PrecomputeError(f"--writer-processes: a shard needs {format_bytes(size)} of shared memory, and "
                              f"/dev/shm cannot hold it ({exc.strerror}); give it more (a container's --shm-size), "
                              "lower --sequences-per-shard, or write in threads (without --writer-processes)"
                              ) from None


def _free(block: SharedMemory) -> None:
    """Close and remove a block (its name first: a block whose close fails is still not left behind)."""
    try:
        block.unlink()
    finally:
        block.close()


def unpack(block: SharedMemory, layout: Layout, count: int) -> list[dict[str, np.ndarray]]:
    """The shard's sequences as views of ``block`` (``pack``'s inverse; nothing is copied)."""
    items: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for i, name, dtype, shape, start in layout:
        items[i][name] = np.ndarray(shape, dtype, buffer=block.buf, offset=start)
    return items


def _serve(url: str, spec: dict[str, Any], modules: list[str], tasks: Connection, results: Connection,
           stop: Event) -> None:
    """A worker: commit each shard handed over until ``None`` (or, once ``stop`` is set, pass them by); answer each
    with its record or its error. ``modules`` register what the spec names beyond the built-in kinds (a codec of
    the user's own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the teacher process's to handle
    try:  # storage loads inside the try, so that a worker that cannot load it answers with the error
        from kdcache.storage import CacheSpec, ShardCommitter, open_store  # order: inside the try (above)

        for module in modules:
            importlib.import_module(module)
        committer = ShardCommitter(open_store(url), CacheSpec.from_dict(spec))
    except BaseException as exc:  # noqa: BLE001 - the parent names it
        results.send(("error", -1, _portable(exc), 0.0))
        return
    while (task := tasks.recv()) is not None:
        index, name, layout, count, finite = task
        if stop.is_set():  # after an error, as the writer threads do: nothing more is written
            results.send(("skipped", index, None, 0.0))
            continue
        block = SharedMemory(name=name)
        started = time.perf_counter()
        try:
            items = unpack(block, layout, count)
            record = committer.write_shard(index, items, finite=finite)
            results.send(("done", index, asdict(record), time.perf_counter() - started))
        except BaseException as exc:  # noqa: BLE001 - handed to the teacher's process
            results.send(("error", index, _portable(exc), 0.0))
        finally:
            items = []
            block.close()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (storage's errors do), else a PrecomputeError with its words."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return PrecomputeError(f"{type(exc).__name__}: {exc}")


@dataclass
class _Worker:
    """One writer process and its two pipes (a pipe each, so that a worker killed while it waits or answers holds
    no lock another worker needs)."""

    process: BaseProcess
    tasks: Connection
    results: Connection
    pending: set[int] = field(default_factory=set)


class ProcessWriter:
    """``BackgroundWriter``'s contract (``submit``, ``close``, ``on_written``, called in this process) with
    ``workers`` worker processes, each of which opens its own store at ``url`` (``Store.url``) and reads the
    ``spec`` back from ``to_dict``'s JSON form; ``queue_size`` shards may wait beside one in each worker's hands."""

    def __init__(self, url: str, spec: CacheSpec, queue_size: int = 2,
                 on_written: Callable[[int, Any, float], None] | None = None, workers: int = 1) -> None:
        self._on_written = on_written
        self._limit = max(1, queue_size) + max(1, workers)
        self._blocks: dict[int, SharedMemory] = {}  # shards handed over and not yet answered
        self._error: BaseException | None = None
        self._reported = False
        context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA state
        self._stop_flag = context.Event()
        # The hidden codec's module where it is not one of kdcache's own: a codec registered by the user's module
        # exists in a spawned process only once that module is imported.
        module = type(spec.hidden_codec).__module__
        modules = [] if module.startswith("kdcache.") else [module]
        self._workers = []
        resource_tracker.ensure_running()  # started now, so that it does not carry the writers' mark
        os.environ[WORKER_MARK] = "1"  # a spawned process starts with this process's environment
        try:
            for i in range(max(1, workers)):
                task_out, task_in = context.Pipe(duplex=False)
                result_out, result_in = context.Pipe(duplex=False)
                process = context.Process(target=_serve, args=(url, spec.to_dict(), modules, task_out, result_in,
                                                               self._stop_flag),
                                          daemon=True, name=f"kdcache-shard-writer-{i}")
                process.start()
                task_out.close()  # the child's ends
                result_in.close()
                self._workers.append(_Worker(process, task_in, result_out))
        finally:
            del os.environ[WORKER_MARK]

    def submit(self, index: int, items: list[dict[str, np.ndarray]]) -> None:
        """Hand shard ``index`` to the least busy worker (blocks while ``queue_size`` shards wait); raises an
        earlier error."""
        self._collect()
        while len(self._blocks) >= self._limit and self._error is None:
            self._collect(wait=0.2)
        self._raise_pending()
        block, layout = pack(list(items))
        if hasattr(items, "release"):
            items.release()  # copied: the buffers go back to the next batches now, not after the commit
        worker = min(self._workers, key=lambda w: len(w.pending))
        try:
            worker.tasks.send((index, block.name, layout, len(items), frozenset(getattr(items, "finite", ()))))
        except BaseException:  # not handed over (a broken pipe, Ctrl-C): no answer will come for it
            _free(block)
            raise
        self._blocks[index] = block
        worker.pending.add(index)

    def close(self) -> None:
        """Wait for every handed-over shard to be answered, stop the workers, and raise the first error."""
        try:
            while self._blocks and self._error is None:
                self._collect(wait=0.2)
        finally:
            self._stop()
        self._raise_pending()

    def _collect(self, wait: float = 0.0) -> None:
        """Take every answer in (waiting up to ``wait`` s for one); a worker that ended is an error."""
        readers: dict[Any, _Worker] = {w.process.sentinel: w for w in self._workers}
        readers |= {w.results: w for w in self._workers if not w.results.closed}
        for source in ready(list(readers), timeout=wait):
            worker = readers[source]
            while not worker.results.closed and worker.results.poll():
                try:
                    self._answered(worker, *worker.results.recv())
                except EOFError:  # the worker is gone (its pipe closes before its exit code is known)
                    worker.results.close()
                    worker.process.join(timeout=5)
            if (worker.results.closed or worker.process.exitcode is not None) and self._error is None:
                self._error = PrecomputeError(_death(worker.process, sorted(worker.pending)))

    def _answered(self, worker: _Worker, kind: str, index: int, payload: Any, seconds: float) -> None:
        worker.pending.discard(index)
        block = self._blocks.pop(index, None)
        if block is not None:
            _free(block)
        if kind == "error" and index < 0:  # the worker could not start
            payload = PrecomputeError(f"--writer-processes: a writer process could not start ({payload}); a hidden "
                                      "codec of your own must register itself when its module is imported (each "
                                      "writer imports it anew), or write in threads (without --writer-processes)")
        if kind == "error":
            self._error = self._error or payload
        elif kind == "done" and self._on_written is not None and self._error is None:  # "skipped": nothing
            self._on_written(index, ShardRecord.from_dict(payload), seconds)

    def _stop(self) -> None:
        """Stop the workers (each finishes the shard in its hands; after an error none starts another), and free
        the blocks no answer came for, whatever interrupts the wait."""
        if self._error is not None:
            self._stop_flag.set()
        try:
            for worker in self._workers:
                if worker.process.exitcode is None:
                    try:
                        worker.tasks.send(None)
                    except OSError:  # its pipe broke: it is ending anyway
                        pass
            for worker in self._workers:
                worker.process.join(timeout=60)
        finally:
            for worker in self._workers:
                if worker.process.exitcode is None:
                    worker.process.terminate()
                    worker.process.join()
                worker.tasks.close()
                if not worker.results.closed:
                    worker.results.close()
            for block in self._blocks.values():
                _free(block)
            self._blocks.clear()

    def _raise_pending(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True  # raise once; a close() in a finally block must not mask it
            raise self._error


def _death(worker: BaseProcess, pending: list[int]) -> str:
    """What to tell the user of a writer process that died."""
    code = worker.exitcode
    try:
        name = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
    except ValueError:  # a signal without a name (a real-time one)
        name = ""
    how = (f"was killed by signal {-code}{name}" if code is not None and code < 0 else
           f"exited with code {code}" if code is not None else "closed its pipe")
    shards = f"shard(s) {', '.join(map(str, pending))} not committed" if pending else "no shard was in its hands"
    return (f"writer process {worker.pid} {how} ({shards}); every committed shard is kept: rerun the same command "
            f"to resume the cache")
