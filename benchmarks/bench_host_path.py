"""Stage one's host path alone: what kdcache's own code costs per token and layer, with the teacher stubbed out.

A Llama-shaped teacher of width d (2,048 or 4,096) whose decoder layers are replaced by a stub: each returns a
fixed random activation ``[B, L, d]`` after sleeping a chosen time, as a GPU forward looks to the host (the host
is free meanwhile). Everything else is the real stage one: hooks, the gather of valid tokens, the copy to the
host, encoding, checks, compression, the commit protocol with fsync. Rows of 2,048 tokens (``--packing
concat``) in shards of 8, four cached hidden layers in fp16.

It reports, per width:

* host CPU-seconds per token-layer (the process's CPU time over the compute phase, stub sleeping 0 s, divided
  by tokens x cached layers), and the wall time, with 1 and 2 writer threads;
* with the stub slower than the host's work (1.5x the host's wall time per batch), the wall time against the
  stub's total: overlap means the host's work hides behind the stub's.

Run: ``.venv/bin/python benchmarks/bench_host_path.py [--rows 32] [--repeats 3] [--widths 2048,4096]``. It runs
on the code that is installed, so the same script measures the tree before and after a change.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from kdcache.stages.precompute import (  # noqa: E402
    PrecomputeOptions,
    run_precompute,
    runner,  # noqa: E402
)

LAYERS = 4
ROW = 2048


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StubLayers:
    """Replaces ``LlamaDecoderLayer.forward`` by a sleep and a fixed activation, while active. The sleep, the
    device's time, is ``device_time``: a subclass may spend it otherwise (``bench_gil.LaunchLayers``)."""

    def __init__(self) -> None:
        from transformers.models.llama import modeling_llama

        self.cls = modeling_llama.LlamaDecoderLayer
        self.original = self.cls.forward
        self.sleep = 0.0
        self.batches = 0
        self._fixed: dict[tuple[int, ...], torch.Tensor] = {}

    def __enter__(self) -> StubLayers:
        stub = self

        def forward(layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if layer.self_attn.layer_idx == 0:
                stub.batches += 1
                stub.device_time()
            key = tuple(hidden_states.shape)
            if key not in stub._fixed:
                generator = torch.Generator().manual_seed(len(stub._fixed))
                stub._fixed[key] = torch.randn(key, generator=generator).to(hidden_states.dtype)
            return stub._fixed[key]

        self.cls.forward = forward
        return self

    def device_time(self) -> None:
        """The device's time per batch, as the host sees it: free to do other work."""
        time.sleep(self.sleep)

    def __exit__(self, *exc: object) -> None:
        self.cls.forward = self.original


def make_teacher(root: Path, width: int, positions: int = ROW) -> Path:
    """A 4-layer Llama of width ``width`` (one kv head, a tiny MLP: its weights are never used)."""
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(root / f"llama-{width}", layers=LAYERS, hidden=width, heads=16, kv_heads=1,
                           intermediate=16, positions=positions)


def write_data(root: Path, rows: int) -> Path:
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    texts = sample_texts(rows * 300, seed=1)  # >= 7 tokens each: enough for ``rows`` packed rows of 2,048
    return write_text_dataset(root / "data.jsonl", texts)


def run_once(teacher: Path, data: Path, out: Path, stub: StubLayers, sleep: float, writers: int | None,
             rows: int) -> dict[str, Any]:
    """One precompute; the compute phase's wall time and CPU time, and the stub's total sleep."""
    fields = {f.name for f in dataclasses.fields(PrecomputeOptions.of(teacher="x", data="x", out="x").engine)}
    extra = {"writers": writers} if writers is not None and "writers" in fields else {}
    options = PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(out), layers=tuple(
        str(j) for j in range(1, LAYERS + 1)), features=("hidden",), packing="concat", max_length=ROW,
        batch_size=8, sequences_per_shard=8, max_sequences=rows, teacher_dtype="fp32", progress=False, **extra)
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
    try:
        summary = run_precompute(options)
    finally:
        runner.commit_behind = original
        shutil.rmtree(out, ignore_errors=True)
    return {**measured, "tokens": summary["tokens"], "stub_seconds": sleep * stub.batches, "batches": stub.batches}


def best(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return min(runs, key=lambda r: r[key])


def measure_width(root: Path, width: int, data: Path, repeats: int, rows: int) -> dict[str, Any]:
    teacher = make_teacher(root, width)
    runs: dict[str, list[dict[str, Any]]] = {"w1": [], "w2": [], "slow": []}
    counter = 0
    with StubLayers() as stub:
        run_once(teacher, data, root / "warm", stub, 0.0, 1, rows)  # warm-up (imports, allocator, page cache)
        for _ in range(repeats):  # alternate the sides, keep the best of each
            for name, writers in (("w1", 1), ("w2", 2)):
                counter += 1
                runs[name].append(run_once(teacher, data, root / f"c{counter}", stub, 0.0, writers, rows))
        host = best(runs["w1"], "wall")
        per_batch = host["wall"] / max(1, host["batches"])
        for _ in range(repeats):
            counter += 1
            runs["slow"].append(run_once(teacher, data, root / f"c{counter}", stub, 1.5 * per_batch, 2, rows))
    token_layers = host["tokens"] * LAYERS
    w1, w2, slow = best(runs["w1"], "wall"), best(runs["w2"], "wall"), best(runs["slow"], "wall")
    return {"width": width, "tokens": host["tokens"],
            "cpu_us_per_token_layer": round(1e6 * best(runs["w1"], "cpu")["cpu"] / token_layers, 3),
            "wall_1_writer_s": round(w1["wall"], 3), "wall_2_writers_s": round(w2["wall"], 3),
            "host_speedup_2_vs_1": round(w1["wall"] / w2["wall"], 3),
            "slow_stub_s": round(slow["stub_seconds"], 3), "slow_wall_s": round(slow["wall"], 3),
            "slow_wall_vs_stub": round(slow["wall"] / slow["stub_seconds"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows of 2,048 tokens (shards of 8 rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widths", default="2048,4096")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the stub does no math; the host's cores are the writers'
    results = []
    with tempfile.TemporaryDirectory(prefix="kdcache-host-") as tmp:
        root = Path(tmp)
        data = write_data(root, args.rows)
        for width in (int(w) for w in args.widths.split(",")):
            results.append(measure_width(root, width, data, args.repeats, args.rows))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
