"""Stage one's recorded texts (issue 35): each sequence's text and its tokens' character ends, in ``texts/``.

Real tiny Llama teacher and byte-level BPE tokenizer; the reference is the dataset's own text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kdcache.stages.common.cache_texts import (
    TEXTS_FOLDER,
    MissingTextError,
    char_mask,
    read_texts,
    row_text,
    token_pieces,
)
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.rows.packing import RowCounts, iter_rows
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheReader, verify_cache
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def test_pieces_cover_the_text_up_to_the_last_token() -> None:
    text = "ab cd  é"
    offsets = [(0, 0), (0, 2), (3, 5), (6, 8), (6, 8)]  # BOS, "ab", "cd", "é" split in two byte tokens
    pieces = token_pieces(text, offsets)
    assert pieces == ["", "ab", " cd", "  é", ""]
    joined, ends = row_text(pieces)
    assert joined == text and ends.tolist() == [0, 2, 5, 8, 8]
    assert char_mask(ends, np.array([0, 1, 0, 1, 1])).tolist() == [1, 1, 0, 0, 0, 1, 1, 1]


def test_packed_rows_carry_each_tokens_piece() -> None:
    docs = [([5, 6], np.array([1, 1], np.uint8), np.array(["a", " b"], dtype=object)),
            ([7, 8, 9], np.array([1, 0, 1], np.uint8), np.array(["c", "d", "e"], dtype=object))]
    # documents: rows of 3, the second document (4 tokens with its EOS) cut in two; the EOS covers no text
    for mode, texts in [("documents", ["a b", "cde", ""]), ("concat", ["a bc", "de"])]:
        rows = list(iter_rows(iter(docs), RowCounts(), mode, 4 if mode == "concat" else 3, eos=2))
        assert ["".join(r[3]) for r in rows] == texts, mode
        assert all(len(r[3]) == len(r[0]) for r in rows)


def _cache(tmp_path: Path, teacher: Path, texts: list[str], **overrides: Any) -> CacheReader:
    data = write_text_dataset(tmp_path / "data.jsonl", texts)
    opts = dict(teacher=str(teacher), data=str(data), out=str(tmp_path / "cache"), max_length=24, batch_size=4,
                sequences_per_shard=3, progress=False, features=("hidden",), layers=("1",))
    run_precompute(PrecomputeOptions.of(**{**opts, **overrides}))
    return CacheReader(tmp_path / "cache")


@pytest.mark.parametrize("packing", ["none", "documents"])
def test_recorded_text_is_the_datas_and_token_ends_match(packing: str, tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    docs = sample_texts(10, seed=4)
    reader = _cache(tmp_path, tiny_llama, docs, packing=packing, record_text=True)
    texts = read_texts(reader.store)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert len(texts) == len(reader) and verify_cache(tmp_path / "cache").ok
    assert f"{TEXTS_FOLDER}/texts.arrow" in (reader.manifest.files or {})
    joined = "".join(texts.texts)
    for i in range(len(reader)):
        ids, ends = reader[i]["input_ids"], texts.ends[i]
        assert len(ends) == len(ids) and ends[-1] == len(texts.texts[i]) and (np.diff(ends) >= 0).all()
        # each token's characters are what the tokenizer says it covers (added tokens cover none)
        starts = np.concatenate([[0], ends[:-1]])
        for t, (a, b) in enumerate(zip(starts, ends)):
            piece = texts.texts[i][a:b]
            special = int(ids[t]) in tokenizer.all_special_ids
            assert (piece == "") if special else tokenizer.decode([int(ids[t])]).strip() in piece, (i, t, piece)
    assert _inspect_texts_line(tmp_path / "cache").startswith("texts        recorded in texts/, one per sequence")
    if packing == "documents":  # packed rows: the documents in order, nothing between them
        assert joined == "".join(d for d in docs)
    else:  # truncation keeps each document's text up to its last kept token
        assert all(d.startswith(t) for d, t in zip(docs, texts.texts))


def test_without_the_option_no_texts_and_a_clear_message(tiny_llama: Path, tmp_path: Path) -> None:
    reader = _cache(tmp_path, tiny_llama, sample_texts(4, seed=1))
    assert not (tmp_path / "cache" / TEXTS_FOLDER).exists()
    assert not any(k.startswith(TEXTS_FOLDER) for k in reader.manifest.files or {})
    with pytest.raises(MissingTextError, match="--record-text"):
        read_texts(reader.store)
    assert _inspect_texts_line(tmp_path / "cache") == \
        "texts        not recorded (stage one keeps them with --record-text)"


def _inspect_texts_line(cache: Path) -> str:
    """The ``texts`` line of ``kdcache inspect``, and its JSON field checked against it."""
    import contextlib
    import io
    import json

    from kdcache.pipeline.cli import main

    outputs = []
    for argv in (["inspect", str(cache)], ["inspect", str(cache), "--json"]):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(argv) == 0
        outputs.append(out.getvalue())
    line = next(ln for ln in outputs[0].splitlines() if ln.startswith("texts "))
    assert json.loads(outputs[1])["texts"] == line.startswith("texts        recorded")
    return line


def test_damaged_texts_fail_verify(tiny_llama: Path, tmp_path: Path) -> None:
    _cache(tmp_path, tiny_llama, sample_texts(4, seed=2), record_text=True)
    path = tmp_path / "cache" / TEXTS_FOLDER / "texts.arrow"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not verify_cache(tmp_path / "cache").ok
    with pytest.raises(Exception, match="damaged"):
        read_texts(CacheReader(tmp_path / "cache").store)
