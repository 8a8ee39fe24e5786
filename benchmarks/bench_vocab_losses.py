"""Peak memory and time of the vocabulary losses on the CPU: today's materialised logits against ``HeadLogits``.

Per loss (CE, full KL at T=1, top-k KL renorm and other, sampled KL) and side, one process builds a student's last
hidden state ``[N, d]`` and LM head ``[V, d]`` (and the teacher's targets), then runs forward + backward:

* ``materialised``: ``logits = F.linear(h, W)`` as the model's head does, then the loss on ``[1, N, V]`` logits;
* ``head``: the same loss on ``HeadLogits(h, W)`` (chunks of the head recomputed in backward).

``--losses ce_topk_renorm,ce_topk_other`` times a step's CE + top-k KL together, as ``CompoundLoss`` forms them
(one pass over the LM head for both since issue 31).

Peak memory is the process's peak RSS (``VmHWM``, reset once the inputs exist) above its RSS then (CUDA: the
peak allocated); time is the best of three passes in the process, and the best over ``--repeats`` processes, the
two sides alternating.

Usage: ``python benchmarks/bench_vocab_losses.py [--tokens 512 --dim 256 --vocab 128256 --repeats 3]``;
prints a markdown table and JSON.
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
LOSSES = ("ce", "kl", "topk_renorm", "topk_other", "sampled")
# CE + top-k KL as a step combines them (CompoundLoss, alpha = beta = 1): one pass over the LM head since issue 31.
PAIRS = ("ce_topk_renorm", "ce_topk_other")
# On CUDA, "head" takes the fused Triton kernel (issue 42) or liger-kernel's CE, and "head_chunks" the pure-torch
# chunks (today's road before them).
SIDES = ("materialised", "head")
TOP_K, DRAWS = 128, 12


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset through ``/proc/self/clear_refs``."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _inputs(tokens: int, dim: int, vocab: int, device: str, dtype: str) -> dict[str, Any]:
    """Targets as the loss takes them (float32 on the device, ``to_device``'s job), the student in ``dtype``."""
    import torch

    # Built on the device: at V = 128,256 the teacher's logits are 2 GB of float32, slow to draw and sort on a host.
    g = torch.Generator(device=device).manual_seed(0)
    teacher = torch.randn(1, tokens, vocab, generator=g, device=device)
    values, ids = teacher.topk(TOP_K, dim=-1)
    on = {"generator": g, "device": device}
    x = {"h": torch.randn(1, tokens, dim, **on) / dim**0.5, "w": torch.randn(vocab, dim, **on),
         "ids": torch.randint(0, vocab, (1, tokens), **on), "mask": torch.ones(1, tokens, dtype=torch.long,
                                                                              device=device),
         "teacher": teacher, "values": values, "topk_ids": ids.int(), "lse": torch.logsumexp(teacher, -1),
         "draws": torch.randint(0, vocab, (1, tokens, DRAWS), **on).sort(-1).values,
         "counts": torch.ones(1, tokens, DRAWS, dtype=torch.uint8, device=device),
         "logp": -torch.rand(1, tokens, DRAWS, **on) * 5}
    for k in ("h", "w"):
        x[k] = x[k].to(getattr(torch, dtype)).requires_grad_(True)
    return x


def _loss(name: str, logits: Any, x: dict[str, Any]) -> Any:
    from kdcache.stages.targets.logits.full_torch import kd_kl
    from kdcache.stages.targets.logits.sampled_torch import sampled_kl
    from kdcache.stages.targets.logits.topk_torch import topk_kl
    from kdcache.stages.train.losses.logits import causal_ce

    if name in PAIRS:
        return _step_loss(name.split("_")[-1], logits, x)
    if name == "ce":
        return causal_ce(logits, x["ids"], x["mask"])
    if name == "kl":
        return kd_kl(logits, x["teacher"], x["mask"])
    if name.startswith("topk"):
        return topk_kl(logits, x["values"], x["topk_ids"], x["mask"], x["lse"], variant=name.split("_")[1])
    return sampled_kl(logits, x["draws"], x["counts"], x["logp"], x["mask"])


def _step_loss(variant: str, logits: Any, x: dict[str, Any]) -> Any:
    """CE + top-k KL of ``variant`` as ``CompoundLoss`` forms a step's loss from them."""
    from types import SimpleNamespace

    from kdcache.stages.common.option_groups import assemble
    from kdcache.stages.train.core.options import LossOptions
    from kdcache.stages.train.objective.compound import CompoundLoss

    targets = {"input_ids": x["ids"].float(), "logits/topk_values": x["values"], "logits/topk_ids": x["topk_ids"],
               "logits/lse": x["lse"]}
    options = assemble(LossOptions, {"alpha": 1.0, "beta": 1.0, "topk_kl": variant, "temperature": 1.0})
    return CompoundLoss(options)(SimpleNamespace(logits=logits), targets, x["mask"])["loss"]


def run_one(name: str, side: str, tokens: int, dim: int, vocab: int, device: str = "cpu",
            dtype: str = "float32") -> dict[str, Any]:
    """One loss on one side in this process: peak memory above the inputs (RSS on the CPU, allocated on CUDA), the
    best time of three passes, and the loss value."""
    import torch
    import torch.nn.functional as F

    from kdcache.stages.targets.logits.vocab import kernel_guard
    from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
    from kdcache.stages.train.losses import logits as logit_losses

    # "head" on CUDA takes the fused kernel on `fused`: a kernel failing its check stops the run, never timing the
    # pure-torch pass under the kernel's name. "head_chunks" takes the pure-torch chunks even where liger-kernel or
    # the fused kernel would run.
    kernel_guard.set_road("fused" if side == "head" and device.startswith("cuda") else "auto")
    if side == "head_chunks":
        logit_losses.fused_ce_available = lambda device: False  # type: ignore[assignment]
        kernel_guard.set_road("torch")
    x = _inputs(tokens, dim, vocab, device, dtype)
    if name != "kl":
        del x["teacher"]  # only the full KL reads the teacher's full logits: the others' inputs stay small
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if not cuda:  # the peak so far counts building the inputs (the full teacher logits): reset it (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    base = torch.cuda.memory_allocated() if cuda else _rss()
    times, value = [], 0.0
    for _ in range(3):
        start = time.perf_counter()
        logits = F.linear(x["h"], x["w"]) if side == "materialised" else HeadLogits(x["h"], x["w"])
        loss = _loss(name, logits, x)
        loss.backward()
        del logits
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        value = float(loss)
        x["h"].grad = x["w"].grad = None
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss()
    return {"loss": name, "side": side, "peak_bytes": peak - base, "seconds": min(times), "value": value}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"also {', '.join(PAIRS)}")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="the student's dtype (bfloat16 as DeepSpeed's bf16)")
    parser.add_argument("--sides", default=",".join(SIDES), help="also head_chunks on CUDA (no fused kernel)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", nargs=2, metavar=("LOSS", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one, args.tokens, args.dim, args.vocab, args.device, args.dtype)),
              flush=True)
        return
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for repeat in range(args.repeats):
        for name in args.losses.split(","):
            sides = args.sides.split(",")
            for side in (sides if repeat % 2 == 0 else sides[::-1]):  # alternate which side runs first
                r = _subprocess(name, side, args)
                key = (name, side)
                best[key] = r if key not in best else {**r, "seconds": min(r["seconds"], best[key]["seconds"]),
                                                       "peak_bytes": min(r["peak_bytes"], best[key]["peak_bytes"])}
                if args.json:  # row by row: a run cut off by a time limit keeps what it measured
                    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [*best.values()]}, indent=1))
    print(_table(best, args))
    print(json.dumps([*best.values()]))


def _subprocess(name: str, side: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", name, side, "--tokens", str(args.tokens), "--dim", str(args.dim),
           "--vocab", str(args.vocab), "--device", args.device, "--dtype", args.dtype]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{name} {side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _table(best: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace) -> str:
    rows = [f"N = {args.tokens} tokens, d = {args.dim}, V = {args.vocab:,}, {args.dtype} on {args.device}; forward + "
            f"backward, best of {args.repeats} processes", "",
            "| loss | side | peak (MiB) | × today | time (s) | × today | value |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.losses.split(","):
        today = best.get((name, "materialised"), best[(name, args.sides.split(",")[0])])
        for side in args.sides.split(","):
            r = best[(name, side)]
            rows.append(f"| {name} | {side} | {r['peak_bytes'] / 2**20:.0f} | "
                        f"{r['peak_bytes'] / max(today['peak_bytes'], 1):.2f} | {r['seconds']:.3f} | "
                        f"{r['seconds'] / today['seconds']:.2f} | {r['value']:.5g} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
