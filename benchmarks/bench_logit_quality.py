"""Which logit mode trains the best student, on the same held-out tokens (issue 11's quality table).

One teacher (a random GPT-2 whose larger initialisation gives peaked, non-trivial distributions over a 2,000-token
BPE vocabulary trained on standard-library sentences), one training set cached in each mode, one student per mode
(the teacher's first two blocks, ``kdcache init-student``), trained the same steps with the same seed on the KL term
alone at T = 1, then scored against a held-out cache with full logits: the exact KL to the teacher per held-out
token and top-1 agreement. Everything runs through the CLI, on the CPU.

Run: ``.venv/bin/python benchmarks/bench_logit_quality.py [--steps 60] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the tiny models

from kdcache.pipeline.cli import main as kdcache  # noqa: E402
from kdcache.stages.train.evaluation.eval_records import read_evals  # noqa: E402
from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts, write_text_dataset  # noqa: E402

MODES = {"full": ["--logits", "full"], "top-64": ["--top-k", "64"], "top-128": ["--top-k", "128"],
         "top-128 log-probs": ["--top-k", "128", "--topk-values", "logprob"],
         "sampled:12": ["--logits", "sampled:12"], "head": ["--logits", "head"]}


def run(root: Path, steps: int, modes: list[str]) -> dict[str, dict[str, float]]:
    teacher = make_tiny_gpt2(root / "teacher", layers=4, hidden=64, vocab_size=2000, positions=256,
                             initializer_range=0.3)
    train = write_text_dataset(root / "train.jsonl", sample_texts(600, seed=1))
    heldout = write_text_dataset(root / "heldout.jsonl", sample_texts(120, seed=2))
    common = ["--teacher", str(teacher), "--max-length", "64", "--layers", "4", "--no-progress"]
    assert kdcache(["precompute", *common, "--data", str(heldout), "--out", str(root / "heldout"),
                    "--logits", "full"]) == 0
    assert kdcache(["init-student", "--teacher", str(teacher), "--layers", "2,4", "--out",
                    str(root / "student")]) == 0
    results = {}
    for name in modes:
        flags = MODES[name]
        cache, out = root / f"cache-{name}", root / f"run-{name}"
        assert kdcache(["precompute", *common, "--data", str(train), "--out", str(cache), *flags]) == 0
        assert kdcache(["train", "--cache", str(cache), "--student", str(root / "student"), "--out", str(out),
                        "--max-steps", str(steps), "--batch-size", "16", "--alpha", "0", "--gamma", "0",
                        "--temperature", "1", "--lr", "1e-3", "--quiet"]) == 0
        assert kdcache(["eval", "--cache", str(root / "heldout"), "--run", str(out)]) == 0
        scored = [e for e in read_evals(out) if e["role"] == "trained"][0]
        results[name] = {"heldout_kl": scored["kl"], "top1_agreement": scored["top1_agreement"],
                         "cache_bytes": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kdcache-quality-") as tmp:
        results = run(Path(tmp), args.steps, args.modes.split(","))
    print(f"{'mode':<18} {'held-out KL':>12} {'top-1':>7} {'cache MiB':>10}")
    for name, row in sorted(results.items(), key=lambda kv: kv[1]["heldout_kl"]):
        print(f"{name:<18} {row['heldout_kl']:>12.4f} {row['top1_agreement']:>7.3f} {row['cache_bytes'] / 2**20:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
