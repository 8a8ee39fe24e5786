"""Generation with capture vs bare ``model.generate`` (issue 58): tokens/s at the same batch and lengths.

A random GPT-2 (4 blocks, hidden 256, 8 heads, vocabulary 4,096: large enough that the forward, not Python,
dominates a step on a CPU) writes ``--new`` tokens after each of ``--batch`` prompts of ``--prompt`` tokens, two
ways, alternating, best of ``--repeats``:

* ``generate``: ``model.generate`` with sampling (temperature 1, top-p 0.95), no targets kept; EOS suppressed
  until the last token (``min_new_tokens``) so every row writes ``--new`` tokens;
* ``capture``: ``kdcache generate``'s decode loop (``generation.DecodeLoop``) with the same sampling and lengths
  (no end token), keeping what a default cache keeps (hidden layers 0, 2 and 4, top-64 logits with their
  logsumexp) as storage-ready arrays per row (fp16 on the host, padding cut): everything but the shard writes,
  which run in writer threads behind the teacher.

Tokens/s counts prompt and new tokens alike (what both forwards process; precompute counts the same way). The
capture's loop runs one forward more than ``generate`` (the last token's own, whose targets it keeps): 1/new of
the work. Run: ``.venv/bin/python benchmarks/bench_generate.py [--repeats 5] [--threads 2] [--json out.json]``; the GPU
check adds ``--device cuda --model 2048x16x32000`` (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kdcache.stages.precompute.core.plan import PrecomputePlan  # noqa: E402
from kdcache.stages.precompute.core.targets import resolve_targets  # noqa: E402
from kdcache.stages.precompute.core.teacher_id import Teacher  # noqa: E402
from kdcache.stages.precompute.generation.decode import DecodeLoop  # noqa: E402
from kdcache.stages.precompute.generation.options import GenerateOptions  # noqa: E402


def _teacher(folder: Path, shape: Shape) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.helpers.tiny_models import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(folder, vocab_size=400)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=shape.vocab, n_embd=shape.width, n_layer=shape.blocks, n_head=shape.width // 64,
                        n_positions=1024,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def _loop(folder: Path, new: int, shape: Shape) -> tuple[DecodeLoop, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    layers = tuple(str(i) for i in (0, shape.blocks // 2, shape.blocks))  # low, middle, last: 3 of them as on the CPU
    options = GenerateOptions.of(teacher=str(folder), data=str(folder / "config.json"), out=str(folder / "x"),
                                 layers=layers, features=("hidden", "logits"), top_k=64,
                                 max_new_tokens=new, temperature=1.0, top_p=0.95)
    pre = options.precompute
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=shape.dtype).to(shape.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    teacher = Teacher(model, tokenizer, model.config, torch.device(shape.device), {}, "sdpa")
    targets = replace(resolve_targets(pre, model.config), vocab_size=shape.vocab)
    write = PrecomputePlan.of(pre).write
    loop = DecodeLoop(teacher, targets, write.dtype, write.hidden_codec, options.generation.sampling(0))
    loop.eos = frozenset()  # every row writes --new tokens, as generate does with min_new_tokens
    return loop, model


@dataclass(frozen=True)
class Shape:
    """The teacher and where it runs: the CPU default is the small GPT-2 above; the GPU check passes a wider one."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    width: int = 256
    blocks: int = 4
    vocab: int = 4096


def _time(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a GPU's queued work counts in the side that queued it
    return time.perf_counter() - started


def run(batch: int, prompt: int, new: int, repeats: int, shape: Shape = Shape()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        loop, model = _loop(_teacher(Path(tmp), shape), new, shape)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, shape.vocab, size=prompt).astype(np.int32) for _ in range(batch)]
        ids = torch.from_numpy(np.stack(prompts).astype(np.int64)).to(shape.device)

        def bare() -> None:
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=True, top_p=0.95, temperature=1.0, top_k=0,
                                     pad_token_id=model.config.pad_token_id)
            assert out.shape[1] == prompt + new

        def capture() -> None:
            decoded = loop.run(prompts, [(i, 0) for i in range(batch)])
            assert all(len(x) == prompt + new for x in decoded.ids)

        bare(), capture()  # warm-up
        times: dict[str, list[float]] = {"generate": [], "capture": []}
        for _ in range(repeats):
            times["generate"].append(_time(bare))
            times["capture"].append(_time(capture))
    tokens = batch * (prompt + new)
    rates = {k: tokens / min(v) for k, v in times.items()}
    return {"batch": batch, "prompt": prompt, "new": new, "tokens": tokens, "device": shape.device,
            "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "tokens_per_second": {k: round(v, 1) for k, v in rates.items()},
            "ratio": round(rates["capture"] / rates["generate"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="8x32x64,1x32x64,16x64x32", help="BATCHxPROMPTxNEW, comma-separated")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU check: bf16)")
    parser.add_argument("--model", default="256x4x4096", help="WIDTHxBLOCKSxVOCAB of the random GPT-2 teacher")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    width, blocks, vocab = (int(x) for x in args.model.split("x"))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model_shape = Shape(args.device, dtype, width, blocks, vocab)
    results = []
    for shape in args.shapes.split(","):
        batch, prompt, new = (int(x) for x in shape.split("x"))
        result = run(batch, prompt, new, args.repeats, model_shape)
        results.append(result)
        print(f"batch {batch}, prompt {prompt}, new {new}: generate {result['tokens_per_second']['generate']:,.0f} "
              f"tok/s, capture {result['tokens_per_second']['capture']:,.0f} tok/s, ratio {result['ratio']}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
