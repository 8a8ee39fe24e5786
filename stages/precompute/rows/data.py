"""Data for stage one: load texts or conversations through ``datasets``, tokenize them, and fix the order of rows.

The order of the rows (``packing.iter_rows``) is the data order of the cache: shard ``i`` holds sequences
``[i*S, (i+1)*S)`` of this list, whatever the batching, the rank count or the number of restarts. So everything
here is deterministic: no shuffling, documents read in dataset order, empty texts dropped the same way every time.

Encoder-decoder teachers read (source, target) pairs instead (``load_pairs``, ``tokenize_pairs``), in the same
fixed order. A pair is dropped (and counted) when either side is blank: a sequence needs at least one encoder
token and one target token. Packing has no meaning for pairs and is refused.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from kdcache.stages.common.cache_texts import token_pieces
from kdcache.stages.common.engine_options import looks_like_path
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.hub import offline_unless_reachable
from kdcache.stages.precompute.core.options import DATA_EXTENSIONS
from kdcache.stages.precompute.core.plan import RowSetup
from kdcache.stages.precompute.rows.chat import chat_template, check_conversation, render
from kdcache.stages.precompute.rows.packing import Document, span_mask
from kdcache.storage import ArrayKind, hash_bytes, kind_of, split_stream

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from transformers import PreTrainedTokenizerBase

    from kdcache.stages.precompute.rows.row_store import RowTable


@dataclass
class TokenStreams:
    """Token ids of every sequence to cache, per token stream, in cache order (what a teacher adapter loads).

    Attributes:
        ids: stream name -> one int32 array ``[L_i]`` per sequence: ``""`` for one stream; ``encoder`` and
            ``decoder`` (the target ids, i.e. the labels) for an encoder-decoder teacher. Stage one hands in the
            memory-mapped columns of its row table (``row_store.RowColumn``), read only where sliced.
        fingerprint: the data fingerprint (source, split, columns, hashes of the ids and masks).
        tokens: the token arrays stored beside the ids (``storage.schema.arrays.TOKEN_ARRAYS``), by array name
            (``loss_mask``, ``position_ids``, ``decoder/loss_mask``...): one ``[L_i]`` array per sequence.
        dropped_empty: texts or pairs skipped because they produced no tokens.
        dropped_untrained: rows skipped because no token of theirs is trained on (see ``packing.RowCounts``).
        meta: what the row table recorded while it was written (``row_store.RowTable.meta``): ``longest``,
            ``tokens`` and ``sum_sq_lengths`` per stream, ``max_id``; empty for rows held in memory.
        built: whether this process tokenized the rows (False: it opened rows another process or run built).
        texts: with ``--record-text``, ``text`` (one uint8 ``[C_i]`` UTF-8 array per sequence) and ``text_end``
            (``[L_i]`` int32), what ``stages.common.cache_texts`` records; else empty.
    """

    ids: dict[str, Sequence[np.ndarray]]
    fingerprint: dict[str, Any]
    tokens: dict[str, Sequence[np.ndarray]] = field(default_factory=dict)
    dropped_empty: int = 0
    dropped_untrained: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    built: bool = True
    texts: dict[str, Sequence[np.ndarray]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.ids.values())))

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(self.ids)

    def lengths(self, stream: str = "") -> np.ndarray:
        """``[N]`` int64 token counts of ``stream``."""
        seqs = self.ids[stream]
        if hasattr(seqs, "lengths"):
            return seqs.lengths()
        return np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))

    def longest(self, stream: str = "") -> int:
        """The longest sequence of ``stream`` (recorded while the rows were written: no pass over them)."""
        if "longest" in self.meta:
            return int(self.meta["longest"][stream])
        return int(self.lengths(stream).max())

    @property
    def max_id(self) -> int:
        """The largest token id of any stream."""
        if "max_id" in self.meta:
            return int(self.meta["max_id"])
        return max(int(s.max()) for seqs in self.ids.values() for s in seqs)

    @classmethod
    def of_table(cls, table: RowTable) -> TokenStreams:
        """Streams over a ``row_store.RowTable``: its ``*input_ids`` columns are the streams, the rest the
        token arrays stored beside them."""
        ids: dict[str, Sequence[np.ndarray]] = {split_stream(n)[0]: c for n, c in table.columns.items()
                                                if kind_of(n) == ArrayKind.INPUT_IDS}
        tokens: dict[str, Sequence[np.ndarray]] = {n: c for n, c in table.columns.items()
                                                   if kind_of(n) != ArrayKind.INPUT_IDS and n not in TEXT_ARRAYS}
        texts: dict[str, Sequence[np.ndarray]] = {n: c for n, c in table.columns.items() if n in TEXT_ARRAYS}
        dropped = table.meta.get("dropped", {})
        return cls(ids, table.meta["fingerprint"], tokens, dropped.get("empty", 0), dropped.get("untrained", 0),
                   table.meta, table.built, texts)


def load_texts(setup: RowSetup) -> Dataset | IterableDataset:
    """Open the dataset split ``setup`` names and check its text column.

    Returns:
        a ``datasets.Dataset`` with at least one row and a string column ``setup.text_column``; with
        ``--streaming``, a ``datasets.IterableDataset`` read in file order (nothing is loaded up front).

    Raises:
        PrecomputeError: the data cannot be loaded, the split is empty, or the column is missing.
    """
    files = local_files(setup.data)  # once: a folder's files are a recursive glob
    hub_note = None if files is not None else offline_unless_reachable(
        setup.data, local=f"--data a local data file ({', '.join(DATA_EXTENSIONS)}) or a folder of them",
        kind="dataset")
    try:
        ds = _load_dataset(setup, files)
    except PrecomputeError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ValueError, DatasetNotFoundError...)
        if "corresponds to no data" in str(exc):  # a split with no rows (e.g. a csv with only a header)
            raise PrecomputeError(f"dataset {setup.data!r} (split {setup.split!r}) is empty") from None
        # A hub name is also what a mistyped local file looks like (data/trian.jsnol): say both were looked for.
        local = "" if files is not None else f"there is no local file or folder {setup.data!r}, and "
        raise PrecomputeError(f"cannot load dataset {setup.data!r} (split {setup.split!r}): {local}the hub says "
                              f"{type(exc).__name__}: {exc}" + (f"; {hub_note}" if hub_note else "")) from None
    streaming = isinstance(ds, datasets.IterableDataset)
    if streaming and not setup.streaming:
        raise PrecomputeError(f"dataset {setup.data!r} loaded as a stream; add --streaming to read it as one")
    names = list(ds.column_names or next(iter(ds), {}))  # a stream shows its columns on its first row
    for column, flag in _columns(setup):
        if column not in names:
            raise PrecomputeError(f"dataset {setup.data!r} has no column {column!r}; its columns are: "
                                  f"{', '.join(names)} (set {flag})")
    if not streaming and len(ds) == 0:
        raise PrecomputeError(f"dataset {setup.data!r} (split {setup.split!r}) is empty")
    return ds


def _columns(setup: RowSetup) -> list[tuple[str, str]]:
    """(column, flag that names it) of every column this run reads (a pair's source is its ``text_column``)."""
    if setup.messages_column:
        return [(setup.messages_column, "--messages-column")]
    wanted = [(setup.text_column, "--text-column")]
    wanted += [(setup.target_column, "--target-column")] if setup.target_column else []
    return wanted + ([(setup.mask_column, "--mask-column")] if setup.mask_column else [])


def _load_dataset(setup: RowSetup, files: list[str] | None) -> Dataset | IterableDataset:
    """The dataset from ``files`` (``local_files``' answer), or from the hub when that is None."""
    if files is None:
        return datasets.load_dataset(setup.data, setup.data_config, split=setup.split, revision=None,
                                     streaming=setup.streaming)
    kinds = {DATA_EXTENSIONS.get(Path(f).suffix.lower()) for f in files}
    builder = next(iter(kinds))
    if len(kinds) != 1 or builder is None:
        raise PrecomputeError(f"data {setup.data!r}: expected files of one kind among "
                              f"{', '.join(sorted(DATA_EXTENSIONS))}, got {sorted(Path(f).name for f in files)[:5]}")
    if all(os.path.getsize(f) == 0 for f in files):  # datasets fails on these with a bare StopIteration
        raise PrecomputeError(f"dataset {setup.data!r} is empty: {len(files)} file(s) of 0 bytes")
    # Naming the split in data_files lets a local file serve any --split the user names. Streamed files are read
    # in this (sorted) order, as the map-style loader reads them, so both give the same rows.
    return datasets.load_dataset(builder, data_files={setup.split: files}, split=setup.split,
                                 streaming=setup.streaming)


def local_files(data: str) -> list[str] | None:
    """Files a local ``data`` argument names (a file, a folder or a glob), or None for a hub name."""
    expanded = os.path.expanduser(data)
    if os.path.isdir(expanded):
        found = sorted(p for p in glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
                       if Path(p).suffix.lower() in DATA_EXTENSIONS)
        if not found:
            raise PrecomputeError(f"folder {data!r} holds no {'/'.join(sorted(DATA_EXTENSIONS))} files")
        return found
    matches = sorted(glob.glob(expanded))
    if matches:
        return matches
    if looks_like_path(data, data=True, data_extensions=tuple(DATA_EXTENSIONS)):
        raise PrecomputeError(f"data: no file or folder matches {data!r}")
    return None


def text_template(tokenizer: PreTrainedTokenizerBase, setup: RowSetup) -> str | None:
    """The chat template conversations are rendered with (None for plain text); checks the tokenizer."""
    if setup.record_text and not getattr(tokenizer, "is_fast", False):
        raise PrecomputeError("--record-text needs a fast tokenizer (one that reports each token's characters), "
                              f"and the tokenizer of {setup.teacher!r} is not one")
    if (setup.messages_column or setup.mask_column) and not getattr(tokenizer, "is_fast", False):
        raise PrecomputeError("--messages-column and --mask-column need a fast tokenizer (one that reports each "
                              f"token's characters), and the tokenizer of {setup.teacher!r} is not one")
    return chat_template(tokenizer, setup.chat_template, setup.teacher) if setup.messages_column else None


def text_fingerprint(setup: RowSetup, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Source, split, columns and the mask rule; the row table adds the hashes of the ids, loss masks and
    positions (``TEXT_HASHES``) and the row count: a cache is reused only for the same rows trained the same way."""
    out: dict[str, Any] = {"source": setup.data, "split": setup.split, "text_column": setup.text_column}
    if setup.messages_column:
        out.update(text_column=None, messages_column=setup.messages_column,
                   chat_template_hash=hash_bytes(str(tokenizer.chat_template).encode()))
    if setup.mask_column:
        out["mask_column"] = setup.mask_column
    return out


# Row-table columns of --record-text (not token arrays of the cache: they go to its texts/ folder).
TEXT_ARRAYS = ("text", "text_end")
# Row array -> the data fingerprint's name for its hash (names as caches have always recorded them).
TEXT_HASHES = {"input_ids": "input_ids_hash", "loss_mask": "loss_mask_hash", "position_ids": "position_ids_hash"}
PAIR_HASHES = {"encoder/input_ids": "input_ids_hash", "decoder/input_ids": "target_ids_hash"}


def encode_batch(batch: dict[str, list[Any]], indices: list[int], *, tokenizer: PreTrainedTokenizerBase,
                 setup: RowSetup, template: str | None) -> dict[str, list[Any]]:
    """Tokenize a batch of dataset rows into documents (a ``datasets.map`` function, so it runs in worker
    processes too).

    Args:
        batch: column -> values of the batch's dataset rows.
        indices: the rows' positions in the dataset (for error messages).

    Returns:
        ``{"ids": [...], "mask": [...]}``: per row its token ids (cut to ``max_length`` when rows are not packed)
        and uint8 loss mask, both empty for a blank text (a blank text yields nothing even where the tokenizer
        would add [CLS] [SEP] to it).
    """
    texts, spans = _texts_and_spans(batch, indices, tokenizer, setup, template)
    cut = {"truncation": True, "max_length": setup.max_length} if setup.packing == "none" else {}
    offsets = spans is not None or setup.record_text
    encoded = tokenizer(texts, add_special_tokens=template is None, return_offsets_mapping=offsets, **cut)
    ids_out: list[Any] = []
    masks: list[Any] = []
    pieces: list[Any] = []
    for i, (text, ids) in enumerate(zip(texts, encoded["input_ids"])):
        blank = not text.strip()
        ids_out.append([] if blank else ids)
        mask = np.ones(len(ids), dtype=np.uint8) if spans is None else span_mask(encoded["offset_mapping"][i], spans[i])
        masks.append(mask[:0] if blank else mask)
        if setup.record_text:
            pieces.append([] if blank else token_pieces(text, encoded["offset_mapping"][i]))
    return {"ids": ids_out, "mask": masks, **({"pieces": pieces} if setup.record_text else {})}


def documents(encoded: dict[str, list[Any]]) -> Iterator[Document | None]:
    """``encode_batch``'s output as ``rows`` documents (None for a blank row); with ``pieces``, each token's text
    piece rides along as an object array."""
    pieces = encoded.get("pieces") or [None] * len(encoded["ids"])
    for ids, mask, text in zip(encoded["ids"], encoded["mask"], pieces):
        if not len(ids):
            yield None
        elif text is None:
            yield ids, np.asarray(mask, dtype=np.uint8)
        else:
            yield ids, np.asarray(mask, dtype=np.uint8), np.asarray(list(text), dtype=object)


def _texts_and_spans(rows: dict[str, list[Any]], index: list[int], tokenizer: PreTrainedTokenizerBase,
                     setup: RowSetup,
                     template: str | None) -> tuple[list[str], list[list[tuple[int, int]]] | None]:
    """A batch's texts, and per text the character spans to train on (None: train on every token)."""
    if setup.messages_column and template is not None:
        rendered = [render(row, check_conversation(row, m), template, tokenizer)
                    for row, m in zip(index, rows[setup.messages_column])]
        return [text for text, _ in rendered], [spans for _, spans in rendered]
    texts = ["" if t is None else str(t) for t in rows[setup.text_column]]
    if not setup.mask_column:
        return texts, None
    return texts, [_char_spans(row, value, len(text)) for row, value, text in
                   zip(index, rows[setup.mask_column], texts)]


def _char_spans(row: int, value: object, length: int) -> list[tuple[int, int]]:
    """A ``--mask-column`` value: a list of ``[start, end)`` character spans inside the row's text."""
    pairs = value if isinstance(value, list) else None
    ok = pairs is not None and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in p) and 0 <= p[0] <= p[1] <= length for p in pairs)
    if not ok:
        raise PrecomputeError(f"row {row}: --mask-column must hold a list of [start, end) character spans with "
                              f"0 <= start <= end <= {length} (the text's length), got {value!r:.80}")
    return [(int(a), int(b)) for a, b in pairs or []]


# ---- source/target pairs (encoder-decoder teachers) ----------------------------------------------------
def load_pairs(setup: RowSetup) -> Dataset | IterableDataset:
    """Open the dataset split and check both columns.

    Raises:
        PrecomputeError: no ``--target-column``, packing asked for, or a column missing.
    """
    if not setup.target_column:
        raise PrecomputeError("target_column: teacher is an encoder-decoder, so its decoder needs a target text to "
                              "be teacher-forced on; set --target-column (and --source-column)")
    if setup.packing != "none":
        raise PrecomputeError("packing: source/target pairs cannot be packed into blocks; drop --packing")
    if setup.messages_column or setup.mask_column:
        raise PrecomputeError("messages_column / mask_column: an encoder-decoder teacher is trained on its whole "
                              "target text; use --source-column and --target-column")
    return load_texts(replace(setup, text_column=setup.source))


def encode_pairs(batch: dict[str, list[Any]], indices: list[int], *, tokenizer: PreTrainedTokenizerBase,
                 setup: RowSetup) -> dict[str, list[Any]]:
    """Tokenize a batch of (source, target) rows, each side truncated to its own maximum (``--max-length``,
    ``--max-target-length``); targets go through ``text_target=``, so tokenizers with per-side settings (mBART's
    language codes) apply their target-side rules.

    Returns:
        ``{"src": [...], "tgt": [...]}``: per row both sides' ids, both empty where either side is blank (a
        sequence needs at least one encoder token and one target token).
    """
    clean = lambda texts: ["" if t is None else str(t) for t in texts]  # noqa: E731
    src_texts, tgt_texts = clean(batch[setup.source]), clean(batch[setup.target_column or ""])
    src_ids = tokenizer(src_texts, truncation=True, max_length=setup.max_length)["input_ids"]
    tgt_ids = tokenizer(text_target=tgt_texts, truncation=True,
                        max_length=setup.max_target_length or setup.max_length)["input_ids"]
    keep = [bool(a.strip() and b.strip() and x and y) for a, b, x, y in zip(src_texts, tgt_texts, src_ids, tgt_ids)]
    return {"src": [x if k else [] for k, x in zip(keep, src_ids)],
            "tgt": [y if k else [] for k, y in zip(keep, tgt_ids)]}
