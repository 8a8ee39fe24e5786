"""Does the host path let the device's thread run? The GIL held by kdcache's writer and reader threads, measured.

In a GPU run one Python thread feeds the device: every kernel launch of the teacher's forward (stage one) or of
the student's step (stage two) needs the GIL. Threads that hold it for milliseconds at a time (a checksum, a
``bytes.join`` of a 67 MB file) leave the device idle meanwhile, although the host has cores to spare. This
benchmark measures that on any machine:

* a *launcher* thread runs tiny torch ops back to back (each needs the GIL, as a launch does), pinned to core 0;
* the host path runs on the other cores (``os.sched_setaffinity``), so a slowdown of the launcher is the GIL,
  not a shared core:
  - ``write``: stage one's writers (``BackgroundWriter`` over ``CacheWriter.write_shard``, as ``commit_behind``
    runs them) committing shards of 8 x 2,048 tokens with four fp16 hidden layers of width 2,048;
  - ``write_topk``: the same shards with top-128 logits (ids and log-probs) beside the hidden layers;
  - ``read``: stage two's ``CacheStream`` decoding that cache into micro-batches of 4;
  - ``stage_one``: the whole of ``kdcache precompute`` (four fp16 layers, rows of 2,048 tokens, batches of 8, the
    helper thread, the writers) over a Llama of width 2,048 whose decoder layers are replaced by the launcher:
    each batch's forward is ``--launch-seconds`` of tiny ops on core 0 (every other thread is moved to the other
    cores at each batch). Reported: the launches' stall share and longest stall, alone as long right after, and
    the run's compute and forward phases beside the launches' own time.

Reported per mode, as medians of ``--rounds`` rounds (the launcher beside the host path, then alone): the share of
the time the launcher spent in ops over 1 ms (``stall_share``; alone: the machine's own noise), the longest op,
launches/s against alone, and the host work done meanwhile.

Run on the code that is installed, so the same script measures a tree before and after a change:
``.venv/bin/python benchmarks/bench_gil.py [--seconds 4] [--writers 1] [--json FILE]`` (needs 2+ cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks, tests.helpers; the installed kdcache wins

from benchmarks.bench_host_path import StubLayers, make_teacher, pin_threads, write_data  # noqa: E402
from kdcache.stages.precompute.commit import BackgroundWriter  # noqa: E402
from kdcache.stages.train.feed.streaming import CacheStream  # noqa: E402
from kdcache.storage import CacheSpec, CacheWriter  # noqa: E402

LAYERS, TOP_K = (1, 2, 3, 4), 128
SHAPE = {"tokens": 2048, "rows": 8, "width": 2048}  # per sequence, sequences per shard, hidden width
SMALL = {"tokens": 64, "rows": 2, "width": 64}  # --small: the same code in seconds, for the test


def shard_items(topk: bool) -> list[dict[str, np.ndarray]]:
    """One shard's sequences as stage one hands them: fp16 hidden rows (checked finite on the device), ids,
    and with ``topk`` the top-128 ids and log-probabilities."""
    tokens, rows, width = SHAPE["tokens"], SHAPE["rows"], SHAPE["width"]
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((rows * tokens, width), dtype=np.float32).astype(np.float16)
    items = []
    for i in range(rows):
        part = slice(i * tokens, (i + 1) * tokens)
        item = {"input_ids": rng.integers(0, 32_000, tokens), **{f"hidden/{j}": hidden[part] for j in LAYERS}}
        if topk:
            logp = -np.sort(rng.exponential(2.0, (tokens, TOP_K)).astype(np.float32), axis=1)
            ids = rng.integers(0, 32_000 - TOP_K, (tokens, 1)) + np.arange(TOP_K)  # distinct per token
            item.update({"logits/topk_ids": ids, "logits/topk_values": logp})
        items.append(item)
    return items


def spec_for(shards: int, topk: bool) -> CacheSpec:
    extra: dict[str, Any] = {"logits": "topk", "top_k": TOP_K, "topk_values": "logprob", "logprob_step": 2 ** -10,
                             "vocab_size": 32_000} if topk else {"logits": None}
    return CacheSpec(num_sequences=shards * SHAPE["rows"], hidden_layers=LAYERS, sequences_per_shard=SHAPE["rows"],
                     dtype="fp16",
                     **extra)


def launcher(seconds: float, op: Callable[[], object] | None = None) -> tuple[float, np.ndarray]:
    """Tiny torch ops (or ``op``) back to back for ``seconds``: (the seconds the loop took, each op's duration).

    The last op starts before ``seconds`` are up and may end well after (a stall in it), so the time taken, not
    ``seconds``, is what holds every op: a share or a rate over ``seconds`` could pass 1 or overstate the rate.
    """
    x = torch.zeros(64)
    op = op or (lambda: x.add_(1.0))
    durations = []
    start = time.perf_counter()
    end = start + seconds
    while (now := time.perf_counter()) < end:
        op()
        durations.append(time.perf_counter() - now)
    return time.perf_counter() - start, np.array(durations)


def on_host_cores(work: Callable[[threading.Event], None],
                  cores: set[int]) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    """Start ``work(stop)`` in a thread pinned (with every thread it starts) to ``cores``; its error, if any,
    lands in the returned list."""
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            work(stop)
        except BaseException as exc:  # noqa: BLE001 - re-raised by measure
            errors.append(exc)

    os.sched_setaffinity(0, cores)  # threads inherit their creator's cores
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    os.sched_setaffinity(0, {0})
    return thread, stop, errors


def write_work(root: Path, topk: bool, writers: int, done: list[int]) -> Callable[[threading.Event], None]:
    """Commit shards until stopped, each run into a fresh cache folder under ``root``."""
    items, runs = shard_items(topk), iter(range(1 << 30))

    def work(stop: threading.Event) -> None:
        folder = root / f"run-{next(runs)}"
        with CacheWriter(folder, spec_for(10_000, topk), {}) as writer:
            background = BackgroundWriter(
                lambda index, seqs: writer.write_shard(index, seqs, finite=frozenset(f"hidden/{j}" for j in LAYERS)),
                queue_size=2, workers=writers, on_written=lambda *_: done.append(SHAPE["rows"] * SHAPE["tokens"]))
            k = 0
            while not stop.is_set():
                background.submit(k, items)
                k += 1
            background.close()
        shutil.rmtree(folder, ignore_errors=True)
    return work


def read_work(cache: Path, threads: int, done: list[int]) -> Callable[[threading.Event], None]:
    def work(stop: threading.Event) -> None:
        names = ["input_ids", *(f"hidden/{j}" for j in LAYERS)]
        while not stop.is_set():
            stream = CacheStream(cache, names, batch_size=4, epochs=1, decode_threads=threads)
            for batch in stream:
                done.append(int(batch["mask"].sum()))
                if stop.is_set():
                    break
    return work


def stalls(spans: np.ndarray, seconds: float) -> dict[str, float]:
    """The launcher's rate, its longest op and the share of the time spent in ops over 1 ms (GIL waits, or the
    machine's own noise: measured alone too), over the ``seconds`` that hold every span (at most 1 then)."""
    return {"launches_per_s": len(spans) / seconds, "longest_stall_ms": 1e3 * float(spans.max()),
            "stall_share": float(spans[spans > 1e-3].sum()) / seconds}


def launch_stalls(seconds: float, op: Callable[[], object] | None = None) -> dict[str, float]:
    """``stalls`` of the launcher run for ``seconds``, over the time its loop took."""
    taken, spans = launcher(seconds, op)
    return stalls(spans, taken)


def launch_beside(seconds: float, done: list[int], limit: float = 120.0) -> tuple[float, np.ndarray]:
    """``launcher`` for ``seconds``, then again for ``seconds`` at a time while the host path has finished no unit
    of work since the start (``done`` unchanged), up to ``limit`` seconds in all: (the seconds taken, every span).

    A short window on a loaded machine can close before the host path's first shard or batch lands, and a rate of
    0 tokens/s then says nothing about the host path; the longer window is taken only when none completed, so a
    quiet run measures exactly ``seconds``."""
    first = len(done)
    taken, spans = launcher(seconds)
    while len(done) == first and taken < limit:
        more, extra = launcher(seconds)
        taken, spans = taken + more, np.concatenate([spans, extra])
    return taken, spans


def measure(work: Callable[[threading.Event], None], seconds: float, rounds: int, done: list[int],
            cores: set[int]) -> dict[str, Any]:
    """``rounds`` times: the launcher beside the host path (for at least ``seconds``, longer only until the host
    path finishes a unit), then alone right after (the machine's noise drifts); the medians of each side, and the
    host path's rate over all the time it ran beside the launcher."""
    during, alone, tokens, taken = [], [], 0, 0.0
    for _ in range(rounds):
        thread, stop, errors = on_host_cores(work, cores)
        time.sleep(0.5)  # the host path in its steady state
        first = len(done)
        took, spans = launch_beside(seconds, done)
        during.append(stalls(spans, took))
        tokens, taken = tokens + sum(done[first:]), taken + took
        stop.set()
        thread.join()
        if errors:
            raise errors[0]
        alone.append(launch_stalls(seconds))
    med = {side: {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
           for side, runs in (("during", during), ("alone", alone))}
    return {"launches_vs_alone": round(med["during"]["launches_per_s"] / med["alone"]["launches_per_s"], 3),
            "stall_share": round(med["during"]["stall_share"], 4),
            "stall_share_alone": round(med["alone"]["stall_share"], 4),
            "longest_stall_ms": round(med["during"]["longest_stall_ms"], 2),
            "longest_stall_alone_ms": round(med["alone"]["longest_stall_ms"], 2),
            "host_tokens_per_s": round(tokens / taken)}


class LaunchLayers(StubLayers):
    """``StubLayers`` whose device time is ``ops`` tiny torch ops on core 0, each timed (a forward as a GPU's
    launching thread sees it), after moving every other thread to ``cores``."""

    def __init__(self, ops: int, cores: set[int]) -> None:
        super().__init__()
        self.ops, self.cores, self.spans = ops, cores, []  # type: ignore[var-annotated]

    def device_time(self) -> None:
        pin_threads(self.cores, skip=threading.get_native_id())
        x = torch.zeros(64)
        for _ in range(self.ops):
            now = time.perf_counter()
            x.add_(1.0)
            self.spans.append(time.perf_counter() - now)


def stage_one(root: Path, rows: int, launch_seconds: float, writers: int, cores: set[int]) -> dict[str, Any]:
    """``kdcache precompute`` with the launcher as its teacher's forward; its slowdown, and the run's."""
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.runner import run_precompute

    width, tokens = SHAPE["width"], SHAPE["tokens"]
    teacher, data = make_teacher(root, width, positions=tokens), write_data(root, rows)
    taken, spans = launcher(1.0)
    ops = int(len(spans) / taken * launch_seconds)
    options = PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(root / "cache"), layers=tuple(
        str(j) for j in LAYERS), features=("hidden",), packing="concat", max_length=tokens, batch_size=SHAPE["rows"],
        sequences_per_shard=SHAPE["rows"], max_sequences=rows, teacher_dtype="fp32", progress=False, writers=writers)
    with LaunchLayers(ops, cores) as stub:
        summary = run_precompute(options)
    spans = np.array(stub.spans)
    during = stalls(spans, float(spans.sum()))
    alone = launch_stalls(float(spans.sum()))  # as long, right after
    return {"batches": stub.batches, "stall_share": round(during["stall_share"], 4),
            "stall_share_alone": round(alone["stall_share"], 4), "longest_stall_ms": round(during["longest_stall_ms"], 2),
            "launches_s": round(float(spans.sum()), 3), "compute_s": round(summary["compute_seconds"], 3),
            "forward_s": round(summary["forward_seconds"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="launcher time per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writers", type=int, default=1, help="writer threads, and the reader's decode threads")
    parser.add_argument("--modes", default="write,write_topk,read,stage_one")
    parser.add_argument("--rows", type=int, default=48, help="stage_one: rows of 2,048 tokens (batches of 8)")
    parser.add_argument("--launch-seconds", type=float, default=2.5, help="stage_one: the launcher's time per batch")
    parser.add_argument("--small", action="store_true", help="tiny shards: checks the code, measures nothing")
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (seconds) for the run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.small:
        SHAPE.update(SMALL)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    host_cores = set(os.sched_getaffinity(0)) - {0}
    if not host_cores:
        parser.error("needs at least 2 cores: core 0 for the launcher, the rest for the host path")
    torch.set_num_threads(1)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    launcher(1.0)  # warm-up
    results: dict[str, Any] = {"writers": args.writers, "switch_interval": sys.getswitchinterval()}
    root = Path(tempfile.mkdtemp(prefix="kdcache-gil-"))
    try:
        for mode in args.modes.split(","):
            done: list[int] = []
            if mode == "stage_one":
                results[mode] = stage_one(root / mode, args.rows, args.launch_seconds, args.writers, host_cores)
                print(mode, json.dumps(results[mode]), flush=True)
                continue
            if mode == "read":
                cache = root / "read"
                with CacheWriter(cache, spec_for(4, False), {}) as writer:
                    for k in range(4):
                        writer.write_shard(k, shard_items(False))
                    writer.finalize()
                work = read_work(cache, args.writers, done)
            else:
                work = write_work(root / mode, mode == "write_topk", args.writers, done)
            results[mode] = measure(work, args.seconds, args.rounds, done, host_cores)
            shutil.rmtree(root / mode, ignore_errors=True)
            print(mode, json.dumps(results[mode]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sched_setaffinity(0, cores)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
