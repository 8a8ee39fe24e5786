"""Source/target pairs for seq2seq teachers: load the two columns, tokenize each side, fix the order.

As for single-stream data (``stages.precompute.data``), the order of ``PairedData`` is the cache's order and
everything is deterministic. A pair is dropped (and counted) when either side is blank: a sequence needs at
least one encoder token and one target token. Packing has no meaning for pairs and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kdcache.stages.precompute.data import load_texts
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import PrecomputeOptions

_BATCH = 1000


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
    return options.source_column or options.text_column


def load_pairs(options: PrecomputeOptions) -> Any:
    """Open the dataset split and check both columns.

    Raises:
        PrecomputeError: no ``--target-column``, packing asked for, or a column missing.
    """
    if not options.target_column:
        raise PrecomputeError("target_column: teacher is an encoder-decoder, so its decoder needs a target text to "
                              "be teacher-forced on; set --target-column (and --source-column)")
    if options.packing != "none":
        raise PrecomputeError("packing: source/target pairs cannot be packed into blocks; drop --packing")
    if options.messages_column or options.mask_column:
        raise PrecomputeError("messages_column / mask_column: an encoder-decoder teacher is trained on its whole "
                              "target text; use --source-column and --target-column")
    ds = load_texts(replace(options, text_column=source_column(options)))
    if options.target_column not in ds.column_names:
        raise PrecomputeError(f"dataset {options.data!r} has no column {options.target_column!r}; its columns are: "
                              f"{', '.join(ds.column_names)} (set --target-column)")
    return ds


def _batches(ds: Any, source: str, target: str) -> Iterator[tuple[list[str], list[str]]]:
    for start in range(0, len(ds), _BATCH):
        rows = ds[start:start + _BATCH]
        clean = lambda texts: ["" if t is None else str(t) for t in texts]  # noqa: E731
        yield clean(rows[source]), clean(rows[target])


def tokenize_pairs(ds: Any, tokenizer: Any, options: PrecomputeOptions) -> PairedData:
    """Tokenize both columns, each truncated to its own maximum (``--max-length``, ``--max-target-length``).

    Targets go through ``text_target=``, so tokenizers with per-side settings (mBART's language codes) apply
    their target-side rules.

    Raises:
        PrecomputeError: no pair produced tokens on both sides.
    """
    max_target = options.max_target_length or options.max_length
    sources, targets, dropped = [], [], 0
    for src_texts, tgt_texts in _batches(ds, source_column(options), options.target_column or ""):
        src_ids = tokenizer(src_texts, truncation=True, max_length=options.max_length)["input_ids"]
        tgt_ids = tokenizer(text_target=tgt_texts, truncation=True, max_length=max_target)["input_ids"]
        for src_text, tgt_text, src, tgt in zip(src_texts, tgt_texts, src_ids, tgt_ids):
            if not (src_text.strip() and tgt_text.strip() and src and tgt):
                dropped += 1
                continue
            sources.append(np.asarray(src, dtype=np.int32))
            targets.append(np.asarray(tgt, dtype=np.int32))
            if options.max_sequences is not None and len(sources) >= options.max_sequences:
                return PairedData(sources, targets, dropped)
    if not sources:
        raise PrecomputeError(f"dataset {options.data!r}: no pair of columns {source_column(options)!r} / "
                              f"{options.target_column!r} produced tokens on both sides ({dropped} dropped)")
    return PairedData(sources, targets, dropped)


def paired_data_fingerprint(options: PrecomputeOptions, data: PairedData) -> dict[str, Any]:
    """Source, split, both columns and hashes of both sides' ids."""
    from kdcache.storage import hash_arrays

    return {"source": options.data, "split": options.split, "source_column": source_column(options),
            "target_column": options.target_column, "input_ids_hash": hash_arrays(data.sources),
            "target_ids_hash": hash_arrays(data.targets), "num_sequences": len(data)}
