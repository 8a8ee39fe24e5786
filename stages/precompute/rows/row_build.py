"""Stage one's rows, built once per cache: the dataset, tokenized in parallel over the host's cores, packed, and
written to the row table (``row_store``) that every rank, job-array part and rerun opens.

The *row key* names everything the rows depend on: where the data comes from (for local files, each file's path,
size and modification time), the dataset's fields (``RowSetup``: split, columns, max length, packing, cap...),
the tokenizer (vocabulary, special tokens and, for fast tokenizers, its whole pipeline: normaliser, pre-tokenizer,
added BOS) and the chat template. Whether the data is streamed, and over how many workers it is tokenized, is left out:
those give the same rows in the same order.

Row order is the dataset's order whatever the worker count: ``datasets.map`` with ``num_proc`` splits the data
into contiguous pieces and concatenates the results in order, and packing then runs once, in one pass, over
the documents in that order.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa

from kdcache.stages.common.cache_texts import row_text
from kdcache.stages.common.fingerprints import clear_call_state, tokenizer_fingerprint
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.plan import RowSetup
from kdcache.stages.precompute.rows.data import (
    PAIR_HASHES,
    TEXT_ARRAYS,
    TEXT_HASHES,
    TokenStreams,
    documents,
    encode_batch,
    encode_pairs,
    load_pairs,
    load_texts,
    local_files,
    text_fingerprint,
    text_template,
)
from kdcache.stages.precompute.rows.packing import RowCounts, iter_rows
from kdcache.stages.precompute.rows.row_store import (
    ROWS_VERSION,
    Build,
    RowTable,
    RowWriter,
    open_or_build,
    rows_root,
)
from kdcache.storage import hash_bytes, hash_json

if TYPE_CHECKING:
    from pathlib import Path

    from datasets import Dataset, IterableDataset
    from transformers import PreTrainedTokenizerBase

_BATCH = 1000  # dataset rows per tokenizer call
_ROWS_PER_WORKER = 20_000  # below this many dataset rows per worker, a process costs more than it saves
Encode = Callable[[dict[str, list[Any]], list[int]], dict[str, list[Any]]]
# The columns each kind of data's encoder returns, with their Arrow value types.
TEXT_COLUMNS = {"ids": "int32", "mask": "uint8"}
PAIR_COLUMNS = {"src": "int32", "tgt": "int32"}


def text_streams(setup: RowSetup, tokenizer: PreTrainedTokenizerBase) -> TokenStreams:
    """The rows of a decoder-only or encoder teacher: ``input_ids``, ``loss_mask`` and, with packing
    ``documents``, ``position_ids``; built here or opened where another process built them.

    Raises:
        PrecomputeError: the data cannot be read, holds bad rows, or leaves no row to cache.
    """
    template = text_template(tokenizer, setup)
    names = ("input_ids", "loss_mask", *(("position_ids",) if setup.packing == "documents" else ()),
             *(TEXT_ARRAYS if setup.record_text else ()))
    key = row_key(setup, tokenizer, "text", template)
    columns = {**TEXT_COLUMNS, **({"pieces": "string"} if setup.record_text else {})}

    def build(writer: RowWriter) -> tuple[dict[str, Any], dict[str, Any]]:
        encode = functools.partial(encode_batch, tokenizer=tokenizer, setup=setup, template=template)
        counts = RowCounts()
        docs = (doc for batch in encoded_batches(load_texts(setup), encode, setup, writer.path, columns)
                for doc in documents(batch))
        for ids, mask, positions, pieces in iter_rows(docs, counts, setup.packing, setup.max_length,
                                                      tokenizer.eos_token_id, setup.max_sequences):
            writer.add({"input_ids": ids, "loss_mask": mask, **({} if positions is None else
                                                               {"position_ids": positions}),
                        **({} if pieces is None else _text_columns(pieces))})
        if not writer.rows:
            column = setup.messages_column or setup.text_column
            raise PrecomputeError(f"dataset {setup.data!r}: no row of column {column!r} produced a token to train on "
                                  f"({counts.dropped_empty} empty, {counts.dropped_untrained} with no trained token "
                                  f"within --max-length)")
        dropped = {"empty": counts.dropped_empty, "untrained": counts.dropped_untrained}
        return text_fingerprint(setup, tokenizer), {"dropped": dropped}

    hashes = {n: TEXT_HASHES[n] for n in names if n in TEXT_HASHES}  # the texts follow from the data and ids
    return TokenStreams.of_table(_open_or_build(setup, key, names, hashes, build))


def _text_columns(pieces: np.ndarray) -> dict[str, np.ndarray]:
    """A row's ``text`` (UTF-8 bytes, uint8) and ``text_end`` (int32) columns from its tokens' pieces."""
    text, ends = row_text(list(pieces))
    return {"text": np.frombuffer(text.encode("utf-8"), dtype=np.uint8), "text_end": ends}


def pair_streams(setup: RowSetup, tokenizer: PreTrainedTokenizerBase) -> TokenStreams:
    """The rows of an encoder-decoder teacher: both sides' ids, and loss masks of ones (every token of both
    sides is trained on; stored so every cache reads alike)."""
    names = ("encoder/input_ids", "encoder/loss_mask", "decoder/input_ids", "decoder/loss_mask")
    key = row_key(setup, tokenizer, "pairs", None)

    def build(writer: RowWriter) -> tuple[dict[str, Any], dict[str, Any]]:
        encode = functools.partial(encode_pairs, tokenizer=tokenizer, setup=setup)
        dropped = 0
        batches = encoded_batches(load_pairs(setup), encode, setup, writer.path, PAIR_COLUMNS)
        for src, tgt in ((s, t) for batch in batches for s, t in zip(batch["src"], batch["tgt"])):
            if not len(src):
                dropped += 1
                continue
            src, tgt = np.asarray(src, dtype=np.int32), np.asarray(tgt, dtype=np.int32)
            writer.add({"encoder/input_ids": src, "encoder/loss_mask": np.ones(len(src), dtype=np.uint8),
                        "decoder/input_ids": tgt, "decoder/loss_mask": np.ones(len(tgt), dtype=np.uint8)})
            if setup.max_sequences is not None and writer.rows >= setup.max_sequences:
                break
        if not writer.rows:
            raise PrecomputeError(f"dataset {setup.data!r}: no pair of columns {setup.source!r} / "
                                  f"{setup.target_column!r} produced tokens on both sides ({dropped} dropped)")
        # source, split and both columns; the row table adds both sides' hashes (PAIR_HASHES) and the count
        fingerprint = {"source": setup.data, "split": setup.split, "source_column": setup.source,
                       "target_column": setup.target_column}
        return fingerprint, {"dropped": {"empty": dropped, "untrained": 0}}

    return TokenStreams.of_table(_open_or_build(setup, key, names, PAIR_HASHES, build))


def _open_or_build(setup: RowSetup, key: dict[str, Any], names: tuple[str, ...], hashes: dict[str, str],
                   build: Build) -> RowTable:
    """The rows from the rows folder (``row_store.rows_root``); ``--estimate``'s in a scratch folder it removes
    at once (the open table reads on through its memory map), so an estimate leaves no file anywhere."""
    if not setup.scratch:
        return open_or_build(rows_root(), key, names, hashes, build)
    scratch = Path(tempfile.mkdtemp(prefix="kdcache-estimate-rows-"))
    try:
        return open_or_build(scratch / "rows", key, names, hashes, build)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def row_key(setup: RowSetup, tokenizer: PreTrainedTokenizerBase, kind: str,
            template: str | None) -> dict[str, Any]:
    """Everything the rows depend on (see the module docstring); equal keys give equal rows."""
    dataset = setup.key()  # without the chat template's file: its text counts instead
    if not dataset.get("record_text"):  # rows without texts keep the key (and folder) they had before the option
        dataset.pop("record_text", None)
    files = local_files(setup.data)
    return {"version": ROWS_VERSION, "kind": kind, "dataset": dataset,
            "files": [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files or []],
            "tokenizer": tokenizer_key(tokenizer),
            "template": hash_bytes(template.encode()) if template is not None else None}


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The tokenizer's fingerprint plus what else changes its ids: a fast tokenizer's whole serialised pipeline,
    else its class and settings."""
    clear_call_state(tokenizer)  # an earlier call's truncation is no part of what maps text to ids
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pipeline = backend.to_str() if backend is not None else hash_json([type(tokenizer).__name__,
                                                                        tokenizer.init_kwargs])
    return {**tokenizer_fingerprint(tokenizer), "pipeline": hash_bytes(pipeline.encode()),
            "eos": tokenizer.eos_token_id}


def encoded_batches(ds: Dataset | IterableDataset, encode: Encode, setup: RowSetup, scratch: Path,
                    columns: dict[str, str]) -> Iterator[dict[str, Any]]:
    """``encode``'s output over the dataset, batch by batch, in dataset order.

    A stream, a capped run (``--max-sequences``: only the rows it needs are read) and small data are encoded
    here, lazily; otherwise ``datasets.map`` encodes on every core into Arrow files in a temporary folder under
    ``scratch`` (removed when the batches are read, so the row table keeps no second copy of the tokens), read
    back a batch at a time. ``columns`` names ``encode``'s output columns and their Arrow value types.
    """
    # What Arrow's allocator kept from converting the files goes back to the system: the conversion's buffers scale
    # with the data, and the build holds nothing of them afterwards.
    pa.default_memory_pool().release_unused()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # --tokenize-workers, else the host's cores, fewer for small data
    procs = 1 if isinstance(ds, datasets.IterableDataset) or setup.max_sequences is not None else (
        setup.tokenize_workers or max(1, min(cores, len(ds) // _ROWS_PER_WORKER)))
    if procs == 1:
        yield from _in_process(ds, encode)
        return
    with tempfile.TemporaryDirectory(dir=scratch, prefix="tokenized-") as folder:
        out = ds.map(encode, batched=True, batch_size=_BATCH, with_indices=True, num_proc=procs,
                     remove_columns=ds.column_names, cache_file_name=os.path.join(folder, "docs.arrow"),
                     features=datasets.Features({name: datasets.Sequence(datasets.Value(kind))
                                                 for name, kind in columns.items()}), desc="tokenizing")
        for batch in _file_batches(out) or out.data.to_batches(max_chunksize=_BATCH):
            yield {name: _lists(batch.column(name)) for name in batch.schema.names}


def _in_process(ds: Dataset | IterableDataset, encode: Encode) -> Iterator[dict[str, Any]]:
    files = _file_batches(ds)
    batches = (b.to_pydict() for b in files) if files is not None else ds.iter(batch_size=_BATCH)
    start = 0
    for batch in batches:
        count = len(next(iter(batch.values())))
        yield encode(batch, list(range(start, start + count)))
        start += count


def _file_batches(ds: Dataset | IterableDataset) -> Iterator[pa.RecordBatch] | None:
    """A map-style dataset's rows as Arrow record batches of at most ``_BATCH`` rows, read from its Arrow files
    with plain reads rather than through its memory map, so the builder's resident memory stays flat in the data
    (a map's touched pages count as resident); None for a stream or a dataset its files do not hold as is."""
    files = [f["filename"] for f in getattr(ds, "cache_files", None) or []]
    if not files or getattr(ds, "_indices", None) is not None or len(ds) != sum(_rows_in(f) for f in files):
        return None

    def read() -> Iterator[pa.RecordBatch]:
        for name in files:
            with pa.OSFile(name) as source:
                for batch in pa.ipc.open_stream(source):
                    for start in range(0, batch.num_rows, _BATCH):
                        yield batch.slice(start, _BATCH)

    return read()


def _rows_in(path: str) -> int:
    with pa.memory_map(path) as source:  # reads the batches' headers, not their data
        return sum(b.num_rows for b in pa.ipc.open_stream(source))


def _lists(column: pa.ListArray) -> list[np.ndarray]:
    """A ``list<...>`` Arrow column as one numpy view per row (offsets index the unsliced values)."""
    offsets, values = column.offsets.to_numpy(), column.values.to_numpy(zero_copy_only=False)  # str: objects
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
