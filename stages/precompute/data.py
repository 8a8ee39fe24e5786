"""Data for stage one: load texts through ``datasets``, tokenize them, and fix the order of sequences.

The order of ``TokenizedData.sequences`` is the data order of the cache: shard ``i`` holds sequences
``[i*S, (i+1)*S)`` of this list, whatever the batching, the rank count or the number of restarts. So everything
here is deterministic: no shuffling, documents read in dataset order, empty texts dropped the same way every time.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import DATA_EXTENSIONS, PrecomputeOptions, looks_like_path

_TOKENIZE_BATCH = 1000


@dataclass
class TokenizedData:
    """Token ids of every sequence to cache, in cache order.

    Attributes:
        sequences: one int32 array ``[L_i]`` per sequence (no padding, 1 <= L_i <= max_length).
        dropped_empty: texts skipped because they produced no tokens.
    """

    sequences: list[np.ndarray]
    dropped_empty: int = 0

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` int64 token counts."""
        return np.fromiter((len(s) for s in self.sequences), dtype=np.int64, count=len(self.sequences))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class TokenStreams:
    """Token ids of every sequence to cache, per token stream, in cache order (what a teacher adapter loads).

    Attributes:
        ids: stream name -> one int32 array ``[L_i]`` per sequence: ``""`` for one stream; ``encoder`` and
            ``decoder`` (the target ids, i.e. the labels) for an encoder-decoder teacher.
        fingerprint: the data fingerprint (source, split, columns, hashes of the ids).
        dropped_empty: texts or pairs skipped because they produced no tokens.
    """

    ids: dict[str, list[np.ndarray]]
    fingerprint: dict[str, Any]
    dropped_empty: int = 0

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
        a ``datasets.Dataset`` with at least one row and a string column ``options.text_column``.

    Raises:
        PrecomputeError: the data cannot be loaded, the split is empty, or the column is missing.
    """
    import datasets

    try:
        ds = _load_dataset(options)
    except PrecomputeError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ValueError, DatasetNotFoundError...)
        if "corresponds to no data" in str(exc):  # a split with no rows (e.g. a csv with only a header)
            raise PrecomputeError(f"dataset {options.data!r} (split {options.split!r}) is empty") from None
        raise PrecomputeError(f"cannot load dataset {options.data!r} (split {options.split!r}): "
                              f"{type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.IterableDataset):
        raise PrecomputeError(f"dataset {options.data!r} loaded as a stream; stage one needs a map-style dataset")
    if options.text_column not in ds.column_names:
        raise PrecomputeError(f"dataset {options.data!r} has no column {options.text_column!r}; its columns are: "
                              f"{', '.join(ds.column_names)} (set --text-column)")
    if len(ds) == 0:
        raise PrecomputeError(f"dataset {options.data!r} (split {options.split!r}) is empty")
    return ds


def _load_dataset(options: PrecomputeOptions) -> Any:
    from datasets import load_dataset

    files = _local_files(options.data)
    if files is None:
        return load_dataset(options.data, options.data_config, split=options.split, revision=None)
    builder = _builder_for(files, options.data)
    if all(os.path.getsize(f) == 0 for f in files):  # datasets fails on these with a bare StopIteration
        raise PrecomputeError(f"dataset {options.data!r} is empty: {len(files)} file(s) of 0 bytes")
    # Naming the split in data_files lets a local file serve any --split the user names.
    return load_dataset(builder, data_files={options.split: files}, split=options.split)


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


def tokenize(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> TokenizedData:
    """Tokenize the text column into the cache's sequences; blank texts are dropped (and counted).

    Truncation mode: one sequence per non-empty text, cut to ``max_length`` tokens (special tokens included).
    Packing mode: documents (with the tokenizer's specials, then EOS when it has one) are concatenated and cut
    into ``max_length`` blocks; the last, shorter block is kept, so no text is lost.

    Raises:
        PrecomputeError: no text produced a token.
    """
    cap = options.max_sequences
    pieces = _packed(ds, tokenizer, options) if options.packing else _truncated(ds, tokenizer, options)
    sequences: list[np.ndarray] = []
    dropped = 0
    for ids in pieces:
        if len(ids) == 0:
            dropped += 1
            continue
        sequences.append(np.asarray(ids, dtype=np.int32))
        if cap is not None and len(sequences) >= cap:
            break
    if not sequences:
        raise PrecomputeError(f"dataset {options.data!r}: no text in column {options.text_column!r} produced any "
                              f"token ({dropped} empty text(s))")
    return TokenizedData(sequences, dropped)


def _texts(ds: Any, column: str) -> Iterator[list[str]]:
    for start in range(0, len(ds), _TOKENIZE_BATCH):
        batch = ds[start:start + _TOKENIZE_BATCH][column]
        yield ["" if t is None else str(t) for t in batch]


def _truncated(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> Iterator[list[int]]:
    for texts in _texts(ds, options.text_column):
        encoded = tokenizer(texts, truncation=True, max_length=options.max_length)["input_ids"]
        # A blank text yields [] (counted as dropped) even where the tokenizer would add [CLS] [SEP] to it.
        yield from (ids if text.strip() else [] for text, ids in zip(texts, encoded))


def _packed(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> Iterator[list[int]]:
    block = options.max_length
    eos = tokenizer.eos_token_id
    buffer: list[int] = []
    for texts in _texts(ds, options.text_column):
        texts = [t for t in texts if t.strip()]  # a blank text would pack nothing but its specials
        for ids in tokenizer(texts, truncation=False)["input_ids"] if texts else []:
            buffer.extend(ids)
            if eos is not None and ids and ids[-1] != eos:
                buffer.append(eos)
            while len(buffer) >= block:
                yield buffer[:block]
                buffer = buffer[block:]
    if buffer:
        yield buffer
