"""Both stages on whatever GPU is present, against the limits the hardware sets.

The teacher is the shape of a 1.28 B Llama (d = 2,048, 16 layers, 16 heads / 8 kv heads, FFN 5,632, V = 128,256,
bf16, SDPA) with random weights, built from a ``LlamaConfig``; its tokenizer is a byte-level BPE trained here on
the test helpers' text (its ids are a subset of the embedding table's, which is all stage one needs). Rows are
2,048 tokens (``--packing concat``), batches of 8.

Stage one, as tokens/s of the compute phase (the summary's ``tokens_per_second``) and as ratios:

* the bare forward of the base model, and base + LM head + top-128 log-softmax over every token (the least stage
  one must do for logits: the reference of every ratio);
* ``precompute`` for logits only (top-128 log-probs), plus 4 fp16 hidden layers, int8, pca8, and q/k attention;
  and logits only again through ``--teacher-parallel tp:1`` (the parallel path with a group of one); and the
  hidden and q/k rows again with ``--writer-processes`` (no writer thread in the teacher's process), and with
  ``--compile-teacher`` (the forward through torch.compile);
* per row, ``forward_vs_base`` (the forward's seconds in the run over the bare base forward's for the same tokens)
  and ``host_cpu_s`` (CPU seconds of the process and its writer processes);
* the disk's write speed with fsync, measured in the same run, and what it allows for each cache's bytes/token.

Stage two (``benchmarks/gpu_stage_two.py``): the student alone, kdcache train with CE / CE + KL / everything, and
online KD, as tokens/s and peak memory.

Run: ``python benchmarks/bench_gpu.py [--tokens 511000] [--json out.json]``; ``--small`` runs the same code on a
tiny teacher, on the CPU if there is no GPU (a test does, so that it never rots).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The repository root, for tests.helpers (tokenizer, text) and benchmarks.*; appended, so that an installed kdcache
# (not the bare kdcache/ folder at the root) is the one imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FULL = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
        "intermediate_size": 5632, "vocab_size": 128_256, "max_position_embeddings": 2048}
SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 4096, "max_position_embeddings": 128}


def build_teacher(path: Path, small: bool, device: torch.device) -> Path:
    """A random Llama of the chosen shape in bf16 (fp32 on the CPU), saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_models import sample_texts, train_bpe_tokenizer

    shape = SMALL if small else FULL
    tokenizer = train_bpe_tokenizer(path, vocab_size=1000, add_bos=True, texts=sample_texts(2000))
    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    del model
    return path


def write_text(path: Path, tokens: int) -> Path:
    """A JSONL of sentences holding a little more than ``tokens`` tokens of the BPE above."""
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    return write_text_dataset(path, sample_texts(tokens // 6 + 1000, seed=3))  # >= 6 tokens a sentence


def disk_write_mb_s(folder: Path, mib: int = 1024) -> float:
    """MB/s of writing ``mib`` MiB in 64 MiB blocks, then fsync (what a shard commit does)."""
    block = os.urandom(64 << 20)
    target = folder / "disk-probe.bin"
    started = time.perf_counter()
    with open(target, "wb") as fh:
        for _ in range(max(1, mib // 64)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - started
    target.unlink()
    return max(1, mib // 64) * len(block) / seconds / 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_forward(teacher: Path, rows: int, length: int, device: torch.device, batch: int = 8) -> dict[str, float]:
    """tokens/s of the base model alone, and of base + head + top-128 log-softmax over every token, on random
    ids of the same batches as stage one's (padding-free rows of ``length``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(teacher), attn_implementation="sdpa").to(device).eval()
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (min(batch, rows - i), length), device=device) for i in range(0, rows, batch)]
    head = model.get_output_embeddings()

    base_model = model.base_model

    def base(ids: torch.Tensor) -> None:
        base_model(input_ids=ids, use_cache=False)

    def with_head(ids: torch.Tensor) -> None:
        last = base_model(input_ids=ids, use_cache=False).last_hidden_state.flatten(0, 1)
        for rows_ in last.split(4096):
            logits = head(rows_).float()
            torch.topk(logits, 128, dim=-1).values.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))

    out = {}
    with torch.inference_mode():
        for name, step in (("bare_forward", base), ("forward_head_topk", with_head)):
            for ids in batches[:2]:
                step(ids)  # warm-up: kernels chosen, memory pooled
            _sync(device)
            started = time.perf_counter()
            for ids in batches:
                step(ids)
            _sync(device)
            out[name] = sum(b.numel() for b in batches) / (time.perf_counter() - started)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def stage_one_configs(small: bool) -> dict[str, dict[str, Any]]:
    """Each stage-one row's options beside the common ones."""
    depth = SMALL["num_hidden_layers"] if small else FULL["num_hidden_layers"]
    layers = tuple(str(j) for j in range(depth // 4, depth + 1, depth // 4))
    width = SMALL["hidden_size"] if small else FULL["hidden_size"]
    hidden = {"layers": layers, "features": ("hidden", "logits")}
    return {
        "logits only": {"features": ("logits",)},
        "+4 hidden fp16": hidden,
        "+4 hidden int8": {**hidden, "hidden_codec": "int8"},
        # pca8's zstd-9 over row-shuffled codes is slow to compress (benchmarks/RESULTS.md): a quarter of the rows.
        "+4 hidden pca8": {**hidden, "hidden_codec": "pca8", "hidden_rank": width, "rows_share": 4},
        "+4 hidden fp16, q/k attention": {**hidden, "features": ("hidden", "attention", "logits"),
                                           "attention_source": "qk",
                                           "attention_layers": (layers[1], layers[3])},
        # The --teacher-parallel path with a group of one (beside "logits only": the same work). transformers
        # makes a one-rank tensor-parallel group a plain model, so this row measures kdcache's side of the path.
        "logits only, teacher-parallel tp:1": {"features": ("logits",), "teacher_parallel": "tp:1"},
        # The same rows with the shards written by worker processes (issue 43): no writer thread in the teacher's
        # process to hold the GIL its kernel launches wait for.
        "+4 hidden fp16, writer processes": {**hidden, "writer_processes": True},
        "+4 hidden int8, writer processes": {**hidden, "hidden_codec": "int8", "writer_processes": True},
        "+4 hidden pca8, writer processes": {**hidden, "hidden_codec": "pca8", "hidden_rank": width, "rows_share": 4,
                                             "writer_processes": True},
        "+4 hidden fp16, q/k attention, writer processes": {**hidden, "features": ("hidden", "attention", "logits"),
                                                             "attention_source": "qk",
                                                             "attention_layers": (layers[1], layers[3]),
                                                             "writer_processes": True},
        # The teacher through torch.compile (fused kernels, fewer launches), alone and with both changes.
        "logits only, compiled": {"features": ("logits",), "compile_teacher": True},
        "+4 hidden fp16, compiled, writer processes": {**hidden, "compile_teacher": True, "writer_processes": True},
    }


def stage_one_rows(teacher: Path, data: Path, work: Path, rows: int, length: int,
                   device: torch.device) -> list[dict[str, Any]]:
    """One precompute per configuration (its own cache folder, removed after), compute-phase tokens/s."""
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.runner import run_precompute

    out = []
    for name, extra in stage_one_configs(length < 2048).items():
        cache = work / "cache-s1"
        extra = dict(extra)
        share = int(extra.pop("rows_share", 1))
        options = PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(cache), packing="concat",
                                       max_length=length, max_sequences=max(8, rows // share), batch_size=8, top_k=128,
                                       topk_values="logprob", device=str(device), progress=False, **extra)
        if extra.get("compile_teacher"):  # compile once beforehand: a real run amortises it over hours
            run_precompute(replace(options, dataset=replace(options.dataset, max_sequences=8)))
            shutil.rmtree(cache, ignore_errors=True)
        used = _cpu_seconds()
        summary = run_precompute(options)
        out.append({"run": name, "host_cpu_s": round(_cpu_seconds() - used, 2), "tokens": summary["tokens"], "tokens_per_s": summary["tokens_per_second"],
                    "compute_s": summary["compute_seconds"], "forward_s": summary["forward_seconds"],
                    "writer_wait_s": summary["writer_wait_seconds"],
                    "take_s": summary["take_seconds"], "wall_s": summary["wall_seconds"],
                    "bytes_per_token": round(sum(summary["bytes_per_token"].values()), 1),
                    "bytes_written": summary["bytes_written"]})
        print(json.dumps(out[-1]), flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    return out


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished children (writer processes, tokenizers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def with_ratios(rows: list[dict[str, Any]], reference: float, disk_mb_s: float,
                base: float | None = None) -> list[dict[str, Any]]:
    """Each row's ratio to the forward + head reference, and to what the disk allows for its bytes/token; with the
    base model's tokens/s, ``forward_vs_base``: the teacher's forward time in the run over the bare base forward's
    for the same tokens (1.0: our hooks and the host cost the forward nothing)."""
    for row in rows:
        if base:
            row["forward_vs_base"] = round(row["forward_s"] / (row["tokens"] / base), 3)
        disk_limit = disk_mb_s * 1e6 / max(1.0, row["bytes_per_token"])
        row["vs_forward_head"] = round(row["tokens_per_s"] / reference, 3)
        row["disk_allows_tokens_per_s"] = round(disk_limit)
        row["vs_limit"] = round(row["tokens_per_s"] / min(reference, disk_limit), 3)
    return rows


def cache_for_stage_two(teacher: Path, data: Path, work: Path, rows: int, length: int, device: torch.device) -> Path:
    """The cache stage two reads: top-128 log-probs and 4 hidden layers."""
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.runner import run_precompute

    cache = work / "cache-s2"
    extra = stage_one_configs(length < 2048)["+4 hidden fp16"]
    run_precompute(PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(cache), packing="concat",
                                        max_length=length, max_sequences=rows, batch_size=8, top_k=128,
                                        topk_values="logprob", device=str(device), progress=False, **extra))
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny teacher, rows of 128 tokens (CPU-friendly)")
    parser.add_argument("--tokens", type=int, default=511_000, help="stage one's tokens per run")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--no-train", action="store_true", help="stage one only")
    parser.add_argument("--work", help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    length = SMALL["max_position_embeddings"] if args.small else 2048
    rows = max(8, args.tokens // length)
    with tempfile.TemporaryDirectory(prefix="kdcache-gpu-", dir=args.work) as tmp:
        work = Path(tmp)
        teacher = build_teacher(work / "teacher", args.small, device)
        data = write_text(work / "data.jsonl", rows * length)
        results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                   "host_cores": os.cpu_count(), "disk_write_mb_s": round(disk_write_mb_s(work), 1)}
        results["reference"] = bare_forward(teacher, rows, length, device)
        print(json.dumps(results), flush=True)
        reference = results["reference"]
        results["stage_one"] = with_ratios(stage_one_rows(teacher, data, work, rows, length, device),
                                           reference["forward_head_topk"], results["disk_write_mb_s"],
                                           reference["bare_forward"])
        if args.json:  # stage one's figures are kept even if stage two fails
            Path(args.json).write_text(json.dumps(results, indent=2))
        if not args.no_train:
            from benchmarks.gpu_stage_two import stage_two_rows

            cache = cache_for_stage_two(teacher, data, work, rows, length, device)
            results["stage_two"] = stage_two_rows(str(teacher), str(cache), str(work / "train"), small=args.small,
                                                  steps=args.train_steps, warmup=3)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
