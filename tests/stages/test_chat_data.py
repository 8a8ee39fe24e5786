"""Chat conversations: templates render them, assistant tokens carry the loss mask, every loss honours it (issue 13).

A tiny random Llama with a locally trained tokenizer holding chat markers; the templates are written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.common.option_groups import assemble
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan
from kdcache.stages.precompute.rows.chat import render
from kdcache.stages.precompute.rows.row_build import text_streams
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.feed.streaming import collate, to_device
from kdcache.stages.train.objective.compound import CompoundLoss
from kdcache.stages.train.objective.distill import student_inputs
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import make_tiny_llama, sample_texts

MARKERS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# ChatML as Qwen and others write it (no generation tags), and the same with tags.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TAGGED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                 "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's layout: BOS, headers, content trimmed, <|eot_id|> closing each turn.
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "chatml-tagged": (CHATML_TAGGED, "<|im_end|>"),
             "llama3": (LLAMA3, "<|eot_id|>")}


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("chat-llama"), specials=MARKERS, positions=512)


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Multi-turn conversations with a system prompt; every other one has a second exchange."""
    texts = sample_texts(4 * count, seed=seed)
    out = []
    for i in range(count):
        turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": texts[4 * i]},
                 {"role": "assistant", "content": texts[4 * i + 1]}]
        if i % 2:
            turns += [{"role": "user", "content": texts[4 * i + 2]}, {"role": "assistant", "content": texts[4 * i + 3]}]
        out.append(turns)
    return out


def write_chats(path: Path, chats: list[Any]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def chat_options(tmp_path: Path, teacher: Path, template: str, chats: list[Any], **overrides: Any) -> PrecomputeOptions:
    (tmp_path / "template.jinja").write_text(template)
    opts = dict(teacher=str(teacher), data=str(write_chats(tmp_path / "chats.jsonl", chats)), out=str(tmp_path / "cache"),
                messages_column="messages", chat_template=str(tmp_path / "template.jinja"), max_length=512,
                batch_size=4, sequences_per_shard=4, progress=False)
    return PrecomputeOptions.of(**{**opts, **overrides})


def masked_runs(ids: np.ndarray, mask: np.ndarray, tokenizer: Any) -> list[str]:
    """The text of each maximal run of trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_assistant_tokens_are_exactly_the_assistant_messages(name: str, chat_teacher: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template, end = TEMPLATES[name]
    chats = conversations(6)
    options = chat_options(tmp_path, chat_teacher, template, chats)
    tokenizer = AutoTokenizer.from_pretrained(str(chat_teacher))
    setup = PrecomputePlan.of(options).rows
    rows = text_streams(setup, tokenizer)  # the row table stage one builds
    assert len(rows) == len(chats)
    for ids, mask, chat in zip(rows.ids[""], rows.tokens["loss_mask"], chats):
        wanted = [m["content"] + end for m in chat if m["role"] == "assistant"]
        assert masked_runs(ids, mask, tokenizer) == wanted
        assert tokenizer.decode(ids.tolist()).count("Answer briefly.") == 1  # the context is all there


def _user_and_assistant_tokens(chat: list[dict[str, str]], tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token positions inside the first user message's content and inside the first assistant reply's."""
    text, _ = render(0, chat, CHATML, tokenizer)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

    def inside(content: str) -> list[int]:
        start = text.index(content)
        return [i for i, (a, b) in enumerate(offsets) if a >= start and b <= start + len(content)]
    return inside(chat[1]["content"]), inside(chat[2]["content"])


def test_user_turn_targets_change_no_loss_and_assistant_targets_do(chat_teacher: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chats = conversations(4, seed=2)
    run_precompute(chat_options(tmp_path, chat_teacher, CHATML, chats, features=("hidden", "attention", "logits"),
                                layers=("1", "3"), top_k=8))
    reader = CacheReader(tmp_path / "cache")
    batch = to_device(collate([reader[i] for i in range(len(reader))], range(len(reader))), "cpu")
    student = make_tiny_llama(tmp_path / "student", specials=MARKERS, positions=512, seed=7)
    model = AutoModelForCausalLM.from_pretrained(str(student), attn_implementation="eager").eval()
    options = assemble(LossOptions, {"gamma": 1.0, "delta": 1.0, "topk_kl": "other", "temperature": 1.0})
    loss = CompoundLoss(options, layer_map=[(1, 1), (3, 3)], student_dim=32, teacher_dim=32)
    with torch.no_grad():
        out = model(**student_inputs(model, batch), output_hidden_states=True, output_attentions=True)

    def terms(targets: dict[str, torch.Tensor]) -> dict[str, float]:
        with torch.no_grad():
            return {k: float(v) for k, v in loss(out, targets, batch["mask"]).items()}

    tokenizer = AutoTokenizer.from_pretrained(str(chat_teacher))
    user, reply = _user_and_assistant_tokens(chats[0], tokenizer)
    text, _ = render(0, chats[0], CHATML, tokenizer)  # the positions index the cached row itself
    assert reader[0]["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    base = terms(batch)
    for positions, changes in ((user, False), (reply[1:2], True)):
        for name, term in (("hidden/1", "hidden"), ("attention/3", "attention"), ("logits/topk_values", "topk_kl")):
            changed = dict(batch)
            changed[name] = batch[name].clone()
            if name.startswith("attention"):
                changed[name][0, :, positions] = torch.roll(changed[name][0, :, positions], 1, dims=-1)
            else:
                changed[name][0, positions] += 3.0
            assert (terms(changed)[term] != base[term]) == changes, (name, positions)


@pytest.mark.parametrize("chats, template, wanted", [
    ([{"role": "user"}], CHATML, "row 0: messages must be a non-empty list of {role, content} dicts"),
    ([[{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]], CHATML, "row 0: unknown role 'robot'"),
    ([[{"role": "user", "content": "hi"}]], CHATML, "row 0: the conversation has no assistant turn"),
    ([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]],
     "{{ raise_exception('only two turns') }}", "row 0: the chat template cannot render this conversation"),
    ([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]], None,
     "has no chat template, so --messages-column cannot be rendered; supply one with --chat-template FILE"),
])
def test_bad_conversations_are_refused_naming_the_row(chats: list[Any], template: str | None, wanted: str,
                                                      chat_teacher: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = write_chats(tmp_path / "chats.jsonl", [chats[0]] if isinstance(chats[0], list) else [chats])
    argv = ["precompute", "--teacher", str(chat_teacher), "--data", str(data), "--out", str(tmp_path / "cache"),
            "--messages-column", "messages", "--no-progress"]
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        argv += ["--chat-template", str(tmp_path / "t.jinja")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert wanted in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_a_reply_beyond_max_length_skips_the_row_and_says_so(chat_teacher: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    long_question = [{"role": "user", "content": " ".join(sample_texts(6))}, {"role": "assistant", "content": "Yes."}]
    short = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]
    (tmp_path / "t.jinja").write_text(CHATML)
    argv = ["precompute", "--teacher", str(chat_teacher), "--data", str(write_chats(tmp_path / "c.jsonl",
            [long_question, short])), "--out", str(tmp_path / "cache"), "--messages-column", "messages",
            "--chat-template", str(tmp_path / "t.jinja"), "--max-length", "40", "--no-progress"]
    assert main(argv) == 0
    assert "rows skipped: 0 blank, 1 with no trained token within --max-length" in capsys.readouterr().out
    assert len(CacheReader(tmp_path / "cache")) == 1


def test_a_micro_batch_with_no_trained_token_adds_nothing() -> None:
    """A batch whose loss mask is all zeros (it can only be a rare one) contributes 0 to every term and keeps the
    graph, instead of stopping the run."""
    from types import SimpleNamespace

    logits = torch.randn(2, 3, 5, requires_grad=True)
    states = [torch.randn(2, 3, 4, requires_grad=True) for _ in range(2)]
    out = SimpleNamespace(logits=logits, hidden_states=states)
    targets = {"input_ids": torch.randint(0, 5, (2, 3)), "hidden/1": torch.randn(2, 3, 4),
               "logits/full": torch.randn(2, 3, 5), "loss_mask": torch.zeros(2, 3)}
    loss = CompoundLoss(assemble(LossOptions, {"gamma": 1.0, "temperature": 1.0}), layer_map=[(1, 1)], student_dim=4,
                        teacher_dim=4)
    terms = loss(out, targets, torch.ones(2, 3))
    assert float(terms["loss"].detach()) == 0.0 and {"ce", "kl", "hidden"} <= set(terms)
    terms["loss"].backward()
    assert float(logits.grad.abs().sum()) == 0.0
    targets["loss_mask"] = torch.tensor([[0, 1, 1], [0, 0, 0]])
    assert float(loss(out, targets, torch.ones(2, 3))["kl"].detach()) > 0
    # A top-k cache logs the same term names for an empty batch as for a full one: ranks all-reduce them by name.
    topk = {"input_ids": targets["input_ids"], "hidden/1": targets["hidden/1"],
            "logits/topk_values": torch.randn(2, 3, 2).sort(-1, descending=True).values,
            "logits/topk_ids": torch.randint(0, 5, (2, 3, 2)), "logits/lse": torch.randn(2, 3)}
    full_batch = set(loss(out, {**topk, "loss_mask": torch.ones(2, 3)}, torch.ones(2, 3)))
    assert set(loss(out, {**topk, "loss_mask": torch.zeros(2, 3)}, torch.ones(2, 3))) == full_batch


def test_a_template_that_prints_the_date_renders_the_same_any_day(chat_teacher: Path) -> None:
    from transformers import AutoTokenizer

    dated = "Today: {{ strftime_now('%d %b %Y') }}\n" + CHATML
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text, spans = render(0, chat, dated, AutoTokenizer.from_pretrained(str(chat_teacher)))
    assert text.startswith("Today: 26 Jul 2024\n") and [text[a:b] for a, b in spans] == ["Hello.<|im_end|>"]
