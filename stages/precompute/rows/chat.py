"""Chat conversations as stage one reads them: rendered by the tokenizer's own chat template, with the character
spans of the assistant's turns (what a student is trained on).

A conversation is an OpenAI-style list of ``{"role", "content"}`` messages. Assistant spans come from the
template itself when it marks them with ``{% generation %} ... {% endgeneration %}`` (transformers' renderer
reports those spans), and otherwise by rendering prefixes: an assistant turn ``i`` spans from the end of
``messages[:i]`` rendered with the generation prompt to the end of ``messages[:i+1]``. That works for any template
that renders a conversation's prefix as a prefix of the whole, which is checked; templates that rewrite earlier
turns (some drop old reasoning) need the tags. Trailing whitespace of a span (the newline after an end-of-turn
token) is not the assistant's, so it is left out. Token masks follow from the spans in ``rows.span_mask``.

Templates that print today's date (Llama 3.1 and later, through ``strftime_now``) get a fixed one, ``CHAT_DATE``:
the rows of a cache must not depend on the day a job of its array, or its resume, ran.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kdcache.stages.precompute.core.errors import PrecomputeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
CHAT_DATE = datetime.date(2024, 7, 26)  # what Llama 3.1's template prints when it has no clock
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Span = tuple[int, int]  # [start, end) characters of the rendered text


def chat_template(tokenizer: PreTrainedTokenizerBase, path: str | None, teacher: str) -> str:
    """The template to render with: ``--chat-template FILE`` (which then also replaces the tokenizer's, so the
    cache's saved tokenizer carries it), else the tokenizer's own.

    Raises:
        PrecomputeError: neither exists, or the file cannot be read.
    """
    if path:
        try:
            tokenizer.chat_template = Path(path).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise PrecomputeError(f"chat_template: cannot read {path!r}: {exc}") from None
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders conversations
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise PrecomputeError(f"the tokenizer of {teacher!r} has no chat template, so --messages-column cannot be "
                              f"rendered; supply one with --chat-template FILE (a Jinja template)")
    return template


def check_conversation(row: int, messages: object) -> list[dict[str, Any]]:
    """The conversation of dataset row ``row`` as plain message dicts (keys set to null by ``datasets``, which
    unifies the keys of every row, are dropped).

    Raises:
        PrecomputeError: not a non-empty list of role/content dicts, an unknown role, or no assistant turn.
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        got = repr(messages)
        raise PrecomputeError(f"row {row}: messages must be a non-empty list of {{role, content}} dicts with string "
                              f"values, got {got if len(got) <= 80 else got[:77] + '...'}")
    unknown = [m["role"] for m in messages if m["role"] not in ROLES]
    if unknown:
        raise PrecomputeError(f"row {row}: unknown role {unknown[0]!r}; expected one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise PrecomputeError(f"row {row}: the conversation has no assistant turn, so no token of it would be "
                              f"trained on; remove the row or add the assistant's reply")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def render(row: int, messages: list[dict[str, Any]], template: str,
           tokenizer: PreTrainedTokenizerBase, *, prompt: bool = False) -> tuple[str, list[Span]]:
    """The rendered conversation and the character spans of its assistant turns; with ``prompt``, the
    conversation followed by the template's generation prompt (what a teacher continues with its reply,
    ``kdcache generate``), and no spans.

    Raises:
        PrecomputeError: the template fails on this conversation, or (without generation tags) renders its
            prefixes inconsistently.
    """
    from jinja2 import TemplateError  # transformers' optional chat dependency: only chat data renders

    try:
        if prompt:
            return _render(messages, template, tokenizer, prompt=True)[0], []
        if _GENERATION_TAG.search(template):
            text, spans = _render(messages, template, tokenizer, tagged=True)
        else:
            text, spans = _by_prefixes(row, messages, template, tokenizer)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise PrecomputeError(f"row {row}: the chat template cannot render this conversation: "
                              f"{type(exc).__name__}: {exc}") from None
    # a span's trailing whitespace (the newline after an end-of-turn token) is not the assistant's
    return text, [(start, start + len(text[start:end].rstrip())) for start, end in spans]


def _render(messages: list[dict[str, Any]], template: str, tokenizer: PreTrainedTokenizerBase, *,
            prompt: bool = False, tagged: bool = False) -> tuple[str, list[Span]]:
    # Here, not at the top: recent transformers only (pyproject allows 4.45), and only chat data renders. The
    # compiled template is private to transformers: read where it is used.
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    # The template's strftime_now prints CHAT_DATE. Render arguments cannot carry a function (the renderer turns
    # them into plain data), so the global is set on transformers' compiled template, which it caches per template
    # text with an environment of its own.
    _compile_jinja_template(template).environment.globals["strftime_now"] = CHAT_DATE.strftime
    special: dict[str, Any] = tokenizer.special_tokens_map  # bos_token, eos_token...: template variables
    rendered = render_jinja_template([messages], chat_template=template, add_generation_prompt=prompt,
                                     return_assistant_tokens_mask=tagged, **special)
    # transformers annotates the result as str; it is (texts, generation indices), one entry per conversation.
    texts, indices = cast("tuple[list[str], list[list[list[int]]]]", rendered)
    return texts[0], [(start, end) for start, end in indices[0]] if tagged else []


def _by_prefixes(row: int, messages: list[dict[str, Any]], template: str,
                 tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[Span]]:
    full, _ = _render(messages, template, tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = _render(messages[:i], template, tokenizer, prompt=True)
        through, _ = _render(messages[:i + 1], template, tokenizer)
        if not (through.startswith(before) and full.startswith(through)):
            raise PrecomputeError(
                f"row {row}: the chat template renders the conversation up to turn {i} differently from the same "
                f"turns inside the whole conversation (it rewrites earlier turns), so the assistant's tokens cannot "
                f"be found by rendering prefixes; mark the assistant content with {{% generation %}} ... "
                f"{{% endgeneration %}} in the template (--chat-template FILE)")
        spans.append((len(before), len(through)))
    return full, spans

