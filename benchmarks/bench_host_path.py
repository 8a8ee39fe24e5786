"""Stage one's host path alone: what kdcache's own code costs per token and layer, with the teacher stubbed out.

A Llama-shaped teacher of width d (2,048 or 4,096) whose decoder layers are replaced by a stub that returns a
fixed random activation ``[B, L, d]`` at once, with the device's time modelled as a GPU's: each batch's forward
queues a chosen time on a device clock, batches run one after another there, and the host waits for one only
where stage one waits for a GPU, at the end of the copy to the host (``HostBatch.wait``). Everything else is the
real stage one: hooks, the gather of valid tokens, the copy to the host, encoding, checks, compression, the commit
protocol with fsync. Rows of 2,048 tokens (``--packing concat``) in shards of 8, four cached hidden layers in fp16.

It reports, per width:

* host CPU-seconds per token-layer (the process's CPU time over the compute phase, stub time 0, divided by
  tokens x cached layers), and the wall time with the host's work on 1 and on 2 cores (the process's threads
  pinned; the writers are ``--writers``' default): how the host's work spreads over cores;
* with the stub slower than the host's work (1.5x the host's wall time per batch), the wall time against the
  stub's total: overlap means the host's work hides behind the device's.

Run: ``.venv/bin/python benchmarks/bench_host_path.py [--rows 64] [--repeats 3] [--widths 2048,4096]``. It runs
on the code that is installed, so the same script measures the tree before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.helpers (appended: the installed kdcache wins)

import torch  # noqa: E402

from kdcache.stages.precompute import runner  # noqa: E402
from kdcache.stages.precompute.core.options import PrecomputeOptions  # noqa: E402
from kdcache.stages.precompute.runner import run_precompute  # noqa: E402

LAYERS = 4
ROW = 2048


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StubLayers:
    """Replaces ``LlamaDecoderLayer.forward`` by a fixed activation, while active, and the device's time by a clock.

    A GPU's forward returns to the host at once; the host waits for the device only when it needs the results. So
    the stub's forward adds ``sleep`` seconds to a device clock (batches queue one after another) and returns, and
    each batch's ``HostBatch.wait`` sleeps until the clock said that batch was done. (A stub that slept in the
    forward kept the launching thread from queueing the next batches, which handed every shard to the writers two
    batches late: no GPU does that.) ``device_time`` is where the device's time goes; a subclass may spend it
    otherwise (``bench_gil.LaunchLayers`` launches tiny ops on the calling thread).

    The rest of the device's work is kept off the host as far as it can be: the layers' activations are float16,
    as a half-precision teacher's are on a GPU (no fp32 -> fp16 conversion per cached layer), and the final
    RMSNorm passes its input through (in float32 on one core it took 0.9 s a batch, more than all the host's work).
    What remains of the device's on the host is the embedding lookup and the range check's ``aminmax``.
    """

    def __init__(self) -> None:
        from transformers.models.llama import modeling_llama

        from kdcache.stages.precompute.capture import transfer

        self.cls, self.norm, self.transfer = modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaRMSNorm, transfer
        self.originals = (self.cls.forward, self.norm.forward, transfer.HostCopier.start, transfer.HostBatch.wait)
        self.sleep = 0.0
        self.batches = 0
        self.clock = 0.0  # when the device is done with every batch queued so far (perf_counter seconds)
        self._fixed: dict[tuple[int, ...], torch.Tensor] = {}

    def __enter__(self) -> StubLayers:
        stub = self
        _, _, start_0, wait_0 = self.originals

        def forward(layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if layer.self_attn.layer_idx == 0:
                stub.batches += 1
                stub.device_time()
            key = tuple(hidden_states.shape)
            if key not in stub._fixed:
                generator = torch.Generator().manual_seed(len(stub._fixed))
                stub._fixed[key] = torch.randn(key, generator=generator).to(torch.float16)
            return stub._fixed[key]

        def norm(module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

        def start(copier: Any, *args: Any, **kwargs: Any) -> Any:
            batch = start_0(copier, *args, **kwargs)
            batch.stub_done = stub.clock  # the batch just launched is the last one on the clock
            return batch

        def wait(batch: Any) -> None:
            time.sleep(max(0.0, getattr(batch, "stub_done", 0.0) - time.perf_counter()))
            batch.stub_done = 0.0
            wait_0(batch)

        self._patch(forward, norm, start, wait)
        return self

    def _patch(self, forward: Any, norm: Any, start: Any, wait: Any) -> None:
        self.cls.forward, self.norm.forward = forward, norm
        self.transfer.HostCopier.start, self.transfer.HostBatch.wait = start, wait

    def device_time(self) -> None:
        """Queue one batch's device time on the clock; the host is free meanwhile."""
        self.clock = max(self.clock, time.perf_counter()) + self.sleep

    def __exit__(self, *exc: object) -> None:
        self._patch(*self.originals)


def make_teacher(root: Path, width: int, positions: int = ROW) -> Path:
    """A 4-layer Llama of width ``width`` (one kv head, a tiny MLP: its weights are never used)."""
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(root / f"llama-{width}", layers=LAYERS, hidden=width, heads=16, kv_heads=1,
                           intermediate=16, positions=positions)


def write_data(root: Path, rows: int) -> Path:
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    texts = sample_texts(rows * 300, seed=1)  # >= 7 tokens each: enough for ``rows`` packed rows of 2,048
    return write_text_dataset(root / "data.jsonl", texts)


def run_once(teacher: Path, data: Path, out: Path, stub: StubLayers, sleep: float, cores: int,
             rows: int) -> dict[str, Any]:
    """One precompute with its threads on the first ``cores`` cores; the compute phase's wall time and CPU time,
    and the stub's total device time."""
    options = PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(out), layers=tuple(
        str(j) for j in range(1, LAYERS + 1)), features=("hidden",), packing="concat", max_length=ROW,
        batch_size=8, sequences_per_shard=8, max_sequences=rows, teacher_dtype="fp32", progress=False)
    measured: dict[str, float] = {}
    original = runner.commit_behind

    def timed(*args: Any, **kwargs: Any) -> None:
        cpu, wall = cpu_seconds(), time.perf_counter()
        try:
            original(*args, **kwargs)
        finally:
            measured.update(cpu=cpu_seconds() - cpu, wall=time.perf_counter() - wall)

    stub.sleep, stub.batches = sleep, 0
    runner.commit_behind = timed
    every = os.sched_getaffinity(0)
    pin_threads(set(sorted(every)[:cores]))  # every thread there is; those the run starts inherit it
    try:
        summary = run_precompute(options)
    finally:
        pin_threads(every)
        runner.commit_behind = original
        shutil.rmtree(out, ignore_errors=True)
    return {**measured, "tokens": summary["tokens"], "stub_seconds": sleep * stub.batches, "batches": stub.batches}


def pin_threads(cores: set[int], skip: int | None = None) -> None:
    """Put every thread of this process (pools left by earlier runs too) on ``cores``, but the thread ``skip``
    (a native id)."""
    for tid in (int(t) for t in os.listdir("/proc/self/task") if int(t) != skip):
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass


def best(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return min(runs, key=lambda r: r[key])


def measure_width(root: Path, width: int, data: Path, repeats: int, rows: int, caches: Path) -> dict[str, Any]:
    """The three measures at one width; the caches go under ``caches`` (a disk, or a tmpfs)."""
    teacher = make_teacher(root, width)
    runs: dict[str, list[dict[str, Any]]] = {"c1": [], "c2": [], "slow": []}
    counter = 0
    with StubLayers() as stub:
        run_once(teacher, data, caches / "warm", stub, 0.0, 2, rows)  # warm-up (imports, allocator, page cache)
        for repeat in range(repeats):  # alternate the sides, keep the best of each
            for name, cores in ((("c1", 1), ("c2", 2)) if repeat % 2 == 0 else (("c2", 2), ("c1", 1))):
                counter += 1
                runs[name].append(run_once(teacher, data, caches / f"c{counter}", stub, 0.0, cores, rows))
        host = best(runs["c2"], "wall")
        per_batch = host["wall"] / max(1, host["batches"])
        for _ in range(repeats):
            counter += 1
            runs["slow"].append(run_once(teacher, data, caches / f"c{counter}", stub, 1.5 * per_batch, 2, rows))
    token_layers = host["tokens"] * LAYERS
    c1, c2, slow = best(runs["c1"], "wall"), best(runs["c2"], "wall"), best(runs["slow"], "wall")
    return {"width": width, "tokens": host["tokens"],
            "cpu_us_per_token_layer": round(1e6 * best(runs["c2"], "cpu")["cpu"] / token_layers, 3),
            "wall_1_core_s": round(c1["wall"], 3), "wall_2_cores_s": round(c2["wall"], 3),
            "host_speedup_2_vs_1": round(c1["wall"] / c2["wall"], 3),
            "slow_stub_s": round(slow["stub_seconds"], 3), "slow_wall_s": round(slow["wall"], 3),
            "slow_wall_vs_stub": round(slow["wall"] / slow["stub_seconds"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows of 2,048 tokens (shards of 8 rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widths", default="2048,4096")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--caches", help="where the caches are written (default: the temporary folder's disk); "
                        "/dev/shm takes the disk out, leaving the host's own work")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the stub does no math; the host's cores are the writers'
    results = []
    with tempfile.TemporaryDirectory(prefix="kdcache-host-") as tmp:
        root = Path(tmp)
        data = write_data(root, args.rows)
        for width in (int(w) for w in args.widths.split(",")):
            caches = Path(tempfile.mkdtemp(prefix="kdcache-host-caches-", dir=args.caches)) if args.caches else root
            try:
                results.append({**measure_width(root, width, data, args.repeats, args.rows, caches),
                                "caches": args.caches or tempfile.gettempdir()})
            finally:
                if caches != root:
                    shutil.rmtree(caches, ignore_errors=True)
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
