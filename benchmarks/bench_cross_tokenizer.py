"""Cross-tokenizer distillation from a cache (issue 35), end to end on the CPU.

A tiny Llama teacher (byte-level BPE; random weights, then ``--teacher-steps`` of next-token training on the
training texts, so its predictions are worth agreeing with) is cached with ``--record-text`` on a training set and
on held-out texts. A tiny Llama student with a WordPiece tokenizer (another vocabulary, lower-cased) trains from
the training cache for ``--steps`` steps, four ways, each with ``--seeds`` training seeds, beside the untrained
student and the teacher itself (the ceiling: its own tokenizer through the cross path):

* ``untrained``: the random student, no step;
* ``ce``: ``--cross-tokenizer --beta 0 --gamma 0``: CE on its own tokens only;
* ``gold`` / ``uld``: ``--cross-tokenizer gold|uld``: CE + the vocabulary term + the span-pooled hidden term;
* ``gold_other``: ``gold`` with ``--topk-kl other --temperature 1`` (its exact part on absolute probabilities).

Each is scored on the held-out cache by ``span_eval.evaluate_spans`` (span top-1 agreement, span CKA and cosine,
aligned share). For the stage-two speed, the same student shape with the teacher's own tokenizer trains on the
ordinary path (top-k KL + hidden) and on the cross path (``gold``, every span one token) for the same steps.
Speeds come from the run's own log (``metrics.jsonl``): steps and teacher tokens between the first logged step
and the last, over the time between them, so DeepSpeed's start and the first steps' warm-up are left out. The
runs alternate ``--repeats`` times; the best of each is kept (the machine is shared).

Usage: ``python benchmarks/bench_cross_tokenizer.py [--steps 300 --sentences 400]``; prints JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers


def _precompute(teacher: Path, texts: list[str], out: Path) -> Path:
    from kdcache.pipeline.cli import main

    data = out.parent / f"{out.name}.txt"
    data.write_text("\n".join(texts) + "\n")
    argv = ["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--max-length", "48",
            "--features", "hidden,logits", "--layers", "0,2", "--top-k", "16", "--record-text", "--no-progress",
            "--quiet"]
    assert main(argv) == 0, argv
    return out


def _train_teacher(teacher: Path, texts: list[str], steps: int) -> None:
    """Give the random teacher something to teach: ``steps`` of next-token training on the training texts (plain
    torch, AdamW), saved in place. A random teacher's predictions are near uniform, so no student can agree with
    its top-1 beyond chance, whatever the loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(str(teacher)), AutoModelForCausalLM.from_pretrained(str(teacher))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        picked = [texts[int(i)] for i in torch.randint(len(texts), (16,), generator=generator)]
        batch = tokenizer(picked, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(teacher))


def _student(root: Path, tokenizer: Any, name: str) -> Path:
    from transformers import LlamaConfig

    path = root / name
    tokenizer.save_pretrained(str(path))
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(str(path))
    return path


def _train(cache: Path, student: Path, out: Path, steps: int, *extra: str) -> dict[str, float]:
    """Train; the steady speed between the first and the last logged step (module docstring)."""
    import shutil

    from kdcache.pipeline.cli import main
    from kdcache.stages.train.logging import read_jsonl

    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--cache", str(cache), "--student", str(student), "--out", str(out), "--max-steps", str(steps),
            "--batch-size", "8", "--lr", "3e-3", "--log-every", str(max(steps // 10, 1)), "--layer-map",
            "explicit:2-2", "--quiet", *extra]
    assert main(argv) == 0, argv
    rows = read_jsonl(out / "metrics.jsonl")
    seconds = rows[-1]["time_s"] - rows[0]["time_s"]
    return {"steps_per_s": (rows[-1]["step"] - rows[0]["step"]) / seconds,
            "tokens_per_s": sum(r["tokens"] for r in rows[1:]) / seconds}


QUALITY = ("ce", "gold", "gold_other", "uld")  # the runs scored on the held-out cache, once per seed


def run(steps: int, sentences: int, repeats: int = 2, teacher_steps: int = 300,
        root: Path | None = None, seeds: int = 3) -> dict[str, Any]:
    """Every run of the module docstring, under ``root`` (a fresh temporary folder by default, kept)."""
    from transformers import AutoTokenizer

    from kdcache.stages.train.evaluation.span_eval import evaluate_spans
    from kdcache.storage import CacheReader
    from tests.helpers.tiny_models import make_tiny_llama, sample_texts, train_wordpiece_tokenizer

    root = root or Path(tempfile.mkdtemp(prefix="kdcache-bench-cross-"))
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32)
    if teacher_steps:
        _train_teacher(teacher, sample_texts(sentences, seed=1), teacher_steps)
    train = _precompute(teacher, sample_texts(sentences, seed=1), root / "train")
    held = CacheReader(_precompute(teacher, sample_texts(sentences // 5, seed=99), root / "held"))
    wp = _student(root, train_wordpiece_tokenizer(root / "wp", vocab_size=200), "student-wp")
    same = _student(root, AutoTokenizer.from_pretrained(str(teacher)), "student-same")
    results: dict[str, Any] = {"steps": steps, "teacher_steps": teacher_steps, "train_sequences": len(CacheReader(train)), "held_out": len(held),
                               "root": str(root)}
    runs = {"ce": (wp, "--cross-tokenizer", "--beta", "0", "--gamma", "0"), "gold": (wp, "--cross-tokenizer", "gold"),
            "gold_other": (wp, "--cross-tokenizer", "gold", "--topk-kl", "other", "--temperature", "1"),
            "uld": (wp, "--cross-tokenizer", "uld"), "same": (same,), "same_cross": (same, "--cross-tokenizer", "gold")}
    speeds: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    scores: dict[str, list[dict[str, Any]]] = {name: [] for name in QUALITY}
    for seed in range(seeds):  # the runs alternate within each seed; the speeds of every seed count
        for name in QUALITY:
            student, *extra = runs[name]
            out = root / f"{name}-seed{seed}"
            speeds[name].append(_train(train, student, out, steps, *extra, "--seed", str(seed)))
            scores[name].append(evaluate_spans(out, held))
    for _ in range(repeats):  # the same-tokenizer pair, alternating, best of each kept
        for name in ("same", "same_cross"):
            student, *extra = runs[name]
            speeds[name].append(_train(train, student, root / name, steps, *extra))
    for name, found in speeds.items():
        results[f"{name}_speed"] = max(found, key=lambda r: r["steps_per_s"])
    # The floor and the ceiling of span top-1 on these spans: the untrained student, the best constant prediction
    # (span_top1_floor) and the teacher itself through the cross path (its own tokenizer and cache: 1.0).
    results["untrained"] = [evaluate_spans(root / "ce-seed0", held, student=wp)]
    results["teacher"] = [evaluate_spans(root / "ce-seed0", held, student=teacher)]
    results.update(scores)
    return results


def _spread(runs: list[dict[str, Any]], key: str) -> str:
    """``mean ± half the range`` of ``key`` over the seeds' runs (the value alone for one run)."""
    values = [r[key] for r in runs]
    mean = sum(values) / len(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ± {(max(values) - min(values)) / 2:.3f}"


def table(r: dict[str, Any]) -> str:
    same = r["same_speed"]["steps_per_s"]
    seeds = len(r["ce"])
    rows = [f"span top-1 over {r['ce'][0]['spans']} held-out spans; mean ± half the range over {seeds} seed(s); the "
            f"best constant prediction scores {r['ce'][0]['span_top1_floor']:.3f} on them", "",
            "| student | span top-1 | span CKA (s2-t2) | aligned share | steps/s | vs same tokenizer |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in ("teacher", "untrained", *QUALITY):
        runs, speed = r[name], r.get(f"{name}_speed", {}).get("steps_per_s")
        cka = [{"cka": m["span_cka"].get("s2_t2", float("nan"))} for m in runs]
        cells = [name, _spread(runs, "span_top1"), _spread(cka, "cka"), _spread(runs, "aligned_share"),
                 *(("", "") if speed is None else (f"{speed:.2f}", f"{speed / same:.2f}x"))]
        rows.append("| " + " | ".join(cells) + " |")
    rows.append(f"| same tokenizer, ordinary path | | | 1.000 | {same:.2f} | 1 |")
    cross = r["same_cross_speed"]["steps_per_s"]
    rows.append(f"| same tokenizer, cross path (gold) | | | 1.000 | {cross:.2f} | {cross / same:.2f}x |")
    return "\n".join(rows)


def step_memory(vocab: int, rows: int, sentences: int = 64) -> dict[str, Any]:
    """Peak host memory of one cross-tokenizer step (``gold``, CE + vocabulary term, forward and backward) with a
    student of ``vocab`` logits, its logits built chunk by chunk from its head against materialised, each side in a
    fresh process (``ru_maxrss`` grows only). Returns MiB above each process's state before the step."""
    import multiprocessing

    from transformers import LlamaConfig

    from tests.helpers.tiny_models import make_tiny_llama, sample_texts, train_wordpiece_tokenizer

    root = Path(tempfile.mkdtemp(prefix="kdcache-bench-cross-memory-"))
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32)
    cache = _precompute(teacher, sample_texts(sentences, seed=1), root / "cache")
    student = root / "student"
    tokenizer = train_wordpiece_tokenizer(student, vocab_size=200)
    LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=128, max_position_embeddings=128,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(str(student))
    out: dict[str, Any] = {"student_vocab": vocab, "rows": rows}
    context = multiprocessing.get_context("spawn")
    for path in ("chunked", "materialised"):
        with context.Pool(1) as pool:
            out[path] = pool.apply(_one_step_peak, (str(cache), str(student), rows, path))
    return out


def _one_step_peak(cache: str, student: str, rows: int, path: str) -> dict[str, float]:
    """``step_memory``'s child: one step on ``rows`` sequences, ``path`` "chunked" or "materialised"."""
    import resource

    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.core.student_head import plain_head
    from kdcache.stages.train.cross.cross_model import build_cross_model, without_logit_kl
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.loop import prepare
    from kdcache.stages.train.loss import DistillationLoss

    options = TrainOptions.of(cache=cache, student=student, out=str(Path(cache).parent / "unused"),
                              cross_tokenizer="gold", gamma=0.0)
    reader, model, facts, plan, options = prepare(options)
    cross = build_cross_model(options, reader, model,
                              DistillationLoss.planned(without_logit_kl(options), plan, facts, reader, model),
                              announce=False)
    host = collate([reader.get(i, list(plan.names)) for i in range(rows)], list(range(rows)))
    cross.aligner.extend(host)
    batch = to_device(host, "cpu")
    # Set the head the first batch would choose (its check runs a forward, which would count in the peak);
    # materialised is the fallback a student without a plain linear head takes.
    cross.criterion._head = (plain_head(model) if path == "chunked" else None,)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cross(batch)["loss"].backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - before) / 1024, "seconds": seconds,
            "student_tokens": int(batch["student/mask"].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating rounds of the same-tokenizer speed pair (best kept)")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds of each scored run (mean and spread)")
    parser.add_argument("--teacher-steps", type=int, default=300,
                        help="next-token training of the tiny teacher before it is cached (0: random weights)")
    parser.add_argument("--memory-vocab", type=int, default=0, metavar="V",
                        help="instead: the peak memory of one step with a student of V logits, chunked head against "
                             "materialised logits (step_memory)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds: got {args.seeds}, expected at least 1 (each scored run trains once per seed)")
    if args.memory_vocab:
        print(json.dumps(step_memory(args.memory_vocab, rows=32), indent=1))
        return
    results = run(args.steps, args.sentences, args.repeats, args.teacher_steps, seeds=args.seeds)
    print(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
