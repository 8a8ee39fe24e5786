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
from dataclasses import dataclass, field

import numpy as np

PACKING = ("none", "documents", "concat")

Document = tuple[list[int], np.ndarray]  # token ids, uint8 loss mask of the same length


@dataclass
class Rows:
    """The cache's rows in order.

    Attributes:
        ids: one int32 array ``[L_i]`` per row.
        loss_masks: one uint8 array ``[L_i]`` per row.
        positions: one int32 array ``[L_i]`` per row with packing ``documents``, else None.
        dropped_empty: blank documents skipped.
        dropped_untrained: documents (or, kept apart, row-sized pieces of one) skipped because no token of theirs
            would be trained on (e.g. an assistant reply that lies beyond ``max_length``).
    """

    ids: list[np.ndarray] = field(default_factory=list)
    loss_masks: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] | None = None
    dropped_empty: int = 0
    dropped_untrained: int = 0

    def add(self, ids: list[int], mask: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Keep a row, unless no token of it is trained on (a block cut from untrained stretches)."""
        if not mask.any():
            self.dropped_untrained += 1
            return
        self.ids.append(np.asarray(ids, dtype=np.int32))
        self.loss_masks.append(np.asarray(mask, dtype=np.uint8))
        if positions is not None:
            self.positions = [] if self.positions is None else self.positions
            self.positions.append(positions.astype(np.int32))


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


def make_rows(documents: Iterable[Document | None], mode: str, block: int, eos: int | None,
              cap: int | None = None) -> Rows:
    """Rows from documents (None = a blank one) by packing ``mode`` (see the module docstring).

    Args:
        documents: per dataset row, its ids and loss mask (already cut to ``block`` for mode ``none``), or None.
        mode: one of ``PACKING``.
        block: ``max_length``.
        eos: the tokenizer's EOS id, appended between packed documents; None when it has none.
        cap: stop after this many rows (``--max-sequences``).
    """
    rows = Rows()
    pieces = _pieces(documents, rows, mode, block, eos)
    if mode == "none":
        for ids, mask in pieces:
            rows.add(ids, mask)
            if cap is not None and len(rows.ids) >= cap:
                break
        return rows
    fill = _fill_documents if mode == "documents" else _fill_concat
    for ids, mask, positions in fill(pieces, block):
        rows.add(ids, mask, positions)
        if cap is not None and len(rows.ids) >= cap:
            break
    return rows


def _pieces(documents: Iterable[Document | None], rows: Rows, mode: str, block: int,
            eos: int | None) -> Iterator[Document]:
    """Documents worth a row, with EOS appended when packing, counting the ones dropped in ``rows``."""
    for doc in documents:
        if doc is None or not doc[0]:
            rows.dropped_empty += 1
            continue
        ids, mask = doc
        if mode != "none" and eos is not None and ids[-1] != eos:
            ids, mask = [*ids, eos], np.append(mask, mask[-1])
        # Kept apart, a document longer than a row becomes row-sized pieces, each a document of its own.
        step = block if mode == "documents" else len(ids)
        for start in range(0, len(ids), step):
            if not mask[start:start + step].any():  # nothing of it would be trained on
                rows.dropped_untrained += 1
                continue
            yield ids[start:start + step], mask[start:start + step]


def _fill_documents(pieces: Iterable[Document], block: int) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    row: list[Document] = []
    used = 0
    for part in pieces:  # at most a row long (``_pieces``)
        if used + len(part[0]) > block:
            yield _join(row)
            row, used = [], 0
        row.append(part)
        used += len(part[0])
    if row:
        yield _join(row)


def _join(row: list[Document]) -> tuple[list[int], np.ndarray, np.ndarray]:
    ids = [t for part, _ in row for t in part]
    mask = np.concatenate([m for _, m in row])
    positions = np.concatenate([np.arange(len(part)) for part, _ in row])
    return ids, mask, positions


def _fill_concat(pieces: Iterable[Document], block: int) -> Iterator[tuple[list[int], np.ndarray, None]]:
    ids: list[int] = []
    masks: list[np.ndarray] = []
    for part, mask in pieces:
        ids.extend(part)
        masks.append(mask)
        while len(ids) >= block:
            joined = np.concatenate(masks)
            yield ids[:block], joined[:block], None
            ids, masks = ids[block:], [joined[block:]]
    if ids:
        yield ids, np.concatenate(masks), None
