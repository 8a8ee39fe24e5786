"""Data for stage one: load texts or conversations through ``datasets``, tokenize them, and fix the order of rows.

The order of ``Rows.ids`` (``rows.py``) is the data order of the cache: shard ``i`` holds sequences
``[i*S, (i+1)*S)`` of this list, whatever the batching, the rank count or the number of restarts. So everything
here is deterministic: no shuffling, documents read in dataset order, empty texts dropped the same way every time.

Encoder-decoder teachers read (source, target) pairs instead (``load_pairs``, ``tokenize_pairs``), in the same
fixed order. A pair is dropped (and counted) when either side is blank: a sequence needs at least one encoder
token and one target token. Packing has no meaning for pairs and is refused.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kdcache.stages.precompute.chat import chat_template, check_conversation, render
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import DATA_EXTENSIONS, PrecomputeOptions, looks_like_path
from kdcache.stages.precompute.rows import Document, Rows, make_rows, span_mask

_TOKENIZE_BATCH = 1000


@dataclass
class TokenStreams:
    """Token ids of every sequence to cache, per token stream, in cache order (what a teacher adapter loads).

    Attributes:
        ids: stream name -> one int32 array ``[L_i]`` per sequence: ``""`` for one stream; ``encoder`` and
            ``decoder`` (the target ids, i.e. the labels) for an encoder-decoder teacher.
        fingerprint: the data fingerprint (source, split, columns, hashes of the ids and masks).
        tokens: the token arrays stored beside the ids (``storage.spec.TOKEN_ARRAYS``), by array name
            (``loss_mask``, ``position_ids``, ``decoder/loss_mask``...): one ``[L_i]`` array per sequence.
        dropped_empty: texts or pairs skipped because they produced no tokens.
        dropped_untrained: rows skipped because no token of theirs is trained on (see ``rows.Rows``).
    """

    ids: dict[str, list[np.ndarray]]
    fingerprint: dict[str, Any]
    tokens: dict[str, list[np.ndarray]] = field(default_factory=dict)
    dropped_empty: int = 0
    dropped_untrained: int = 0

    def __len__(self) -> int:
        return len(next(iter(self.ids.values())))

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(self.ids)

    def lengths(self, stream: str = "") -> np.ndarray:
        """``[N]`` int64 token counts of ``stream``."""
        seqs = self.ids[stream]
        return np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))


def load_texts(options: PrecomputeOptions) -> Any:
    """Open the dataset split named by the options and check its text column.

    Returns:
        a ``datasets.Dataset`` with at least one row and a string column ``options.dataset.text_column``.

    Raises:
        PrecomputeError: the data cannot be loaded, the split is empty, or the column is missing.
    """
    import datasets

    d = options.dataset

    try:
        ds = _load_dataset(options)
    except PrecomputeError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ValueError, DatasetNotFoundError...)
        if "corresponds to no data" in str(exc):  # a split with no rows (e.g. a csv with only a header)
            raise PrecomputeError(f"dataset {d.data!r} (split {d.split!r}) is empty") from None
        raise PrecomputeError(f"cannot load dataset {d.data!r} (split {d.split!r}): "
                              f"{type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.IterableDataset):
        raise PrecomputeError(f"dataset {d.data!r} loaded as a stream; stage one needs a map-style dataset")
    for column, flag in _columns(options):
        if column not in ds.column_names:
            raise PrecomputeError(f"dataset {d.data!r} has no column {column!r}; its columns are: "
                                  f"{', '.join(ds.column_names)} (set {flag})")
    if len(ds) == 0:
        raise PrecomputeError(f"dataset {d.data!r} (split {d.split!r}) is empty")
    return ds


def _columns(options: PrecomputeOptions) -> list[tuple[str, str]]:
    """(column, flag that names it) of every column this run reads."""
    d = options.dataset
    if d.messages_column:
        return [(d.messages_column, "--messages-column")]
    wanted = [(d.text_column, "--text-column")]
    return wanted + ([(d.mask_column, "--mask-column")] if d.mask_column else [])


def _load_dataset(options: PrecomputeOptions) -> Any:
    from datasets import load_dataset

    d = options.dataset

    files = _local_files(d.data)
    if files is None:
        return load_dataset(d.data, d.data_config, split=d.split, revision=None)
    builder = _builder_for(files, d.data)
    if all(os.path.getsize(f) == 0 for f in files):  # datasets fails on these with a bare StopIteration
        raise PrecomputeError(f"dataset {d.data!r} is empty: {len(files)} file(s) of 0 bytes")
    # Naming the split in data_files lets a local file serve any --split the user names.
    return load_dataset(builder, data_files={d.split: files}, split=d.split)


def _local_files(data: str) -> list[str] | None:
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
    if looks_like_path(data, data=True):
        raise PrecomputeError(f"data: no file or folder matches {data!r}")
    return None


def _builder_for(files: list[str], data: str) -> str:
    kinds = {DATA_EXTENSIONS.get(Path(f).suffix.lower()) for f in files}
    kind = next(iter(kinds))
    if len(kinds) != 1 or kind is None:
        raise PrecomputeError(f"data {data!r}: expected files of one kind among "
                              f"{', '.join(sorted(DATA_EXTENSIONS))}, got {sorted(Path(f).name for f in files)[:5]}")
    return kind


def tokenize(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> Rows:
    """Tokenize the dataset into the cache's rows with their loss masks (``rows.make_rows``).

    The mask is 1 on every token of plain text, on the tokens overlapping ``--mask-column``'s character spans,
    or on the assistant's tokens of ``--messages-column`` conversations. Blank texts are dropped (and counted).

    Raises:
        PrecomputeError: bad conversations or spans (naming the row), or no row left to cache.
    """
    d = options.dataset
    template = chat_template(tokenizer, d.chat_template, options.engine.teacher) if d.messages_column else None
    docs = _documents(ds, tokenizer, options, template)
    rows = make_rows(docs, d.packing, d.max_length, tokenizer.eos_token_id, d.max_sequences)
    if not rows.ids:
        column = d.messages_column or d.text_column
        raise PrecomputeError(f"dataset {d.data!r}: no row of column {column!r} produced a token to train "
                              f"on ({rows.dropped_empty} empty, {rows.dropped_untrained} with no trained token "
                              f"within --max-length)")
    return rows


def data_fingerprint(options: PrecomputeOptions, tokenizer: Any, rows: Rows) -> dict[str, Any]:
    """Source, split, columns, the mask rule and hashes of the ids, loss masks and positions: a cache is reused
    only for the same rows trained the same way."""
    d = options.dataset
    from kdcache.storage import hash_arrays, hash_bytes

    out: dict[str, Any] = {"source": d.data, "split": d.split, "text_column": d.text_column,
                           "input_ids_hash": hash_arrays(rows.ids), "num_sequences": len(rows.ids),
                           "loss_mask_hash": hash_arrays(rows.loss_masks)}
    if d.messages_column:
        out.update(text_column=None, messages_column=d.messages_column,
                   chat_template_hash=hash_bytes(str(tokenizer.chat_template).encode()))
    if d.mask_column:
        out["mask_column"] = d.mask_column
    if rows.positions is not None:
        out["position_ids_hash"] = hash_arrays(rows.positions)
    return out


def _documents(ds: Any, tokenizer: Any, options: PrecomputeOptions, template: str | None) -> Iterator[Document | None]:
    """Per dataset row, its ids and loss mask (cut to ``max_length`` when rows are not packed), or None if blank."""
    d = options.dataset
    spans_wanted = bool(d.messages_column or d.mask_column)
    if spans_wanted and not getattr(tokenizer, "is_fast", False):
        raise PrecomputeError("--messages-column and --mask-column need a fast tokenizer (one that reports each "
                              f"token's characters), and the tokenizer of {options.engine.teacher!r} is not one")
    cut = {"truncation": True, "max_length": d.max_length} if d.packing == "none" else {}
    for start in range(0, len(ds), _TOKENIZE_BATCH):
        texts, spans = _texts_and_spans(ds[start:start + _TOKENIZE_BATCH], start, tokenizer, options, template)
        encoded = tokenizer(texts, add_special_tokens=template is None, return_offsets_mapping=spans_wanted, **cut)
        for i, (text, ids) in enumerate(zip(texts, encoded["input_ids"])):
            # A blank text yields None (counted as dropped) even where the tokenizer would add [CLS] [SEP] to it.
            if not text.strip():
                yield None
            elif spans is None:
                yield ids, np.ones(len(ids), dtype=np.uint8)
            else:
                yield ids, span_mask(encoded["offset_mapping"][i], spans[i])


def _texts_and_spans(rows: dict[str, list[Any]], start: int, tokenizer: Any, options: PrecomputeOptions,
                     template: str | None) -> tuple[list[str], list[list[tuple[int, int]]] | None]:
    """A batch's texts, and per text the character spans to train on (None: train on every token)."""
    d = options.dataset
    if d.messages_column and template is not None:
        rendered = [render(start + i, check_conversation(start + i, m), template, tokenizer)
                    for i, m in enumerate(rows[d.messages_column])]
        return [text for text, _ in rendered], [spans for _, spans in rendered]
    texts = ["" if t is None else str(t) for t in rows[d.text_column]]
    if not d.mask_column:
        return texts, None
    return texts, [_char_spans(start + i, value, len(text)) for i, (value, text) in
                   enumerate(zip(rows[d.mask_column], texts))]


def _char_spans(row: int, value: Any, length: int) -> list[tuple[int, int]]:
    """A ``--mask-column`` value: a list of ``[start, end)`` character spans inside the row's text."""
    pairs = value if isinstance(value, list) else None
    ok = pairs is not None and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in p) and 0 <= p[0] <= p[1] <= length for p in pairs)
    if not ok:
        raise PrecomputeError(f"row {row}: --mask-column must hold a list of [start, end) character spans with "
                              f"0 <= start <= end <= {length} (the text's length), got {value!r:.80}")
    return [(int(a), int(b)) for a, b in pairs or []]


# ---- source/target pairs (encoder-decoder teachers) ----------------------------------------------------
@dataclass
class PairedData:
    """Token ids of every (source, target) pair to cache, in cache order.

    Attributes:
        sources: one int32 array ``[L_enc_i]`` per pair: the encoder's input ids.
        targets: one int32 array ``[L_dec_i]`` per pair: the target ids (the labels; the decoder reads them
            shifted right by the model's own ``decoder_start_token_id``).
        dropped_empty: pairs skipped because a side produced no tokens.
    """

    sources: list[np.ndarray]
    targets: list[np.ndarray]
    dropped_empty: int = 0

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.sources) + sum(len(t) for t in self.targets))


def source_column(options: PrecomputeOptions) -> str:
    """The source column: ``--source-column``, else ``--text-column``."""
    d = options.dataset
    return d.source_column or d.text_column


def load_pairs(options: PrecomputeOptions) -> Any:
    """Open the dataset split and check both columns.

    Raises:
        PrecomputeError: no ``--target-column``, packing asked for, or a column missing.
    """
    d = options.dataset
    if not d.target_column:
        raise PrecomputeError("target_column: teacher is an encoder-decoder, so its decoder needs a target text to "
                              "be teacher-forced on; set --target-column (and --source-column)")
    if d.packing != "none":
        raise PrecomputeError("packing: source/target pairs cannot be packed into blocks; drop --packing")
    if d.messages_column or d.mask_column:
        raise PrecomputeError("messages_column / mask_column: an encoder-decoder teacher is trained on its whole "
                              "target text; use --source-column and --target-column")
    ds = load_texts(replace(options, dataset=replace(options.dataset, text_column=source_column(options))))
    if d.target_column not in ds.column_names:
        raise PrecomputeError(f"dataset {d.data!r} has no column {d.target_column!r}; its columns are: "
                              f"{', '.join(ds.column_names)} (set --target-column)")
    return ds


def _batches(ds: Any, source: str, target: str) -> Iterator[tuple[list[str], list[str]]]:
    for start in range(0, len(ds), _TOKENIZE_BATCH):
        rows = ds[start:start + _TOKENIZE_BATCH]
        clean = lambda texts: ["" if t is None else str(t) for t in texts]  # noqa: E731
        yield clean(rows[source]), clean(rows[target])


def tokenize_pairs(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> PairedData:
    """Tokenize both columns, each truncated to its own maximum (``--max-length``, ``--max-target-length``).

    Targets go through ``text_target=``, so tokenizers with per-side settings (mBART's language codes) apply
    their target-side rules.

    Raises:
        PrecomputeError: no pair produced tokens on both sides.
    """
    d = options.dataset
    max_target = d.max_target_length or d.max_length
    sources, targets, dropped = [], [], 0
    for src_texts, tgt_texts in _batches(ds, source_column(options), d.target_column or ""):
        src_ids = tokenizer(src_texts, truncation=True, max_length=d.max_length)["input_ids"]
        tgt_ids = tokenizer(text_target=tgt_texts, truncation=True, max_length=max_target)["input_ids"]
        for src_text, tgt_text, src, tgt in zip(src_texts, tgt_texts, src_ids, tgt_ids):
            if not (src_text.strip() and tgt_text.strip() and src and tgt):
                dropped += 1
                continue
            sources.append(np.asarray(src, dtype=np.int32))
            targets.append(np.asarray(tgt, dtype=np.int32))
            if d.max_sequences is not None and len(sources) >= d.max_sequences:
                return PairedData(sources, targets, dropped)
    if not sources:
        raise PrecomputeError(f"dataset {d.data!r}: no pair of columns {source_column(options)!r} / "
                              f"{d.target_column!r} produced tokens on both sides ({dropped} dropped)")
    return PairedData(sources, targets, dropped)


def paired_data_fingerprint(options: PrecomputeOptions, data: PairedData) -> dict[str, Any]:
    """Source, split, both columns and hashes of both sides' ids."""
    d = options.dataset
    from kdcache.storage import hash_arrays

    return {"source": d.data, "split": d.split, "source_column": source_column(options),
            "target_column": d.target_column, "input_ids_hash": hash_arrays(data.sources),
            "target_ids_hash": hash_arrays(data.targets), "num_sequences": len(data)}
