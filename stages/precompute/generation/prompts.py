"""The prompts of ``kdcache generate``: a dataset's plain texts, or its conversations rendered with the chat
template and its generation prompt, as token ids in dataset order (prompt ``i`` is dataset row ``i``: what a
response's draws are keyed by, so the order never depends on batches or ranks).

A conversation that already ends with the assistant's turn is cut before that turn: the teacher writes its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.plan import RowSetup
from kdcache.stages.precompute.rows.chat import check_conversation, render
from kdcache.stages.precompute.rows.data import load_texts, text_template
from kdcache.storage import hash_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompts:
    """Prompt ids in dataset order, and what the generated dataset repeats of each.

    Attributes:
        ids: one int32 ``[P_i]`` array per prompt.
        messages: per prompt its conversation before the reply (chat data), else None.
        texts: per prompt the text the ids encode (rendered, for chat data).
        fingerprint: the data fingerprint (source, split, column, template hash, the ids' hash and count).
    """

    ids: list[np.ndarray]
    messages: list[list[dict[str, Any]]] | None
    texts: list[str]
    fingerprint: dict[str, Any]

    def __len__(self) -> int:
        return len(self.ids)


def load_prompts(setup: RowSetup, tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """Read, render and tokenize every prompt (``--max-sequences`` caps their number).

    Raises:
        PrecomputeError: a missing column or template, a bad conversation, a blank prompt or one longer than
            ``--max-length`` tokens (naming its row), or no prompt at all.
    """
    template = text_template(tokenizer, setup)  # refuses chat data without a template
    ds = load_texts(setup)
    count = len(ds) if setup.max_sequences is None else min(len(ds), setup.max_sequences)
    column = setup.messages_column or setup.text_column
    values = ds[column][:count]
    messages = [_prompt_turns(row, value) for row, value in enumerate(values)] if template else None
    texts = [render(row, m, template, tokenizer, prompt=True)[0] for row, m in enumerate(messages)] \
        if template and messages is not None else ["" if v is None else str(v) for v in values]
    encoded = tokenizer(texts, add_special_tokens=template is None)["input_ids"]
    ids = [np.asarray(row, dtype=np.int32) for row in encoded]
    for row, (text, row_ids) in enumerate(zip(texts, ids)):
        _check_prompt(row, text, row_ids, setup.max_length)
    return Prompts(ids, messages, texts, _fingerprint(setup, tokenizer, ids, template))


def _prompt_turns(row: int, value: object) -> list[dict[str, Any]]:
    """A conversation up to the reply the teacher writes (a trailing assistant turn is dropped)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        value = value[:-1]
    if isinstance(value, list) and value:  # check_conversation wants a reply: checked with a stand-in one
        turns = check_conversation(row, [*value, {"role": "assistant", "content": ""}])
        return turns[:-1]
    return check_conversation(row, value)


def _check_prompt(row: int, text: str, ids: np.ndarray, limit: int) -> None:
    if not text.strip() or not len(ids):
        raise PrecomputeError(f"row {row}: the prompt is blank; remove the row")
    if len(ids) > limit:
        raise PrecomputeError(f"row {row}: the prompt is {len(ids)} tokens long, longer than --max-length {limit}; "
                              f"raise --max-length or shorten the prompt (it is never cut: the response would "
                              f"answer another question)")


def _fingerprint(setup: RowSetup, tokenizer: PreTrainedTokenizerBase, ids: list[np.ndarray],
                 template: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"source": setup.data, "split": setup.split, "text_column": setup.text_column,
                           "prompts": len(ids), "prompt_ids_hash": hash_bytes(
                               b"".join(np.asarray([len(a)], np.int64).tobytes() + a.tobytes() for a in ids))}
    if template is not None:
        out.update(text_column=None, messages_column=setup.messages_column,
                   chat_template_hash=hash_bytes(str(tokenizer.chat_template).encode()))
    return out
