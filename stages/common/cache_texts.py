"""The text a cache's sequences were tokenized from, recorded by stage one with ``--record-text`` so that stage two
can tokenize the same characters with a student's own tokenizer (``stages.train.cross.align``).

Both stages agree on it here. Per sequence (global index ``i``, cache order) the cache holds:

- ``text``: the row's text. A row is cut or packed from documents, so its text is the join of its tokens'
  *pieces*: a token's piece is the text from the end of the previous token of its document (0 at the document's
  start) to its own end (``token_pieces``). Whitespace before a token thus belongs to it; tokens the tokenizer
  adds itself (BOS, an appended EOS) and tokens that share characters with the one before (a byte-level BPE's
  parts of one character) have empty pieces. Text after a document's last kept token is not in the row.
- ``text_end [L]`` int32: per teacher token, the character (not byte) its piece ends at in ``text``;
  non-decreasing, the last equal to ``len(text)``. Token ``t`` covers ``[text_end[t-1], text_end[t])``.

A chat row's text is the rendered conversation; its loss mask in characters is the mask of the tokens whose
pieces cover them (``char_mask``), the same characters stage one's masked tokens cover.

The folder ``texts/`` holds one Arrow IPC file (columns ``text: string``, ``text_end: list<int32>``), written
whole with its sealed file table by ``storage.folders.put_files``, so the manifest lists it and ``kdcache verify``
checks it like the tokenizer's folder. A cache without the folder was written without ``--record-text``.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from kdcache.storage import KdcacheError, crc32c, folder_is_complete, put_files, read_table

if TYPE_CHECKING:
    from kdcache.storage import Store

TEXTS_FOLDER = "texts"
TEXTS_FILE = "texts.arrow"


class MissingTextError(KdcacheError):
    """A cache lacks the recorded text that tokens of another tokenizer are aligned by."""


def token_pieces(text: str, offsets: Iterable[tuple[int, int]]) -> list[str]:
    """Each token's piece of ``text`` (module docstring): from the previous token's end to its own.

    Args:
        text: the document's text.
        offsets: per token its ``[start, end)`` characters (a fast tokenizer's ``offset_mapping``).

    Returns:
        one str per token; their join is ``text`` up to the last token's end.
    """
    pieces, done = [], 0
    for _, end in offsets:
        end = max(int(end), done)  # an added token's (0, 0), or a part of the character before
        pieces.append(text[done:end])
        done = end
    return pieces


def row_text(pieces: Sequence[str]) -> tuple[str, np.ndarray]:
    """A row's ``(text, text_end [L] int32)`` from its tokens' pieces."""
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    return "".join(pieces), ends.astype(np.int32)


def char_mask(text_end: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """``[C]`` uint8 mask over a row's characters: 1 where the teacher token covering the character is trained.

    Args:
        text_end: ``[L]`` the row's token ends.
        loss_mask: ``[L]`` the row's token loss mask.
    """
    widths = np.diff(np.concatenate([[0], np.asarray(text_end, dtype=np.int64)]))
    return np.repeat(np.asarray(loss_mask, dtype=np.uint8), widths)


def _arrow() -> ModuleType:
    """pyarrow, for the texts file alone: ``kdcache inspect`` imports this module (``has_texts``) and must not load
    it for a zarr cache."""
    import pyarrow  # heavy, and off inspect's path: only writing or reading the texts loads it

    return pyarrow


def save_texts(store: Store, texts: Sequence[np.ndarray], ends: Sequence[np.ndarray]) -> None:
    """Write ``texts/`` into ``store``: its Arrow IPC file, rows in cache order (whole, with its sealed table; kept
    when already complete, so ranks and resumed runs may all call it).

    Args:
        texts: per sequence its text as UTF-8 bytes (uint8 ``[C_i]``, the row table's column).
        ends: per sequence its ``text_end`` ``[L_i]``.
    """
    if has_texts(store):
        return
    pa = _arrow()
    decoded = [bytes(np.asarray(t, dtype=np.uint8)).decode("utf-8") for t in texts]
    offsets = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in ends], out=offsets[1:])
    values = np.concatenate([np.asarray(e, dtype=np.int32) for e in ends]) if ends else np.zeros(0, np.int32)
    table = pa.table({"text": pa.array(decoded, type=pa.large_string()),
                      "text_end": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))})
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    put_files(store, TEXTS_FOLDER, {TEXTS_FILE: sink.getvalue()})


@dataclass
class CacheTexts:
    """A cache's recorded texts and their ``text_end`` arrays by global sequence index, read whole into memory
    (text is small beside the cache's targets)."""

    texts: list[str]
    ends: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.texts)

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheTexts:
        pa = _arrow()
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        column = table.column("text_end").combine_chunks()
        offsets, values = column.offsets.to_numpy(), column.values.to_numpy()
        ends = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        return cls([str(t) for t in table.column("text").to_pylist()], ends)


def has_texts(store: Store) -> bool:
    """Whether the cache in ``store`` holds its texts (written whole)."""
    return folder_is_complete(store, TEXTS_FOLDER)


def read_texts(store: Store, what: str = "aligning a student's tokens with the teacher's") -> CacheTexts:
    """The cache's texts, checked against the folder's file table.

    Raises:
        MissingTextError: the cache has no ``texts/`` (written before ``--record-text`` existed, or without it).
        KdcacheError: the file does not match its table.
    """
    if not has_texts(store):
        raise MissingTextError(
            f"the cache at {store.url} holds no recorded text ({TEXTS_FOLDER}/), which {what} needs: it was "
            "written without --record-text (or before it existed); rerun `kdcache precompute` with --record-text "
            "into a new folder")
    data = store.read(f"{TEXTS_FOLDER}/{TEXTS_FILE}")
    entry: list[int] | None = read_table(store, TEXTS_FOLDER).get(f"{TEXTS_FOLDER}/{TEXTS_FILE}")
    if entry is None or [len(data), crc32c(data)] != list(entry):
        raise KdcacheError(f"{store.url}/{TEXTS_FOLDER}/{TEXTS_FILE} does not match its file table (damaged)")
    return CacheTexts.from_bytes(data)
