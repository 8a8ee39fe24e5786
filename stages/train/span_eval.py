"""Span-level agreement of a student with its own tokenizer against a teacher's cache (``--cross-tokenizer`` runs).

One pass over a cache with recorded texts; per batch the student tokenizes the texts and its tokens are aligned
with the teacher's (``align``). Metrics, over the spans the teacher's KL would count (``evaluate_spans``):

* ``span_top1``: the share of spans where the teacher's top-1 token at its last token and the student's top-1 at
  its last token name the same next text: both decoded, stripped of surrounding whitespace and case-folded, one a
  prefix of the other and neither empty (a byte-level BPE's "Ġquick" and a WordPiece's "quick" agree; "qu" and
  "quick" agree, for they start the same text);
* ``span_cosine``: the mean cosine of span-pooled hidden states per layer pair (student side through the run's
  projector when it has one, else only where the widths match);
* ``span_cka``: linear CKA of the span-pooled states per pair (projector-free, so runs without trained projectors
  and untrained students compare on it);
* ``aligned_share``: teacher tokens one to one with a student token.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kdcache.stages.common.cache_texts import read_texts
from kdcache.stages.train.cross_model import SpanAligner, _cache_tokenizer, teacher_masks
from kdcache.stages.train.layer_maps import Pair, pair_key
from kdcache.stages.train.losses.cross_vocab import span_mean, span_rows
from kdcache.stages.train.losses.hidden import linear_cka
from kdcache.stages.train.masks import token_masks

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kdcache.stages.train.streaming import Batch
    from kdcache.storage import CacheReader


def same_next_text(a: str, b: str) -> bool:
    """Whether two decoded top-1 tokens name the same next text (module docstring)."""
    a, b = a.strip().casefold(), b.strip().casefold()
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


class _Sums:
    """Running sums of one pass."""

    def __init__(self, pairs: list[Pair]):
        self.agree = self.spans = self.one = self.tokens = 0.0
        self.cos = {pair_key(p): 0.0 for p in pairs}
        self.pooled: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {pair_key(p): [] for p in pairs}


def evaluate_spans(run_dir: str | Path, reader: CacheReader, *, student: str | Path | None = None,
                   batch_size: int = 16, limit: int | None = None) -> dict[str, Any]:
    """Span-level agreement of the run's student (or ``student``, scored with the run's layer map) on ``reader``.

    Returns:
        ``{"span_top1", "span_cosine": {pair: value}, "span_cka": {pair: value}, "aligned_share", "spans"}``.
    """
    from transformers import AutoTokenizer

    from kdcache.stages.train.evaluate import load_run
    from kdcache.stages.train.streaming import to_device

    model, pairs_by_stream, projectors = load_run(run_dir, student)
    pairs = pairs_by_stream.get("", [])
    s_tok = AutoTokenizer.from_pretrained(str(student or Path(run_dir) / "student"))
    t_tok = _cache_tokenizer(reader)
    aligner = SpanAligner(read_texts(reader.store, "span agreement"), s_tok,
                          getattr(model.config, "max_position_embeddings", None))
    names = ["input_ids", *(n for n in ("loss_mask", "position_ids") if n in reader.spec.token_arrays),
             "logits/topk_ids", *(f"hidden/{t}" for _, t in pairs)]
    sums = _Sums(pairs)
    for batch in _batches(reader, names, batch_size, limit):
        batch = to_device(batch, "cpu", reader.spec.hidden_codec)
        _update(sums, model, batch, aligner, (t_tok, s_tok), pairs, projectors)
    return _result(sums)


def _batches(reader: CacheReader, names: list[str], batch_size: int, limit: int | None) -> Iterator[Batch]:
    """Collated batches in cache order carrying each row's global sequence id (the texts are looked up by it)."""
    from kdcache.stages.train.streaming import collate

    count = len(reader) if limit is None else min(limit, len(reader))
    for start in range(0, count, batch_size):
        ids = list(range(start, min(start + batch_size, count)))
        yield collate([reader.get(i, names) for i in ids], ids)


def _update(sums: _Sums, model: torch.nn.Module, batch: dict[str, torch.Tensor], aligner: SpanAligner,
            tokenizers: tuple[Any, Any], pairs: list[Pair], projectors: dict[str, torch.Tensor]) -> None:
    side = aligner.batch(batch["sample_ids"].tolist(), teacher_masks(batch))
    with torch.no_grad():
        out = model(input_ids=side["student/input_ids"], attention_mask=side["student/mask"], output_hidden_states=True)
    t_masks = token_masks(batch["mask"], batch.get("loss_mask"), batch.get("position_ids"), causal=True)
    counted = side["span_real"].bool() & span_rows(t_masks.predicts, side["teacher_last"])
    t_top = span_rows(batch["logits/topk_ids"][..., 0], side["teacher_last"])[counted].long().tolist()
    s_top = span_rows(out.logits.argmax(-1), side["student_last"])[counted].tolist()
    t_tok, s_tok = tokenizers
    sums.agree += sum(same_next_text(t_tok.decode([a]), s_tok.decode([b])) for a, b in zip(t_top, s_top))
    sums.spans += len(t_top)
    sums.one, sums.tokens = sums.one + float(side["aligned"][0]), sums.tokens + float(side["aligned"][1])
    k = side["span_real"].shape[1]
    for s, t in pairs:
        h_s = span_mean(out.hidden_states[s], side["student_span"], k)[counted]
        h_t = span_mean(batch[f"hidden/{t}"], side["teacher_span"], k)[counted]
        sums.pooled[pair_key((s, t))].append((h_s, h_t))
        weight, bias = _projector(projectors, pair_key((s, t)))
        if weight is not None:
            h_s = F.linear(h_s, weight, bias)
        if h_s.shape[-1] == h_t.shape[-1]:
            sums.cos[pair_key((s, t))] += float(F.cosine_similarity(h_s, h_t, dim=-1).sum())


def _projector(projectors: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The exported projector of pair ``key`` (its state-dict entries end in ``{key}.weight`` / ``.bias``)."""
    found = {name.rsplit(".", 1)[1]: v for name, v in projectors.items() if name.rsplit(".", 2)[-2:-1] == [key]}
    return found.get("weight"), found.get("bias")


def _result(sums: _Sums) -> dict[str, Any]:
    cka = {}
    for key, parts in sums.pooled.items():
        h_s, h_t = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        cka[key] = float(linear_cka(h_s[None], h_t[None], torch.ones(1, len(h_s))))
    spans = max(sums.spans, 1.0)
    return {"span_top1": sums.agree / spans, "span_cosine": {k: v / spans for k, v in sums.cos.items()},
            "span_cka": cka, "aligned_share": sums.one / max(sums.tokens, 1.0), "spans": int(sums.spans)}
