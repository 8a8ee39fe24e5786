"""A JSONL of conversations through precompute, train, eval and report with only --messages-column (issue 13)."""

from __future__ import annotations

from pathlib import Path

from kdcache.pipeline.cli import main
from kdcache.stages.train.evaluation.eval_records import read_evals
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.test_chat_data import CHATML, MARKERS, conversations, write_chats


def test_conversations_go_through_every_command(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    teacher = make_tiny_llama(tmp_path / "teacher", specials=MARKERS, positions=512)
    tokenizer = AutoTokenizer.from_pretrained(str(teacher))
    tokenizer.chat_template = CHATML  # a chat model ships its template with its tokenizer
    tokenizer.save_pretrained(str(teacher))
    data = write_chats(tmp_path / "chats.jsonl", conversations(16))
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(cache),
                 "--messages-column", "messages", "--no-progress"]) == 0
    reader = CacheReader(cache)
    assert reader.spec.token_arrays == ("loss_mask",) and len(reader) == 16
    trained = sum(int(reader[i]["loss_mask"].sum()) for i in range(len(reader)))
    assert 0 < trained < reader.num_tokens
    assert main(["init-student", "--teacher", str(teacher), "--layers", "2", "--out", str(tmp_path / "student")]) == 0
    assert main(["train", "--cache", str(cache), "--student", str(tmp_path / "student"), "--out", str(run),
                 "--max-steps", "3", "--batch-size", "2", "--gamma", "1", "--quiet"]) == 0
    assert main(["eval", "--cache", str(cache), "--run", str(run)]) == 0
    [evaluation] = [e for e in read_evals(run) if e["role"] == "trained"]
    # Scored on the assistant's tokens only, as trained.
    assert evaluation["tokens"] == trained and evaluation["predicted_tokens"] <= trained
    assert evaluation["perplexity"] > 1
    assert main(["report", str(run)]) == 0
    assert (run / "report" / "report.html").is_file()
