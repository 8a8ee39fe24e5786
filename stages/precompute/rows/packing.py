"""From tokenized documents to the cache's rows: truncation, or packing that keeps documents apart or not.

A document is one dataset row: token ids and a loss mask (1 = a loss trains on this token). Three ways to make
rows, each deterministic and in data order:

* ``none``: one row per document, cut to ``max_length``.
* ``documents``: documents fill rows of at most ``max_length`` tokens whole; a document that does not fit in what
  is left of a row starts the next one, and one longer than a row is cut into row-sized pieces (no token is
  lost). Each row records ``position_ids`` that restart at 0 where a document starts, so the teacher (stage one)
  and the student (stage two) attend within documents only (``stages.common.documents``).
* ``concat``: documents are concatenated and cut into ``max_length`` blocks, so attention crosses documents (the
  behaviour of format-3 caches, for users who want it).

In both packing modes a document gets the tokenizer's EOS appended when it has one and the text does not already
end with it; that EOS is trained when the document's last token is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

# Token ids, uint8 loss mask of the same length and, when stage one records the text (``--record-text``), each
# token's text piece (``stages.precompute.texts.token_pieces``) as an object array of str, carried through packing
# with the ids so a row's text is the join of its tokens' pieces.
Document = tuple["list[int] | np.ndarray", np.ndarray] | tuple["list[int] | np.ndarray", np.ndarray, np.ndarray]
_Piece = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # ids, mask, pieces or None
# int32 ids, uint8 loss mask, int32 positions or None, object pieces or None
Row = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None"]


@dataclass
class RowCounts:
    """What making the rows left out (``iter_rows`` counts as it goes).

    Attributes:
        dropped_empty: blank documents skipped.
        dropped_untrained: documents (or, kept apart, row-sized pieces of one) skipped because no token of theirs
            would be trained on (e.g. an assistant reply that lies beyond ``max_length``).
    """

    dropped_empty: int = 0
    dropped_untrained: int = 0


def span_mask(offsets: Iterable[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """``[L]`` uint8: 1 for each token whose characters overlap a span.

    Args:
        offsets: per token, its ``[start, end)`` characters (a fast tokenizer's ``offset_mapping``); tokens the
            tokenizer adds itself have ``(0, 0)`` and never overlap.
        spans: ``[start, end)`` character spans to train on.
    """
    edges = np.asarray(list(offsets), dtype=np.int64).reshape(-1, 2)
    if not spans or not len(edges):
        return np.zeros(len(edges), dtype=np.uint8)
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    overlap = (edges[:, None, 0] < bounds[None, :, 1]) & (edges[:, None, 1] > bounds[None, :, 0])
    return np.asarray(overlap.any(axis=1), dtype=np.uint8)


def iter_rows(documents: Iterable[Document | None], counts: RowCounts, mode: str, block: int, eos: int | None,
              cap: int | None = None) -> Iterator[Row]:
    """Rows from documents by packing ``mode`` (see the module docstring), one at a time, so memory stays flat.

    Args:
        documents: per dataset row, its ids and loss mask (already cut to ``block`` for mode ``none``), or None.
        counts: receives ``dropped_empty`` / ``dropped_untrained``.
        mode: one of ``core.PACKING`` (the ``--packing`` choices).
        block: ``max_length``.
        eos: the tokenizer's EOS id, appended between packed documents; None when it has none.
        cap: stop after this many rows (``--max-sequences``).

    Yields:
        ``(ids [L] int32, loss_mask [L] uint8, positions [L] int32 or None, pieces [L] object or None)`` with at
        least one trained token; pieces when the documents carry them.
    """
    pieces = _pieces(documents, counts, mode, block, eos)
    if mode == "none":
        made: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]] = (
            (np.asarray(ids), mask, None, text) for ids, mask, text in pieces)
    else:
        made = (_fill_documents if mode == "documents" else _fill_concat)(pieces, block)
    kept = 0
    for ids, mask, positions, text in made:
        if not mask.any():  # a block cut from untrained stretches
            counts.dropped_untrained += 1
            continue
        yield (np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8),
               None if positions is None else positions.astype(np.int32), text)
        kept += 1
        if cap is not None and kept >= cap:
            return


def _pieces(documents: Iterable[Document | None], rows: RowCounts, mode: str, block: int,
            eos: int | None) -> Iterator[_Piece]:
    """Documents worth a row, with EOS appended when packing, counting the ones dropped in ``rows``."""
    for doc in documents:
        if doc is None or not len(doc[0]):
            rows.dropped_empty += 1
            continue
        ids, mask = np.asarray(doc[0], dtype=np.int32), doc[1]
        text = doc[2] if len(doc) > 2 else None
        if mode != "none" and eos is not None and ids[-1] != eos:
            ids, mask = np.append(ids, np.int32(eos)), np.append(mask, mask[-1])
            text = None if text is None else np.append(text, np.array([""], dtype=object))  # EOS covers no text
        # Kept apart, a document longer than a row becomes row-sized pieces, each a document of its own.
        step = block if mode == "documents" else len(ids)
        for start in range(0, len(ids), step):
            if not mask[start:start + step].any():  # nothing of it would be trained on
                rows.dropped_untrained += 1
                continue
            yield ids[start:start + step], mask[start:start + step], None if text is None else text[start:start + step]


def _fill_documents(pieces: Iterable[_Piece], block: int) -> Iterator[Row]:
    row: list[_Piece] = []
    used = 0
    for part in pieces:  # at most a row long (``_pieces``)
        if used + len(part[0]) > block:
            yield _join(row)
            row, used = [], 0
        row.append(part)
        used += len(part[0])
    if row:
        yield _join(row)


def _join(row: list[_Piece]) -> Row:
    ids = np.concatenate([part for part, _, _ in row])
    mask = np.concatenate([m for _, m, _ in row])
    positions = np.concatenate([np.arange(len(part)) for part, _, _ in row])
    return ids, mask, positions, _join_text([t for _, _, t in row])


def _join_text(texts: list[np.ndarray | None]) -> np.ndarray | None:
    """The pieces of consecutive documents as one array (None when the documents carry none)."""
    return None if not texts or texts[0] is None else np.concatenate(texts)  # type: ignore[arg-type]


def _fill_concat(pieces: Iterable[_Piece], block: int) -> Iterator[Row]:
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    texts: list[np.ndarray | None] = []
    held = 0
    for part, mask, text in pieces:
        ids.append(np.asarray(part))
        masks.append(mask)
        texts.append(text)
        held += len(part)
        if held < block:
            continue
        # Join once per filled block rather than per document: long runs of short documents stay linear.
        joined_ids, joined_mask, joined = np.concatenate(ids), np.concatenate(masks), _join_text(texts)
        whole = len(joined_ids) // block * block
        for start in range(0, whole, block):
            yield (joined_ids[start:start + block], joined_mask[start:start + block], None,
                   None if joined is None else joined[start:start + block])
        ids, masks, held = [joined_ids[whole:]], [joined_mask[whole:]], len(joined_ids) - whole
        texts = [None if joined is None else joined[whole:]]
    if held:
        yield np.concatenate(ids), np.concatenate(masks), None, _join_text(texts)
