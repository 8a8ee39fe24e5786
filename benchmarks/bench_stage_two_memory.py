"""Stage two's peak memory per vocabulary loss kind against the student trained alone, on the CPU (issue 63).

One random Llama teacher with V = 128,256 (d = 64, 2 blocks, fp32) writes four caches of 8 rows of 256 tokens
(``--packing concat``): top-128 logits with their logsumexp, full logits, ``sampled:12`` and ``head``. Its
``init-student`` copy (the same two blocks) then trains, each run in a fresh process, ``--steps`` steps of one
batch of 8 x 256 tokens through DeepSpeed (ZeRO-0, fp32 on the CPU):

* ``student alone, CE``: the student's own HF loss (its ``[8, 256, V]`` logits materialised), a plain DeepSpeed
  loop over the cache's token ids (``gpu_stage_two.Plain``): the reference;
* ``kdcache CE only``: ``run_training`` with β = γ = 0, CE through the chunked pass over the LM head;
* ``CE + top-k KL renorm`` / ``other`` (T = 1) / ``full KL`` / ``sampled KL`` / ``head KL``: ``run_training``,
  the code ``kdcache train`` runs, α = β = 1, γ = 0 (no hidden term: the vocabulary terms are what is measured).

Peak = the process's peak RSS (``VmHWM``, reset as the child starts, everything: torch, DeepSpeed, the model, Adam's state, the batch).
Each row is the least peak over ``--repeats`` processes, the runs' order reversed on every other round; its ratio
is to the least peak of the student alone.

Usage: ``python benchmarks/bench_stage_two_memory.py [--repeats 2 --work /tmp/kdcache-bench-s2mem]``; prints a
markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # appended: the installed kdcache is the one imported (see bench_gpu)

TEACHER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 128_256, "max_position_embeddings": 256}
ROWS, LENGTH, TOP_K = 8, 256, 128
# run -> (cache, TrainOptions fields); None: the student alone.
RUNS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "alone": None,
    "ce_only": ("topk", {"beta": 0.0}),
    "topk_renorm": ("topk", {"topk_kl": "renorm", "temperature": 1.0}),
    "topk_other": ("topk", {"topk_kl": "other", "temperature": 1.0}),
    "full": ("full", {"temperature": 1.0}),
    "sampled": ("sampled:12", {}),
    "head": ("head", {"temperature": 1.0}),
}
LABELS = {"alone": "student alone, CE", "ce_only": "kdcache CE only (β = 0)", "topk_renorm": "CE + top-128 KL, renormalised",
          "topk_other": "CE + top-128 KL, `other` (T = 1)", "full": "CE + full KL (T = 1)",
          "sampled": "CE + sampled:12 KL", "head": "CE + head KL (T = 1)"}
ALONE = "alone"


def build(work: Path) -> tuple[Path, dict[str, Path]]:
    """The student and one cache per logit mode (reused when already in ``work``)."""
    teacher = work / "teacher"
    if not (teacher / "config.json").is_file():
        _teacher(teacher)
    data = work / "text.jsonl"
    if not data.is_file():
        from tests.helpers.tiny_models import sample_texts, write_text_dataset

        write_text_dataset(data, sample_texts(2000, seed=3))
    caches = {mode: _cache(teacher, data, work / f"cache-{mode.replace(':', '-')}", mode)
              for mode in sorted({spec[0] for spec in RUNS.values() if spec})}
    student = work / "student"
    if not (student / "config.json").is_file():
        from kdcache.stages.train.init_student import init_student_from_teacher

        init_student_from_teacher(str(teacher), [1, 2], student)
    return student, caches


def _teacher(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_models import sample_texts, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(path, vocab_size=1000, add_bos=True, texts=sample_texts(2000))
    config = LlamaConfig(**TEACHER, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def _cache(teacher: Path, data: Path, out: Path, mode: str) -> Path:
    """``ROWS`` rows of ``LENGTH`` tokens with logits of ``mode`` (``head`` also keeps the last layer)."""
    if (out / "manifest.json").is_file():
        return out
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.runner import run_precompute

    run_precompute(PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(out), packing="concat",
                                        max_length=LENGTH, max_sequences=ROWS, batch_size=ROWS, logits_mode=mode,
                                        top_k=TOP_K, features=("logits",), progress=False))
    return out


def run_one(run: str, student: str, cache: str, out: str, steps: int) -> dict[str, Any]:
    """One run in this process: ``{"run", "peak_rss"}`` (bytes), after ``steps`` optimizer steps."""
    from kdcache.stages.train.core.options import TrainOptions

    # The peak since now: a forked child starts with its parent's high-water mark (ru_maxrss would report it).
    Path("/proc/self/clear_refs").write_text("5")
    spec = RUNS[run]
    fields = {} if spec is None else {"alpha": 1.0, "beta": 1.0, "gamma": 0.0, **spec[1]}
    options = TrainOptions.of(cache=cache, student=student, out=out, batch_size=ROWS, max_steps=steps, log_every=1,
                              export=False, quiet=True, lr=1e-4, seed=0, **fields)
    if spec is None:
        _alone(options, steps)
    else:
        from kdcache.stages.train.loop import run_training

        run_training(options)
    return {"run": run, "peak_rss": _peak_rss()}


def _peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset through ``/proc/self/clear_refs``."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _alone(options: Any, steps: int) -> None:
    """The student's own HF loss in a plain DeepSpeed loop (``gpu_stage_two``'s reference run), on the CPU."""
    from benchmarks.gpu_stage_two import Plain
    from kdcache.stages.train.core.student import load_student
    from kdcache.stages.train.engine import build_engine, init_distributed
    from kdcache.stages.train.feed.streaming import CacheStream

    dist = init_distributed()
    engine = build_engine(Plain(load_student(options.run.student)), options, dist.device)
    stream = CacheStream(options.data.cache, ("input_ids",), batch_size=options.data.batch_size, seed=0)
    batches = iter(stream)
    for _ in range(steps):
        batch = next(batches)
        batch.pop("epoch"), batch.pop("step_in_epoch")
        engine.backward(engine(batch))
        engine.step()


def _subprocess(run: str, student: Path, caches: dict[str, Path], work: Path, steps: int) -> dict[str, Any]:
    from kdcache.pipeline.children import child_env

    spec = RUNS[run]
    cache = caches[spec[0]] if spec else caches["topk"]  # the student alone reads the token ids only
    out = work / f"run-{list(RUNS).index(run)}"
    shutil.rmtree(out, ignore_errors=True)  # this benchmark's own run folder, from its previous process
    cmd = [sys.executable, __file__, "--one", run, str(student), str(cache), str(out), str(steps)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, env=child_env())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def measure(work: Path, repeats: int, steps: int, runs: list[str]) -> dict[str, dict[str, Any]]:
    """``run -> {"run", "peak_rss" (least over the repeats), "all" (every process's)}``."""
    student, caches = build(work)
    best: dict[str, dict[str, Any]] = {}
    for repeat in range(repeats):
        for run in (runs if repeat % 2 == 0 else runs[::-1]):
            row = _subprocess(run, student, caches, work, steps)
            seen = best.get(run, {"all": []})["all"] + [row["peak_rss"]]
            best[run] = {"run": run, "peak_rss": min(seen), "all": seen}
    return best


def table(best: dict[str, dict[str, Any]]) -> str:
    alone = best[ALONE]["peak_rss"]
    rows = [f"{ROWS} x {LENGTH} tokens, V = {TEACHER['vocab_size']:,}, d = {TEACHER['hidden_size']}, fp32 on the "
            "CPU; peak RSS of the training process", "",
            "| run | peak RSS (MB) | × student alone | every process (MB) |", "| --- | --- | --- | --- |"]
    for run, r in best.items():
        every = ", ".join(f"{p / 1e6:,.0f}" for p in r["all"])
        rows.append(f"| {LABELS[run]} | {r['peak_rss'] / 1e6:,.0f} | {r['peak_rss'] / alone:.2f} | {every} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/kdcache-bench-s2mem", help="teacher, caches and runs go here")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--runs", default=",".join(RUNS), help="runs, comma separated (the student alone always)")
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run, student, cache, out, steps = args.one
        print("RESULT " + json.dumps(run_one(run, student, cache, out, int(steps))), flush=True)
        return
    runs = [ALONE] + [r for r in args.runs.split(",") if r != ALONE]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; expected some of {list(RUNS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    best = measure(work, args.repeats, args.steps, runs)
    print(table(best))
    print(json.dumps(list(best.values())))


if __name__ == "__main__":
    main()
