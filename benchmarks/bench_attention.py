"""Attention targets as maps or as queries and keys (issue 23): stored bytes, and stage two's memory and time.

Bytes per token per layer, maps vs q/k, for a Llama-3-8B-shaped attention (32 query heads, 8 key/value heads,
head_dim 128) at L = 512, 2,048 and 4,096:

* from the spec's arithmetic (fp16, before compression): a map costs H x L values per token (H x (L+1)/2 as the
  causal triangle), queries and keys (H + H_kv) x head_dim whatever L;
* from a real write at L = 512: one random-weight block of that shape (hidden 4,096, a small MLP so it runs on a
  CPU) over random token ids; its triangle map (eager attention) and its q/k (stage two's recorder) written
  through the cache writer with the default codec, bytes read back from the manifest.

Stage two, one optimizer-free step (forward + backward) of a small random Llama student (2 blocks, hidden 64,
4 heads, 2 key/value heads) against a random Llama-shaped teacher's targets (8 heads, 2 key/value heads,
head_dim 16), batch 1, CE plus the attention KL of one block pair, three ways: the maps path (eager student
returning its maps, the teacher's [B, H, L, L] map as the target), the blocked q/k path (SDPA student, recorded
q/k, ``blocked_attention_kl``), and no attention loss (SDPA student, CE only). Each (path, L) runs in a fresh
process on one thread; peak memory is the growth of peak RSS during the step (Linux: the high-water mark is reset
first, after the targets exist; glibc's mmap threshold fixed at 64 KiB so that freed blocks leave the RSS), time
the best of the runs, paths alternating. Tiny widths so that it runs in minutes on a
2-core CPU: the L² terms dominate there as they do at full width.

Run: ``.venv/bin/python benchmarks/bench_attention.py [--repeats 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kdcache.storage import CacheSpec, CacheWriter, read_manifest  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
LENGTHS = (512, 2048, 4096)


def arithmetic(length: int) -> dict[str, float]:
    """fp16 bytes per token per layer before compression."""
    return {"maps_full": HEADS * length * 2, "maps_triangle": HEADS * (length + 1) / 2 * 2,
            "qk": (HEADS + KV_HEADS) * HEAD_DIM * 2, "qkv": (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2}


def _block() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=256,
                         max_position_embeddings=4096, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def _stored(spec: CacheSpec, item: dict[str, np.ndarray], length: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        writer = CacheWriter(root, spec, {})
        writer.write_shard(0, [item])
        writer.finalize()
        arrays = read_manifest(root).arrays
        return sum(a["stored_bytes"] for n, a in arrays.items() if n.startswith("attention")) / length


def written(length: int = 512) -> dict[str, float]:
    """Stored bytes per token of one block's triangle map and of its q/k, from a real write."""
    from kdcache.stages.targets.attention.qk_attention import QKRecorder

    model = _block()
    ids = torch.randint(0, 1024, (1, length))
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True, use_cache=False).attentions[0][0]
        recorder = QKRecorder(model, (1,), True)
        with recorder.forward():
            model(input_ids=ids, use_cache=False)
    q, k = (x[0].transpose(0, 1).reshape(length, -1).numpy() for x in (recorder.captured[1].q, recorder.captured[1].k))
    base = {"input_ids": ids[0].numpy()}
    spec_maps = CacheSpec(num_sequences=1, attention_layers=(1,), attention_triangle=True)
    scores = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "causal": True,
              "blocks": {"1": {"scaling": HEAD_DIM ** -0.5, "sliding_window": None, "softcap": None}}}
    spec_qk = CacheSpec(num_sequences=1, attention_layers=(1,), attention_source="qk", attention_scores=scores)
    return {"maps_triangle": _stored(spec_maps, {**base, "attention/1": maps.numpy()}, length),
            "qk": _stored(spec_qk, {**base, "attention_q/1": q, "attention_k/1": k}, length)}


STEP = """
import sys, time, torch
torch.set_num_threads(1)  # one core: the shared 2-core host thrashes with two threads per process
sys.path.insert(0, {root!r})
from transformers import LlamaConfig, LlamaForCausalLM
from kdcache.stages.targets.attention.qk_attention import QKRecorder, ScoreRule
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.train.losses.logits import causal_ce
from kdcache.stages.targets.attention.qk_attention import Captured
from kdcache.stages.targets.attention.qk_loss import blocked_attention_kl
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
torch.manual_seed(0)
L, path = {length}, {path!r}
def llama(hidden, heads, kv, attn):
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=2 * hidden, max_position_embeddings=L, attn_implementation=attn))
teacher = llama(128, 8, 2, "sdpa").eval()
ids = torch.randint(0, 512, (1, L))
mask = torch.ones_like(ids)
rec = QKRecorder(teacher, (2,), True)
with torch.no_grad(), rec.forward():
    teacher(input_ids=ids, use_cache=False)
t_side = Captured(rec.captured[2].q, rec.captured[2].k, rec.captured[2].rule)
if path == "maps":  # the batch as the maps path streams it: [B, H, L, L] fp32 on the device
    from kdcache.stages.targets.attention.qk_attention import allowed_keys, block_log_probs
    t_maps = block_log_probs(t_side.q, t_side.k, t_side.rule, allowed_keys(mask, slice(0, L), t_side.rule)).exp()
student = llama(64, 4, 2, "eager" if path == "maps" else "sdpa")
s_rec = QKRecorder(student, (2,), True) if path == "qk" else None
def step():
    student.zero_grad(set_to_none=True)
    if path == "qk":
        with s_rec.forward():
            out = student(input_ids=ids, use_cache=False)
        c = s_rec.captured[2]
        loss = causal_ce(out.logits, ids, mask) + blocked_attention_kl(Captured(c.q, c.k, c.rule), t_side, mask)
    elif path == "maps":
        out = student(input_ids=ids, use_cache=False, output_attentions=True)
        loss = causal_ce(out.logits, ids, mask) + attention_kl(out.attentions[1], t_maps, mask)
    else:
        out = student(input_ids=ids, use_cache=False)
        loss = causal_ce(out.logits, ids, mask)
    loss.backward()
step()  # warm-up
open("/proc/self/clear_refs", "w").write("5")
before, start = rss("VmRSS"), time.perf_counter()
step()
print((rss("VmHWM") - before) / 1024, time.perf_counter() - start)
"""


def train_step(path: str, length: int) -> tuple[float, float]:
    """(MiB of peak memory growth, seconds) of one student step on ``path`` at ``length``, in a fresh process."""
    code = STEP.format(root=str(Path(__file__).resolve().parents[1]), length=length, path=path)
    # glibc's dynamic mmap threshold would otherwise keep freed blocks of one size in the heap, so a loop of
    # same-sized temporaries (the blocks) shows as growing RSS although nothing stays alive; fix the threshold.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    mib, seconds = out.stdout.strip().splitlines()[-1].split()
    return float(mib), float(seconds)


def stage_two(repeats: int) -> list[dict[str, Any]]:
    """Best time and least peak per (path, L), paths alternating within each repeat."""
    runs = [("none", n) for n in (1024, 2048, 4096)] + [("maps", 1024), ("maps", 2048)] + \
        [("qk", n) for n in (1024, 2048, 4096)]
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(repeats):
        for key in runs:
            mib, seconds = train_step(*key)
            old = best.get(key, (float("inf"), float("inf")))
            best[key] = (min(old[0], mib), min(old[1], seconds))
    return [{"path": p, "length": n, "peak_mib": best[(p, n)][0], "step_s": best[(p, n)][1]} for p, n in runs]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    result: dict[str, Any] = {"arithmetic": {n: arithmetic(n) for n in LENGTHS}, "written_512": written()}
    print("bytes/token/layer (fp16, before compression): L, maps full, maps triangle, q/k, q/k/v")
    for n, row in result["arithmetic"].items():
        print(f"  {n:5d} {row['maps_full']:>10,.0f} {row['maps_triangle']:>10,.0f} {row['qk']:>7,.0f} {row['qkv']:>7,.0f}")
    print(f"stored at L=512 (real write): {result['written_512']}")
    result["stage_two"] = stage_two(args.repeats)
    for row in result["stage_two"]:
        print(f"  {row['path']:5s} L={row['length']:5d} peak +{row['peak_mib']:8.1f} MiB  step {row['step_s']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
