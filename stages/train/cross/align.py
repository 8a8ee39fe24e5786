"""Aligning a student's tokens with the teacher's by the text they cover (GOLD's rule), for ``--cross-tokenizer``.

Both token sequences cover the same text (``stages.common.cache_texts``): token ``t`` covers the characters
``[end[t-1], end[t])``. Tokens are grouped into *spans*: the smallest runs of consecutive teacher tokens and
consecutive student tokens whose character end boundaries agree. Walking both sequences, a span closes as soon
as the last teacher token taken and the last student token taken end at the same character. Tokens that cover
no character (a BOS, an EOS, the later bytes of a character in a byte-level BPE) close the span that ends where
they do when only one side has them there, so each side's last token predicts the text after the same character;
where both sides have them they pair up as spans of their own; before any span (a BOS) they join the first.
Tokens after the last common boundary (a student cut shorter than the text) are in no
span (span ``-1``).

With the same tokenizer on both sides every span is one teacher and one student token. The *aligned share* is
the share of teacher tokens that sit one to one with a student token (1 for the same tokenizer); it says how much
of the teacher's signal reaches the student token by token rather than averaged over a span.

Everything here is numpy and per sequence, computed once in the batch path (``CrossBatch``); the losses take the
spans as index tensors (``stages.train.losses.cross_vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdcache.stages.common.cache_texts import row_text, token_pieces


@dataclass(frozen=True)
class Alignment:
    """One sequence's spans.

    Attributes:
        teacher_span: ``[L_t]`` int64, each teacher token's span (``-1``: none).
        student_span: ``[L_s]`` int64, each student token's span (``-1``: none).
        spans: ``K``, the number of spans (ids ``0..K-1``, in text order).
    """

    teacher_span: np.ndarray
    student_span: np.ndarray
    spans: int

    def last(self, side: str) -> np.ndarray:
        """``[K]`` int64: the index of the last token of each span on ``side`` ("teacher" or "student"): the
        position whose next-token prediction starts at the span's end boundary on both sides."""
        span = self.teacher_span if side == "teacher" else self.student_span
        out = np.full(self.spans, -1, dtype=np.int64)
        kept = np.flatnonzero(span >= 0)
        out[span[kept]] = kept  # later tokens overwrite earlier ones: the last wins
        return out

    def one_to_one(self) -> int:
        """Teacher tokens alone in their span with exactly one student token."""
        t = np.bincount(self.teacher_span[self.teacher_span >= 0], minlength=self.spans)
        s = np.bincount(self.student_span[self.student_span >= 0], minlength=self.spans)
        return int(((t == 1) & (s == 1)).sum())


def align(teacher_end: np.ndarray, student_end: np.ndarray) -> Alignment:
    """GOLD's spans of two tokenizations of one text.

    Args:
        teacher_end: ``[L_t]`` non-decreasing character ends of the teacher's tokens.
        student_end: ``[L_s]`` non-decreasing character ends of the student's tokens over the same text.
    """
    te, se = np.asarray(teacher_end, dtype=np.int64), np.asarray(student_end, dtype=np.int64)
    t_span, s_span = np.full(len(te), -1, np.int64), np.full(len(se), -1, np.int64)
    i = j = k = 0
    while i < len(te) and j < len(se):
        t_span[i], s_span[j] = k, k  # a span takes at least one token of each side
        while te[i] != se[j]:
            if te[i] < se[j]:
                if i + 1 == len(te):
                    break
                i += 1
                t_span[i] = k
            else:
                if j + 1 == len(se):
                    break
                j += 1
                s_span[j] = k
        if te[i] != se[j]:  # one side ran out inside a span: the span never closes
            t_span[t_span == k], s_span[s_span == k] = -1, -1
            return Alignment(t_span, s_span, k)
        if _zero_width_next(te, i) != _zero_width_next(se, j):  # on one side only: they close this span
            i, j = _absorb(te, t_span, i, k), _absorb(se, s_span, j, k)
        i, j, k = i + 1, j + 1, k + 1
    _trailing(te, t_span, i, k)
    _trailing(se, s_span, j, k)
    return Alignment(t_span, s_span, k)


def _zero_width_next(ends: np.ndarray, at: int) -> bool:
    return at + 1 < len(ends) and bool(ends[at + 1] == ends[at])


def _absorb(ends: np.ndarray, span: np.ndarray, at: int, k: int) -> int:
    """Tokens after ``at`` that end where it ends (the later bytes of one character in a byte-level BPE) cover
    nothing new: where only one side has them, they close span ``k`` with it, so the span's last token on that side
    is the one that predicts the next character, as the other side's does. (Where both sides have them, they pair
    up as spans of their own: one tokenizer on both sides keeps one token a span.) Returns the span's last token."""
    while at + 1 < len(ends) and ends[at + 1] == ends[at]:
        at += 1
        span[at] = k
    return at


def _trailing(ends: np.ndarray, span: np.ndarray, start: int, spans: int) -> None:
    """Tokens left after the last span that cover no new character (an EOS) join it."""
    if spans == 0:
        return
    for i in range(start, len(ends)):
        if ends[i] != ends[start - 1]:
            break
        span[i] = spans - 1


def student_mask(alignment: Alignment, teacher_mask: np.ndarray) -> np.ndarray:
    """``[L_s]`` uint8: a student token is trained when a teacher token of its span is (chat masks: the assistant's
    characters, as ``cache_texts.char_mask`` reads them, are the spans of trained teacher tokens)."""
    trained = np.zeros(alignment.spans, dtype=np.uint8)
    kept = alignment.teacher_span >= 0
    np.maximum.at(trained, alignment.teacher_span[kept], np.asarray(teacher_mask)[kept].astype(np.uint8))
    out = np.zeros(len(alignment.student_span), dtype=np.uint8)
    s_kept = alignment.student_span >= 0
    out[s_kept] = trained[alignment.student_span[s_kept]]
    return out


def student_ends(tokenizer: object, text: str, *, max_length: int | None = None,
                 add_special_tokens: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The student's ``(ids [L_s] int64, ends [L_s] int32)`` for a row's text, ends by the same piece rule as the
    teacher's (``cache_texts.token_pieces``).

    Args:
        max_length: cut the student's tokens here (its position limit).
        add_special_tokens: let the tokenizer add its BOS/EOS (they cover no character), as it does for the
            student in its own training and use: a Llama-style student without its BOS predicts worse than it can,
            and the teacher scored against its own cache would fall short of agreeing with itself.
    """
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)  # type: ignore[operator]
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if max_length is not None:
        ids, offsets = ids[:max_length], offsets[:max_length]
    _, ends = row_text(token_pieces(text, offsets))
    return np.asarray(ids, dtype=np.int64), ends


def aligned_share(alignments: list[Alignment]) -> float:
    """Share of teacher tokens aligned one to one, over ``alignments`` (1.0 when there is no token)."""
    total = sum(len(a.teacher_span) for a in alignments)
    return sum(a.one_to_one() for a in alignments) / total if total else 1.0
