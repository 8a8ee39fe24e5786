"""Two students of one teacher (issue 58): distilled on the teacher's own responses or on the original text.

The teacher is a tiny GPT-2 (2 blocks, hidden 64) trained here for ``--teacher-steps`` on the test corpus's
sentences. Each sentence is cut into a prompt (its first ``--prompt-words`` words) and the rest. Two caches, then
two students (the teacher's block 1 plus embeddings and head, ``init-student``), each trained with the same
``--steps``, batch and loss (CE + top-k KL + hidden):

* ``own``: ``kdcache generate`` over the training prompts (temperature 1, ``--new`` new tokens); loss on the
  responses;
* ``text``: ``kdcache precompute`` over the original sentences of the same prompts; loss on every token.

Tokens trained are printed for both (the budget: same rows per step, same steps). Scored on held-out prompts:

* top-1 agreement and KL(teacher || student) per token on text the teacher wrote (sampled, seed fixed), over the
  response tokens;
* the teacher's mean per-token log-likelihood of each student's own greedy response (higher: closer to what the
  teacher would write).

Run: ``.venv/bin/python benchmarks/bench_generate_students.py [--steps 60] [--json out.json]``.
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

import torch  # noqa: E402

from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts, write_text_dataset  # noqa: E402

KDCACHE = str(Path(sys.executable).parent / "kdcache")


def _train_teacher(folder: Path, texts: list[str], steps: int) -> Path:
    """A tiny GPT-2 fitted to ``texts`` by plain next-token CE (batches of 16 sentences)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_gpt2(folder, layers=2, hidden=64, heads=4, positions=128, texts=texts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(texts), (16,), generator=generator).tolist()
        batch = tokenizer([texts[i] + tokenizer.eos_token for i in pick], return_tensors="pt", padding=True,
                          truncation=True, max_length=64)  # the caches' --max-length
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(folder)
    print(f"teacher: {steps} steps, last batch CE {loss.item():.3f}", flush=True)
    return folder


def _kdcache(*args: str, cwd: Path) -> None:
    proc = subprocess.run([KDCACHE, *args, "--quiet"], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"kdcache {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def _students(root: Path, prompts: list[str], texts: list[str], args: argparse.Namespace) -> dict[str, Path]:
    """The two caches and the two students trained on them (same steps, batch, losses)."""
    write_text_dataset(root / "prompts.jsonl", prompts)
    write_text_dataset(root / "texts.jsonl", texts)
    common = ["--teacher", "teacher", "--layers", "1,2", "--features", "hidden,logits", "--top-k", "16",
              "--max-length", "64"]
    _kdcache("generate", *common, "--data", "prompts.jsonl", "--text-column", "text", "--out", "cache-own",
             "--max-new-tokens", str(args.new), "--temperature", "1.0", cwd=root)
    _kdcache("precompute", *common, "--data", "texts.jsonl", "--text-column", "text", "--out", "cache-text",
             cwd=root)
    _kdcache("init-student", "--teacher", "teacher", "--layers", "1", "--out", "student-init", cwd=root)
    runs = {}
    for name in ("own", "text"):
        _kdcache("train", "--cache", f"cache-{name}", "--student", "student-init", "--out", f"run-{name}",
                 "--max-steps", str(args.steps), "--batch-size", "8", "--lr", "1e-3", cwd=root)
        runs[name] = root / f"run-{name}" / "student"
    return runs


def _trained_tokens(cache: Path) -> int:
    from kdcache.storage import CacheReader

    reader = CacheReader(cache)
    return int(sum(reader[i]["loss_mask"].sum() if "loss_mask" in reader[i] else len(reader[i]["input_ids"])
                   for i in range(len(reader))))


@torch.no_grad()
def _score(teacher: Any, student: Any, tokenizer: Any, prompts: list[str], new: int) -> dict[str, float]:
    """Top-1 agreement and KL(t||s) on the teacher's sampled responses; the teacher's mean log-likelihood per
    token of the student's greedy responses. Sums in float64."""
    agree = kl = count = 0.0
    loglik = words = 0.0
    torch.manual_seed(1)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        n = ids.shape[1]
        written = teacher.generate(ids, do_sample=True, max_new_tokens=new, pad_token_id=tokenizer.pad_token_id)
        t = teacher(written).logits[0, n - 1:-1].double().log_softmax(-1)  # [new, V]: predictions of the response
        s = student(written).logits[0, n - 1:-1].double().log_softmax(-1)
        agree += (t.argmax(-1) == s.argmax(-1)).sum().item()
        kl += (t.exp() * (t - s)).sum().item()
        count += t.shape[0]
        greedy = student.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=tokenizer.pad_token_id)
        scored = teacher(greedy).logits[0, n - 1:-1].double().log_softmax(-1)
        loglik += scored.gather(-1, greedy[0, n:, None]).sum().item()
        words += greedy.shape[1] - n
    return {"top1": agree / count, "kl": kl / count, "teacher_loglik": loglik / words}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--new", type=int, default=40)
    parser.add_argument("--prompt-words", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=480)
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    texts = sample_texts(args.sentences, seed=11)
    train = texts[:-args.held_out]  # the held-out sentences give only their prompts
    prompts = [" ".join(t.split()[:args.prompt_words]) for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _train_teacher(root / "teacher", train, args.teacher_steps)
        runs = _students(root, prompts[:-args.held_out], train, args)
        tokenizer = AutoTokenizer.from_pretrained(root / "teacher")
        teacher = AutoModelForCausalLM.from_pretrained(root / "teacher").eval()
        result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        for name, path in runs.items():
            student = AutoModelForCausalLM.from_pretrained(path).eval()
            result[name] = _score(teacher, student, tokenizer, prompts[-args.held_out:], args.new)
            result[name]["trained_tokens"] = _trained_tokens(root / f"cache-{name}")
            print(name, json.dumps(result[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
