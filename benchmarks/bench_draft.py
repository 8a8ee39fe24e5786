"""One cache, two products (issue 59): acceptance length tau and speed-up of speculative decoding on the CPU.

The benchmark builds everything itself:

1. a tiny Llama target (8 blocks, d = 64) with a BPE tokenizer, trained briefly on stdlib docstring sentences so
   that its distribution has structure a draft can learn;
2. three caches of the training text with ``--layers draft --logits head``, hidden states as fp16, int8 and pca8
   (each cache's bytes per token measured from its shard files);
3. the KD student (a 2-block copy of the target, ``kdcache init-student``, trained with ``kdcache train`` from the
   fp16 cache) and an EAGLE-3 head per cache (``kdcache draft``, the same steps);
4. ``kdcache draft-eval`` on held-out sentences (greedy, K = 4): prompt lookup, the student, each head.

Speed-up is over the target alone WITH its key/value cache (one token per pass, as it serves without a draft):
the speculative side prefills once, verifies each chain of K drafted tokens in one pass over K+1 positions and
crops the rejected ones off its cache; the EAGLE-3 head and the KD student keep key/value caches of their own.
``draft-eval --repeats`` alternates the target alone with each drafter and keeps the best of each side; on a shared
machine the ratios, not the seconds, are the figures to read.

``--target large`` swaps step 1's target for a Llama of 12 blocks at d = 512 (32 M parameters): its cached decode
step costs several times a call into the one-layer head, where the default target's step costs about what any call
costs, so only there can a draft's tau turn into wall-clock time on the CPU. Everything else is built the same way
(the student keeps the target's first and last blocks).

``--profile`` adds, per drafter, where a speculative run's time goes: the drafter's calls, the target's verify
passes (K + 1 positions each), its prefill and cache crops, and the host's work between them (acceptance, joins),
against one cached target step of the target alone; in this process, one torch thread, one pass over the prompts.

Usage: ``python benchmarks/bench_draft.py [--target tiny|large --profile --work DIR --target-steps 400 --draft-steps 200
--prompts 24 --k 4 --repeats 3]``;
prints JSON and a markdown table. The GPU check runs it smaller, with ``--codecs fp16 --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CODECS = ("fp16", "int8", "pca8")
# The target's shape per --target: the default's step costs about a call; the large one's several draft calls.
TARGETS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 8, "hidden": 64, "heads": 4, "kv_heads": 4, "intermediate": 128},
    "large": {"layers": 12, "hidden": 512, "heads": 8, "kv_heads": 8, "intermediate": 1024},
}


def kdcache(*argv: str) -> str:
    """Run ``python -m kdcache ...``; its stdout."""
    print("kdcache", *argv[:1], file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "kdcache", *argv], check=True, cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return done.stdout


def train_target(work: Path, texts: list[str], steps: int, shape: dict[str, int]) -> Path:
    """A Llama of ``shape`` (``TARGETS``), trained ``steps`` AdamW steps of 16 sequences x 32 tokens on ``texts``."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import make_tiny_llama

    path = work / "target"
    if (path / "trained").exists():
        return path
    make_tiny_llama(path, **shape, vocab_size=512, texts=texts)
    from transformers import AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = [torch.tensor(tok(t)["input_ids"][:32]) for t in texts]
    opt, g = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        if step % 50 == 0:
            print(f"target step {step}", file=sys.stderr, flush=True)
        pick = torch.randint(len(ids), (16,), generator=g).tolist()
        batch = torch.nn.utils.rnn.pad_sequence([ids[i] for i in pick], batch_first=True, padding_value=-100)
        loss = model(input_ids=batch.clamp(min=0), labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path)
    (path / "trained").write_text(f"{float(loss):.4f}\n")
    return path


def build_cache(work: Path, target: Path, data: Path, codec: str, hidden: int) -> tuple[Path, float]:
    """A draft cache with hidden codec ``codec`` (pca8 codes all d PCA coefficients: ``--hidden-rank d``); its
    shard bytes per token."""
    from kdcache.storage import CacheReader

    out = work / f"cache-{codec}"
    if not (out / "manifest.json").exists():
        rank = ["--hidden-rank", str(hidden)] if codec == "pca8" else []
        kdcache("precompute", "--teacher", str(target), "--data", str(data), "--out", str(out), "--layers", "draft",
                "--features", "hidden,logits", "--logits", "head", "--hidden-codec", codec, *rank,
                "--max-length", "48", "--sequences-per-shard", "256", "--no-progress")
    size = sum(p.stat().st_size for p in (out / "shards").rglob("*") if p.is_file())
    return out, size / CacheReader(out).num_tokens


def train_student(work: Path, target: Path, cache: Path, steps: int, layers: int) -> Path:
    """The KD student: the target's first and last blocks, trained from the fp16 cache (CE + KL on the head)."""
    student, run = work / "student-init", work / "student-run"
    if not (run / "student").exists():
        kdcache("init-student", "--teacher", str(target), "--layers", f"1,{layers}", "--out", str(student))
        kdcache("train", "--cache", str(cache), "--student", str(student), "--out", str(run), "--max-steps",
                str(steps), "--batch-size", "8", "--gamma", "0", "--lr", "1e-3", "--quiet")
    return run / "student"


def train_head(work: Path, cache: Path, codec: str, steps: int) -> Path:
    out = work / f"eagle3-{codec}"
    if not (out / "config.json").exists():
        kdcache("draft", "--cache", str(cache), "--out", str(out), "--max-steps", str(steps), "--batch-size", "8",
                "--draft-vocab", "256", "--ttt-steps", "3", "--lr", "3e-3")
    return out


def evaluate(target: Path, prompts: Path, draft: Path | None, student: Path | None, args: argparse.Namespace
             ) -> dict[str, Any]:
    """``kdcache draft-eval`` greedy on the held-out prompts, with the given drafters."""
    extra = [*(["--draft", str(draft)] if draft else []), *(["--student", str(student)] if student else [])]
    return json.loads(kdcache("draft-eval", "--target", str(target), "--prompts", str(prompts), "-k", str(args.k),
                              "--max-new", str(args.max_new), "--prompt-tokens", "16", "--repeats",
                              str(args.repeats), *extra, "--device", args.device, "--json"))


class _Timed:
    """``inner`` with the seconds spent in each of its methods ``spans`` ({method: label}) added to ``clock``;
    every other attribute is the inner object's."""

    def __init__(self, inner: Any, spans: dict[str, str], clock: dict[str, float]):
        self._inner, self._spans, self._clock = inner, spans, clock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self._spans:
            return value

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return value(*args)
            finally:
                label = self._spans[name]
                self._clock[label] = self._clock.get(label, 0.0) + time.perf_counter() - start
        return timed


TARGET_SPANS = {"start": "prefill", "extend": "target passes", "crop": "crops"}
DRAFT_SPANS = {"propose": "draft calls"}


def profile(target: Path, prompts: Path, draft: Path, student: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per drafter: milliseconds per round in its calls, the verify pass, prefill and crops, and the host's rest;
    the target alone's milliseconds per cached step; tau and the speed-up of this one pass."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kdcache.stages.draft.decoding import Sampling, speculative_generate, target_generate
    from kdcache.stages.draft.drafters import Eagle3Drafter, HFTarget
    from kdcache.stages.draft.evaluation import EvalOptions, drafters_for, load_prompts

    options = EvalOptions(str(target), str(prompts), str(draft), str(student), args.k, args.max_new,
                          prompt_tokens=16, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = load_prompts(options, AutoTokenizer.from_pretrained(target))
    out: dict[str, Any] = {}
    with torch.inference_mode():
        alone: dict[str, float] = {}
        timed = _Timed(HFTarget(model), TARGET_SPANS, alone)
        tokens = sum(len(target_generate(timed, p, args.max_new, Sampling(0.0)).tokens) for p in ids)
        step_ms = 1e3 * alone["target passes"] / max(1, tokens - len(ids))  # the first token comes from prefill
        for drafter in drafters_for(options, model):
            layers = drafter.draft.shape.layers if isinstance(drafter, Eagle3Drafter) else None
            clock: dict[str, float] = {}
            start = time.perf_counter()
            spec, draws = _Timed(HFTarget(model, layers), TARGET_SPANS, clock), _Timed(drafter, DRAFT_SPANS, clock)
            runs = [speculative_generate(spec, draws, p, args.max_new, args.k, Sampling(0.0)) for p in ids]
            total = time.perf_counter() - start
            rounds = sum(len(g.rounds) for g in runs)
            clock["host"] = total - sum(clock.values())
            out[drafter.name] = {"ms_per_round": {k: round(1e3 * v / rounds, 3) for k, v in clock.items()},
                                 "tau": sum(kept + 1 for _, kept in (r for g in runs for r in g.rounds)) / rounds,
                                 "target_step_ms": round(step_ms, 3), "speedup": sum(alone.values()) / total}
    return out


def main() -> None:
    from kdcache.pipeline.demo_text import stdlib_sentences

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="tiny",
                        help="the target's shape (TARGETS): tiny (8 blocks, d = 64; the default) or large (12 "
                             "blocks, d = 512: a step that costs more than a draft call)")
    parser.add_argument("--work", default=None, help="default /tmp/kdcache-bench-draft, -large for --target large")
    parser.add_argument("--target-steps", type=int, default=400)
    parser.add_argument("--draft-steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, alternating; best kept")
    parser.add_argument("--codecs", default=",".join(CODECS), help="hidden codecs of the draft caches")
    parser.add_argument("--device", default="auto", help="draft-eval's --device (the GPU check: cuda)")
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--profile", action="store_true", help="also time each part of a round per drafter "
                                                               "(the fp16 head): draft calls, verify passes, host")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # a shared 2-core box: one thread per process wastes no time spinning
    shape = TARGETS[args.target]
    work = Path(args.work or "/tmp/kdcache-bench-draft" + ("" if args.target == "tiny" else f"-{args.target}"))
    work.mkdir(parents=True, exist_ok=True)
    texts = stdlib_sentences(limit=2400)
    train, held = texts[:2000], texts[2000:2000 + args.prompts]
    (work / "train.txt").write_text("\n".join(train) + "\n")
    (work / "prompts.txt").write_text("\n".join(held) + "\n")
    start = time.perf_counter()
    target = train_target(work, train, args.target_steps, shape)
    caches = {c: build_cache(work, target, work / "train.txt", c, shape["hidden"]) for c in args.codecs.split(",")}
    student = train_student(work, target, caches["fp16"][0], args.draft_steps, shape["layers"])
    rows: dict[str, Any] = {}
    for codec, (cache, per_token) in caches.items():
        head = train_head(work, cache, codec, args.draft_steps)
        report = evaluate(target, work / "prompts.txt", head, student if codec == "fp16" else None, args)
        for name, figures in report["drafters"].items():
            label = f"EAGLE-3 head ({codec} cache)" if name == "EAGLE-3 head" else name
            rows.setdefault(label, {**figures, "bytes_per_token": per_token if "EAGLE" in label else None})
    if args.profile:
        head = work / f"eagle3-{next(iter(caches))}"
        rows_profile = profile(target, work / "prompts.txt", head, student, args)
    result = {"load": os.getloadavg(), "target": {"name": args.target, **shape}, "k": args.k, "repeats": args.repeats,
              "seconds": time.perf_counter() - start, "rows": rows,
              "target_loss": (target / "trained").read_text().strip(),
              **({"profile": rows_profile} if args.profile else {})}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("| draft | tau | speed-up | accepted by position | cache bytes/token |\n|---|---|---|---|---|")
    for label, f in rows.items():
        per = " ".join(f"{a:.2f}" for a in f["per_position"] if a is not None)
        size = "" if f["bytes_per_token"] is None else f"{f['bytes_per_token']:.0f}"
        print(f"| {label} | {f['tau']:.2f} | {f['speedup']:.2f}x | {per} | {size} |")
    for name, f in result.get("profile", {}).items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in f["ms_per_round"].items())
        print(f"profile {name}: tau {f['tau']:.2f}, speed-up {f['speedup']:.2f}x; ms per round: {parts}; "
              f"target alone {f['target_step_ms']:.2f} ms per step")


if __name__ == "__main__":
    main()
