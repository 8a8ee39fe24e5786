"""Cross-tokenizer distillation from a cache (issue 35), end to end on the CPU.

A tiny random Llama teacher (byte-level BPE) is cached with ``--record-text`` on a training set and on held-out
texts; a tiny Llama student with a WordPiece tokenizer (another vocabulary, lower-cased) trains from the training
cache for ``--steps`` steps, three ways:

* ``untrained``: the random student, no step;
* ``ce``: ``--cross-tokenizer --beta 0 --gamma 0``: CE on its own tokens only;
* ``gold`` / ``uld``: ``--cross-tokenizer gold|uld``: CE + the vocabulary term + the span-pooled hidden term.

Each is scored on the held-out cache by ``span_eval.evaluate_spans`` (span top-1 agreement, span CKA, aligned
share). For the stage-two speed, the same student shape with the teacher's own tokenizer trains on the ordinary
path (top-k KL + hidden) for the same steps. Steps/s are wall-clock over the run (DeepSpeed start excluded is not
possible from the CLI; every run pays the same start).

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


def _student(root: Path, tokenizer: Any, name: str) -> Path:
    from transformers import LlamaConfig

    path = root / name
    tokenizer.save_pretrained(str(path))
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(str(path))
    return path


def _train(cache: Path, student: Path, out: Path, steps: int, *extra: str) -> float:
    from kdcache.pipeline.cli import main

    argv = ["train", "--cache", str(cache), "--student", str(student), "--out", str(out), "--max-steps", str(steps),
            "--batch-size", "8", "--lr", "3e-3", "--log-every", "50", "--layer-map", "explicit:2-2", "--quiet",
            *extra]
    start = time.perf_counter()
    assert main(argv) == 0, argv
    return steps / (time.perf_counter() - start)


def run(steps: int, sentences: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from kdcache.stages.train.span_eval import evaluate_spans
    from kdcache.storage import CacheReader
    from tests.helpers.tiny_models import make_tiny_llama, sample_texts, train_wordpiece_tokenizer

    root = Path(tempfile.mkdtemp(prefix="kdcache-bench-cross-"))
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32)
    train = _precompute(teacher, sample_texts(sentences, seed=1), root / "train")
    held = CacheReader(_precompute(teacher, sample_texts(sentences // 5, seed=99), root / "held"))
    wp = _student(root, train_wordpiece_tokenizer(root / "wp", vocab_size=200), "student-wp")
    same = _student(root, AutoTokenizer.from_pretrained(str(teacher)), "student-same")
    results: dict[str, Any] = {"steps": steps, "train_sequences": len(CacheReader(train)), "held_out": len(held)}
    first = root / "ce"
    results["ce_steps_per_s"] = _train(train, wp, first, steps, "--cross-tokenizer", "--beta", "0", "--gamma", "0")
    results["untrained"] = evaluate_spans(first, held, student=wp)
    results["ce"] = evaluate_spans(first, held)
    for loss in ("gold", "uld"):
        results[f"{loss}_steps_per_s"] = _train(train, wp, root / loss, steps, "--cross-tokenizer", loss)
        results[loss] = evaluate_spans(root / loss, held)
    results["same_tokenizer_steps_per_s"] = _train(train, same, root / "same", steps)
    return results


def table(r: dict[str, Any]) -> str:
    rows = ["| student | span top-1 | span CKA (s2-t2) | aligned share | steps/s |", "| --- | --- | --- | --- | --- |"]
    for name, speed in (("untrained", None), ("ce", "ce_steps_per_s"), ("gold", "gold_steps_per_s"),
                        ("uld", "uld_steps_per_s")):
        m = r[name]
        rows.append(f"| {name} | {m['span_top1']:.3f} | {m['span_cka'].get('s2_t2', float('nan')):.3f} | "
                    f"{m['aligned_share']:.3f} | {'' if speed is None else f'{r[speed]:.2f}'} |")
    rows.append(f"| same tokenizer, ordinary path | | | 1.000 | {r['same_tokenizer_steps_per_s']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sentences", type=int, default=400)
    args = parser.parse_args()
    results = run(args.steps, args.sentences)
    print(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
