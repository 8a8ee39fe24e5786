"""What one rank of stage one pays before the teacher's first batch (issue 26): load the JSONL, tokenize, build
rows, fingerprint; at ~1 M and ~10 M tokens, plain text and chats packed with documents kept apart.

Three ways, side by side, each in a fresh process (its own ``datasets`` cache, so loading the JSONL is paid):

- ``in-memory``: what every rank did before: tokenize in batches of 1,000 and pack every row into Python lists of
  arrays (``in_memory_rows`` here, the former ``data.tokenize``), and hash them;
- ``build``: the row table built once per cache (``row_build.text_streams``; tokenized over ``--workers``
  processes), then the rank's first shard read;
- ``open``: a rank that finds the rows built (another rank, a job-array part or a rerun did it): open the memory
  map, read its first shard.

Reported: wall seconds, tokens/s, and peak RSS growth over the process's state after imports and the tokenizer
(``ru_maxrss``; ``workers`` is the largest tokenizing child's peak). Then two ranks under torchrun over a fresh
cache: each rank's wall and CPU seconds before its first shard, and which one built.

Tiny Llama tokenizer (byte-level BPE, 320 ids), ``--max-length 64``. Run:
``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_data.py [--sizes 1,10] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.tiny_models import SENTENCES, make_tiny_llama  # noqa: E402

TOKENS_PER_ROW = {"text": 33, "chat": 86}  # measured under the tiny tokenizer (text truncated at 64)
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"


def write_data(path: Path, rows: int, chat: bool, seed: int = 0) -> Path:
    """``rows`` JSONL rows of varied sentences, as plain ``text`` or a user/assistant conversation."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(rows):
            words = " ".join(rng.sample(SENTENCES, rng.randint(1, 3))).split()
            text = " ".join(words[:rng.randint(2, len(words))])
            row = {"messages": [{"role": "user", "content": text[:40]}, {"role": "assistant", "content": text}]} \
                if chat else {"text": text}
            fh.write(json.dumps(row) + "\n")
    return path


def child(args: argparse.Namespace) -> None:
    """One measurement in this process; prints a JSON line."""
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.core.plan import PrecomputePlan
    from kdcache.stages.precompute.rows.data import load_texts
    from kdcache.stages.precompute.rows.row_build import text_streams
    from kdcache.stages.precompute.teacher import load_tokenizer
    from kdcache.storage import hash_arrays

    template = Path(args.teacher) / "chat.jinja"
    template.write_text(TEMPLATE)
    extra = {"messages_column": "messages", "packing": "documents", "chat_template": str(template)} \
        if args.chat else {}
    options = PrecomputeOptions.of(teacher=args.teacher, data=args.data, out=args.out, max_length=64,
                                   tokenize_workers=args.workers, progress=False, **extra)
    plan = PrecomputePlan.of(options)
    tokenizer = load_tokenizer(plan.teacher)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started, cpu = time.perf_counter(), time.process_time()
    if args.mode == "in-memory":
        ids, masks = in_memory_rows(load_texts(plan.rows), tokenizer, plan.rows)
        hashes = [hash_arrays(ids), hash_arrays(masks)]
        tokens, built = sum(len(r) for r in ids), True
        first = ids[:256]
        del hashes
    else:
        data = text_streams(plan.rows, tokenizer)
        tokens, built = sum(data.meta["tokens"].values()), data.built
        first = data.ids[""][:256]  # the rank's first shard
    sum(int(a.sum()) for a in first)
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"mode": args.mode, "tokens": tokens, "built": built, "seconds": round(wall, 2),
                      "cpu_seconds": round(time.process_time() - cpu, 2), "rank": int(os.environ.get("RANK", 0)),
                      "rss_growth_mib": round((peak - base) / 1024, 1), "workers_peak_mib": round(kids / 1024, 1)}))


def in_memory_rows(ds: Any, tokenizer: Any, setup: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every row's ids and loss mask held in memory: the path each rank took before the row table (issue 26)."""
    from kdcache.stages.precompute.rows.data import documents, encode_batch, text_template
    from kdcache.stages.precompute.rows.packing import RowCounts, iter_rows

    template = text_template(tokenizer, setup)
    batches = ((ds[i:i + 1000], list(range(i, min(i + 1000, len(ds))))) for i in range(0, len(ds), 1000))
    docs = (doc for batch, index in batches
            for doc in documents(encode_batch(batch, index, tokenizer=tokenizer, setup=setup, template=template)))
    rows = list(iter_rows(docs, RowCounts(), setup.packing, setup.max_length, tokenizer.eos_token_id,
                          setup.max_sequences))
    return [ids for ids, *_ in rows], [mask for _, mask, *_ in rows]


def measure(mode: str, teacher: Path, data: Path, out: Path, chat: bool, workers: int, scratch: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(scratch / f"hf-{mode}-{time.time_ns()}"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", mode, "--teacher", str(teacher), "--data", str(data),
           "--out", str(out), "--workers", str(workers), *(["--chat"] if chat else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def two_ranks(teacher: Path, data: Path, out: Path, workers: int, scratch: Path) -> list[dict]:
    env = {**os.environ, "HF_DATASETS_CACHE": str(scratch / "hf-ranks"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--child", "build", "--teacher", str(teacher), "--data", str(data), "--out", str(out),
           "--workers", str(workers)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10", help="millions of tokens")
    parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (0: the host's cores)")
    parser.add_argument("--kinds", default="text,chat")
    parser.add_argument("--child", choices=["in-memory", "build", "open"])
    parser.add_argument("--teacher")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--chat", action="store_true")
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    teacher = make_tiny_llama(scratch / "teacher")
    print(f"host: {len(os.sched_getaffinity(0))} cores; tokenize workers {args.workers}")
    for kind in args.kinds.split(","):
        for millions in (float(s) for s in args.sizes.split(",")):
            rows = int(millions * 1e6 / TOKENS_PER_ROW[kind])
            data = write_data(scratch / f"{kind}-{millions}.jsonl", rows, kind == "chat")
            out = scratch / f"cache-{kind}-{millions}"
            for mode in ("in-memory", "build", "open"):
                r = measure(mode, teacher, data, out, kind == "chat", args.workers, scratch)
                print(f"{kind:4} {r['tokens'] / 1e6:5.2f} M tokens {mode:9}: {r['seconds']:7.2f} s "
                      f"({r['tokens'] / r['seconds'] / 1e3:7.0f} k tokens/s), rss +{r['rss_growth_mib']:6.1f} MiB, "
                      f"workers' peak {r['workers_peak_mib']:6.1f} MiB, built={r['built']}", flush=True)
    data = scratch / "text-1.0.jsonl"
    if data.exists():
        for r in two_ranks(teacher, data, scratch / "cache-ranks", args.workers, scratch):
            print(f"torchrun rank {r['rank']}: {r['seconds']:.2f} s wall, {r['cpu_seconds']:.2f} s CPU before its "
                  f"first shard, built={r['built']}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
