"""Stage two against the student alone: tokens/s and peak GPU memory of five runs with one DeepSpeed config.

A module without a CLI of its own: ``benchmarks/bench_gpu.py`` builds the teacher and its cache and calls
``stage_two_rows``; tests/benchmarks call it with ``small=True`` on a tiny model on the CPU. The runs:

* ``student alone``: the student's own HF loss (CE), a plain DeepSpeed loop over the cache's token ids;
* ``kdcache CE only`` (``--beta 0 --gamma 0``), ``kdcache CE + top-k KL`` (``--gamma 0``; also ``--topk-kl other``)
  and ``kdcache CE + top-k KL + hidden MSE`` (the defaults): ``run_training``, the code ``kdcache train`` runs,
  timed from its metrics (``tokens`` and ``time_s`` per step, logged every step after ``warmup``); on CUDA their
  vocabulary terms go through the fused Triton kernel, and the ``pure-torch pass`` runs beside them are the same
  without it (today's road before issue 42);
* ``online KD``: the teacher in memory beside the student, full KL + hidden MSE on its outputs of each batch.

Each run is its own process, so each peak (``torch.cuda.max_memory_allocated``; 0 on the CPU) is its own. The
student is ``kdcache init-student --layers 4,8,12,16`` of the teacher (``small``: two of a tiny teacher's blocks);
the cache must hold those layers' hidden states and top-k logits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RUNS = ("student alone", "kdcache CE only", "kdcache CE + top-k KL", "kdcache CE + top-k KL (other, T = 1)",
        "kdcache CE + top-k KL, pure-torch pass", "kdcache CE + top-k KL, passes apart",
        "kdcache CE + top-k KL + hidden MSE", "kdcache CE + top-k KL + hidden MSE, pure-torch pass", "online KD")
KDCACHE_WEIGHTS = {"kdcache CE only": {"beta": 0.0, "gamma": 0.0}, "kdcache CE + top-k KL": {"gamma": 0.0},
                   "kdcache CE + top-k KL (other, T = 1)": {"gamma": 0.0, "topk_kl": "other", "temperature": 1.0},
                   "kdcache CE + top-k KL, pure-torch pass": {"gamma": 0.0},
                   "kdcache CE + top-k KL, passes apart": {"gamma": 0.0}, "kdcache CE + top-k KL + hidden MSE": {},
                   "kdcache CE + top-k KL + hidden MSE, pure-torch pass": {}}
# The comparison behind ``vocab_pass``'s choice: each vocabulary term through its own route (liger's fused CE, the
# renormalised top-k KL's gather of k logits) instead of one shared pass over the LM head.
APART = "kdcache CE + top-k KL, passes apart"
# Today's road before the fused kernel (issue 42): the shared pass in pure torch (on the CPU every run takes it).
TORCH_PASS = ("kdcache CE + top-k KL, pure-torch pass", "kdcache CE + top-k KL + hidden MSE, pure-torch pass")
BATCH, SMALL_BATCH = 4, 4


def stage_two_rows(teacher_dir: str, cache_dir: str, work_dir: str, *, small: bool, steps: int,
                   warmup: int) -> list[dict[str, Any]]:
    """One row per run: ``{"run", "tokens_per_s", "peak_gib", "vs_student_alone"}`` (see the module docstring)."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    student = _student(teacher_dir, work, small)
    rows = [_in_process(run, student, teacher_dir, cache_dir, work, small, steps, warmup) for run in RUNS]
    alone = rows[0]["tokens_per_s"]
    return [{**row, "vs_student_alone": round(row["tokens_per_s"] / alone, 3) if alone else 0.0} for row in rows]


def _student(teacher_dir: str, work: Path, small: bool) -> str:
    """``kdcache init-student`` of the teacher: blocks 4,8,12,16, or the middle and last of a tiny one."""
    from transformers import AutoConfig

    from kdcache.stages.train.init_student import init_student_from_teacher

    depth = int(AutoConfig.from_pretrained(teacher_dir).num_hidden_layers)
    layers = sorted({depth // 2, depth}) if small else [4, 8, 12, 16]
    out = work / "student"
    if not (out / "config.json").is_file():
        init_student_from_teacher(teacher_dir, layers, out)
    return str(out)


def _in_process(run: str, student: str, teacher: str, cache: str, work: Path, small: bool, steps: int,
                warmup: int) -> dict[str, Any]:
    """Run ``run`` in a fresh Python process (its own peak memory) and read back its row."""
    from kdcache.pipeline.children import child_env

    args = json.dumps([run, student, teacher, cache, str(work), small, steps, warmup])
    # The repository is appended to the path and not the working directory: an installed kdcache (not the bare
    # kdcache/ folder at the root, which holds none of its subpackages without an editable install) is imported.
    code = (f"import json, sys; sys.path.append({str(REPO)!r}); from benchmarks.gpu_stage_two import run_one; "
            "print('ROW', json.dumps(run_one(*json.loads(sys.argv[1]))))")
    # child_env drops this process's rank variables: an in-process run before (a test's) leaves MASTER_PORT held
    # by its process group, which the child would try to bind again.
    proc = subprocess.run([sys.executable, "-c", code, args], cwd=work, capture_output=True, text=True,
                          env=child_env(HF_HUB_OFFLINE="1"), check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
    if line is None:
        raise RuntimeError(f"the run {run!r} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[4:])


def run_one(run: str, student: str, teacher: str, cache: str, work: str, small: bool, steps: int,
            warmup: int) -> dict[str, Any]:
    """One run in this process: ``{"run", "tokens_per_s", "peak_gib"}``."""
    out = Path(work) / f"run-{RUNS.index(run)}"
    shutil.rmtree(out, ignore_errors=True)
    # The kernel's rows on `fused` where it can run, so that a kernel failing its check stops the benchmark rather
    # than timing the pure-torch pass under the kernel's name; the pure-torch rows on `torch`.
    road = "torch" if run in TORCH_PASS else "fused" if torch.cuda.is_available() else "auto"
    options = _options(cache, student, out, steps + warmup, small, vocab_kernel=road, **KDCACHE_WEIGHTS.get(run, {}))
    if run == APART:
        _passes_apart()
    if run in KDCACHE_WEIGHTS:
        rate = _kdcache_rate(options, warmup)
    else:
        rate = _loop_rate(options, teacher if run == "online KD" else None, steps, warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    shutil.rmtree(out, ignore_errors=True)  # a 714 M student's checkpoint is ~10 GB
    return {"run": run, "tokens_per_s": round(rate, 1), "peak_gib": round(peak, 2)}


def _passes_apart() -> None:
    """Make ``CompoundLoss`` run each vocabulary term in its own ``vocab_pass`` (this process only)."""
    from kdcache.stages.targets.logits.vocab import vocab_pass  # the module, whose function CompoundLoss calls

    shared = vocab_pass.vocab_pass

    def apart(logits: Any, terms: Any, weights: Any) -> tuple[Any, Any]:
        runs = [shared(logits, [term], [weight]) for term, weight in zip(terms, weights)]
        return torch.stack([total for total, _ in runs]).sum(), torch.cat([values for _, values in runs])

    vocab_pass.vocab_pass = apart  # type: ignore[assignment]


def _options(cache: str, student: str, out: Path, max_steps: int, small: bool, **weights: float | str) -> Any:
    from kdcache.stages.train.core.options import TrainOptions

    return TrainOptions.of(cache=cache, student=student, out=str(out), batch_size=SMALL_BATCH if small else BATCH,
                           max_steps=max_steps, log_every=1, export=False, quiet=True, lr=1e-4, **weights)


def _kdcache_rate(options: Any, warmup: int) -> float:
    """Tokens/s of ``run_training`` after ``warmup`` steps, from its per-step metrics (each log step syncs)."""
    from kdcache.stages.train.logging import read_jsonl
    from kdcache.stages.train.loop import run_training

    run_training(options)
    records = read_jsonl(Path(options.run.out) / "metrics.jsonl")
    timed = [r for r in records if r["step"] > warmup]
    start = next(r["time_s"] for r in records if r["step"] == warmup)
    return sum(r["tokens"] for r in timed) / max(timed[-1]["time_s"] - start, 1e-9)


def _loop_rate(options: Any, teacher_dir: str | None, steps: int, warmup: int) -> float:
    """Tokens/s of a plain DeepSpeed loop (same config as ``run_training``'s) over the cache's token ids: the
    student's own loss, or with ``teacher_dir`` online KD against the teacher run on each batch."""
    from kdcache.stages.train.core.student import load_student
    from kdcache.stages.train.engine import build_engine, init_distributed
    from kdcache.stages.train.feed.streaming import CacheStream, to_device

    dist = init_distributed()
    student = load_student(options.run.student)
    model = Plain(student) if teacher_dir is None else Online(student, teacher_dir, options.run.student, dist.device)
    engine = build_engine(model, options, dist.device)
    stream = CacheStream(options.data.cache, ("input_ids",), batch_size=options.data.batch_size, seed=0,
                         pin_memory=dist.device.type == "cuda")
    batches, tokens, start = iter(stream), 0, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync()
            tokens, start = 0, time.perf_counter()
        batch = next(batches)
        batch.pop("epoch"), batch.pop("step_in_epoch")
        tokens += int(batch["mask"].sum())  # the host copy: no device sync
        engine.backward(engine(to_device(batch, dist.device)))
        engine.step()
    _sync()
    return tokens / max(time.perf_counter() - start, 1e-9)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Plain(torch.nn.Module):
    """The student alone: its own HF causal LM loss (labels -100 at padding)."""

    def __init__(self, student: Any):
        super().__init__()
        self.student = student

    def forward(self, batch: dict[str, Any]) -> Any:
        ids, mask = batch["input_ids"].long(), batch["mask"]
        return self.student(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


class Online(torch.nn.Module):
    """Online KD: full KL + hidden MSE against the teacher's outputs on each batch (the teacher is not trained).

    The student runs as ``kdcache train`` runs it: its base model, the losses applying its head chunk by chunk."""

    def __init__(self, student: Any, teacher_dir: str, student_dir: str, device: torch.device):
        from transformers import AutoModelForCausalLM

        from kdcache.stages.common.option_groups import assemble
        from kdcache.stages.train.core.options import LossOptions
        from kdcache.stages.train.objective.compound import CompoundLoss

        super().__init__()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=dtype).to(device).eval()
        blocks = json.loads((Path(student_dir) / "kdcache_init.json").read_text())["teacher_blocks"]
        self.pairs = [(i + 1, int(t)) for i, t in enumerate(blocks)]
        self.student = student
        options = assemble(LossOptions, {"gamma": 1.0, "temperature": 1.0})
        self.criterion = CompoundLoss(options, layer_map=self.pairs, student_dim=student.config.hidden_size,
                                      teacher_dim=teacher.config.hidden_size)
        self._teacher = (teacher.requires_grad_(False),)  # a tuple: not a submodule, DeepSpeed leaves it alone

    def forward(self, batch: dict[str, Any]) -> Any:
        from kdcache.stages.train.core.student_head import base_forward, plain_head

        ids, mask = batch["input_ids"].long(), batch["mask"]
        with torch.no_grad():
            t = self._teacher[0](input_ids=ids, attention_mask=mask, output_hidden_states=True)
        targets = {"input_ids": ids, "logits/full": t.logits, **{f"hidden/{j}": t.hidden_states[j] for _, j in self.pairs}}
        inputs, head = {"input_ids": ids, "attention_mask": mask}, plain_head(self.student)
        out = (base_forward(self.student, head, inputs, hidden=True, attentions=False) if head is not None
               else self.student(**inputs, output_hidden_states=True))
        return self.criterion(out, targets, mask)["loss"]
