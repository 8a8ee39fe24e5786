"""Span-level agreement of a student with its own tokenizer against a teacher's cache (``--cross-tokenizer`` runs).

One pass over a cache with recorded texts; per batch the student tokenizes the texts and its tokens are aligned
with the teacher's (``align``). Metrics, over the spans the teacher's KL would count (``evaluate_spans``):

* ``span_top1``: the share of spans where the teacher's top-1 token at its last token and the student's top-1 at
  its last token name the same next text (``next_text``): both decoded, case-folded, stripped of surrounding
  whitespace and of WordPiece's "##", and equal (a byte-level BPE's "Ġquick" and a WordPiece's "quick" agree;
  "qu" and "quick" do not: a prefix gets no credit, or a one-letter guess would agree with every word it starts);
  two whitespace-only predictions agree with each other and with nothing else;
* ``span_top1_floor``: what the best constant predictor scores on the same spans, the share of the teacher's most
  frequent next text: a student at or below it has learnt nothing ``span_top1`` can see (report it beside the
  untrained student's baseline);
* ``span_cosine``: the mean cosine of span-pooled hidden states per layer pair (student side through the run's
  projector when it has one, else only where the widths match);
* ``span_cka``: linear CKA of the span-pooled states per pair (projector-free, so runs without trained projectors
  and untrained students compare on it);
* ``aligned_share``: teacher tokens one to one with a student token.

The pairs are the run's layer map, or the uniform map when the run has none (``span_pairs``). ``kdcache eval``
of a ``--cross-tokenizer`` run writes ``evaluate_cross_run``'s record (kind "cross_tokenizer"), which reports
and sweeps read like any other evaluation.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from kdcache.stages.common.cache_texts import read_texts
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.hidden.device_codecs import load_projection
from kdcache.stages.targets.hidden.loss_terms import linear_cka
from kdcache.stages.train.core.checks import CacheCheckError, text_problems
from kdcache.stages.train.core.layer_maps import Pair, pair_key
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.cross.cross_model import SIDE_KEYS, SpanAligner, cache_tokenizer
from kdcache.stages.train.evaluation.evaluate import EvaluationError, cache_batches, default_pairs, load_run
from kdcache.stages.train.feed.streaming import to_device
from kdcache.stages.train.losses.cross_vocab import span_mean, span_rows
from kdcache.storage import read_json_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kdcache.storage import CacheReader


WHITESPACE = " "  # what every whitespace-only prediction reads as
UNDECODABLE = "\ufffd"  # what a byte-level piece of a character decodes to, whichever piece it is


def next_text(decoded: str) -> str:
    """The next text a decoded top-1 token names, as ``span_top1`` compares it (module docstring)."""
    word = decoded.strip().casefold().removeprefix("##")
    return word or WHITESPACE


def token_text(tokenizer: Any, token_id: int) -> str:
    """``next_text`` of a token; a piece of a character (it decodes to U+FFFD, as every such piece does) is named
    by its own vocabulary string instead, which is the same piece's in another byte-level vocabulary and no
    other's: two different pieces must not agree because both decode to U+FFFD."""
    decoded = tokenizer.decode([token_id])
    if UNDECODABLE in decoded:
        return "bytes:" + str(tokenizer.convert_ids_to_tokens(token_id))
    return next_text(decoded)


class _Sums:
    """Running sums of one pass."""

    def __init__(self, pairs: list[Pair]):
        self.agree = self.spans = self.one = self.tokens = self.sequences = 0.0
        self.teacher_texts: Counter[str] = Counter()  # the teacher's next texts: the best constant's score
        self.cos: dict[str, float] = {}  # only the pairs whose widths meet (through a projector or equal)
        self.pooled: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {pair_key(p): [] for p in pairs}


def evaluate_spans(run_dir: str | Path, reader: CacheReader, *, student: str | Path | None = None,
                   batch_size: int = 16, limit: int | None = None, pairs: list[Pair] | None = None,
                   device: str | torch.device = "cpu") -> dict[str, Any]:
    """Span-level agreement of the run's student (or ``student``) on ``reader``.

    Args:
        pairs: the (student layer, cached teacher layer) pairs pooled states are compared on; by default the
            run's map, or where the run has none (a CE-only run, ``--gamma 0``; a baseline before training) the
            uniform map over the cache's hidden layers (``evaluate.default_pairs``), so those rows get span CKA too.
            The result names the pairs used, so runs are compared on the same ones.

    Returns:
        ``{"span_top1", "span_cosine": {pair: value}, "span_cka": {pair: value}, "span_cosine_mean",
        "span_cka_mean", "pairs": [[s, t], ...], "pairs_from": "given" | "run" | "uniform", "aligned_share",
        "spans", "sequences", "tokens" (the teacher tokens of the scored sequences), "notes"}``; ``span_top1`` is
        None when the cache holds no ranked top-k logits, and ``span_cosine`` leaves out pairs it cannot measure.
    """
    model, pairs_by_stream, projectors = load_run(run_dir, student)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to; its stub takes no device
    notes: list[str] = []
    depth = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    pairs, source = span_pairs(pairs_by_stream.get("", []), pairs, depth, sorted(reader.spec.hidden_layers), notes)
    s_tok = _student_tokenizer(student or Path(run_dir) / "student")
    kind = logit_kinds.of(reader.spec.logit_layout)
    ranked = kind is not None and kind.ranked
    if not ranked:
        notes.append("the cache holds no ranked top-k logits: no span top-1")
    aligner = SpanAligner(read_texts(reader.store, "span agreement"), s_tok,
                          getattr(model.config, "max_position_embeddings", None))
    names = ["input_ids", *(n for n in ("loss_mask", "position_ids") if n in reader.spec.token_arrays),
             *(["logits/topk_ids"] if ranked else []), *(f"hidden/{t}" for _, t in pairs)]
    sums, projection = _Sums(pairs), load_projection(reader)
    tokenizers = (cache_tokenizer(reader) if ranked else None, s_tok)
    for batch in cache_batches(reader, names, batch_size, limit=limit):
        aligner.extend(batch)  # the student's side, made on the host batch as training's reader makes it
        batch = to_device(batch, device, reader.spec.hidden_codec, projection)
        _update(sums, model, batch, tokenizers, pairs, projectors)
    return {**_result(sums, ranked, notes), "pairs": [list(p) for p in pairs], "pairs_from": source}


CROSS_KIND = "cross_tokenizer"  # an evaluation record's kind for a student with its own tokenizer
TOKENS_UNIT = "teacher tokens"  # what such a record's ``tokens`` count (its spans are ``spans``)


def is_cross_run(run_dir: str | Path) -> bool:
    """Whether the run trained with ``--cross-tokenizer`` (its ``options.json`` says so)."""
    return bool(read_json_object(Path(run_dir) / "options.json").get("cross_tokenizer"))


def evaluate_cross_run(run_dir: str | Path, reader: CacheReader, *, student: str | Path | None = None,
                       batch_size: int = 16, limit: int | None = None,
                       device: str | torch.device = "cpu") -> dict[str, Any]:
    """``kdcache eval``'s result for a cross-tokenizer run: ``evaluate_spans``' metrics with ``kind``
    "cross_tokenizer", the run's vocabulary loss, ``sequences``, ``tokens`` (the teacher tokens of the scored
    sequences; ``tokens_unit`` says so, ``spans`` counts the span metrics' spans) and ``notes``.

    Raises:
        CacheCheckError: the cache has no recorded texts (written without ``--record-text``), not one per
            sequence, or two token streams.
    """
    problems = text_problems(reader, "span agreement (evaluating a student with its own tokenizer)")
    if problems:
        raise CacheCheckError(problems, what="evaluation cannot start")
    result = evaluate_spans(run_dir, reader, student=student, batch_size=batch_size, limit=limit, device=device)
    vocab_loss = read_json_object(Path(run_dir) / "options.json").get("cross_tokenizer")
    return {"kind": CROSS_KIND, "cross_tokenizer": vocab_loss, **result, "tokens_unit": TOKENS_UNIT}


def span_pairs(run_pairs: list[Pair], given: list[Pair] | None, depth: int, cached: list[int],
               notes: list[str]) -> tuple[list[Pair], str]:
    """The pairs span CKA and cosine compare, and where they come from (``evaluate_spans``' ``pairs``).

    Args:
        run_pairs: the run's hidden map (``plan.json``), empty for a run without a hidden term.
        depth: the student's block count (its hidden states are 0..depth).
        cached: the hidden layers the evaluation cache holds.

    Raises:
        EvaluationError: a given pair names a student layer past ``depth`` or a teacher layer the cache lacks.
    """
    if given is not None:
        bad = [p for p in given if not 0 <= p[0] <= depth or p[1] not in cached]
        if bad:
            raise EvaluationError(f"pairs {bad}: expected student layers 0..{depth} and teacher layers the cache "
                                  f"holds ({cached})")
        return list(given), "given"
    if run_pairs:
        kept = [p for p in run_pairs if p[1] in cached]
        if len(kept) < len(run_pairs):
            notes.append(f"pairs {[p for p in run_pairs if p not in kept]} of the run's map skipped: the evaluation "
                         f"cache holds teacher layers {cached}")
        return kept, "run"
    pairs = default_pairs(list(range(depth + 1)), cached) if cached and depth else []
    if pairs:
        notes.append(f"no layer map in the run: span CKA and cosine on the uniform map {[list(p) for p in pairs]}")
    return pairs, "uniform"


def _student_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The student's own fast tokenizer (its tokens are aligned by their character offsets)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise EvaluationError(f"span agreement tokenizes the cache's texts with the student's own tokenizer, but "
                              f"{str(folder)!r} holds none that loads ({exc}); save it beside the student") from exc
    if not tokenizer.is_fast:
        raise EvaluationError(f"the tokenizer at {str(folder)!r} is a slow (Python) tokenizer without character "
                              f"offsets; save it with its tokenizer.json (a fast tokenizer)")
    return tokenizer


def _update(sums: _Sums, model: torch.nn.Module, batch: dict[str, torch.Tensor], tokenizers: tuple[Any, Any],
            pairs: list[Pair], projectors: dict[str, torch.Tensor]) -> None:
    """Add one batch: its counted spans' top-1 agreement (when the teacher's tokenizer is given), the aligned
    tokens, and per pair the span-pooled states ``[S, d]`` (and their cosine where the widths meet)."""
    side = {k: batch[k] for k in SIDE_KEYS}  # SpanAligner.extend's arrays, copied with the batch
    with torch.no_grad():
        out = model(input_ids=side["student/input_ids"], attention_mask=side["student/mask"], output_hidden_states=True)
    t_masks = token_masks(batch["mask"], batch.get("loss_mask"), batch.get("position_ids"), causal=True)
    counted = side["span_real"].bool() & span_rows(t_masks.predicts, side["teacher_last"])
    t_tok, s_tok = tokenizers
    if t_tok is not None:
        t_top = span_rows(batch["logits/topk_ids"][..., 0], side["teacher_last"])[counted].long().tolist()
        s_top = span_rows(out.logits.argmax(-1), side["student_last"])[counted].tolist()
        t_text = [token_text(t_tok, a) for a in t_top]
        sums.agree += sum(t == token_text(s_tok, b) for t, b in zip(t_text, s_top))
        sums.teacher_texts.update(t_text)
    sums.spans += int(counted.sum())
    sums.one, sums.tokens = sums.one + float(side["aligned"][0]), sums.tokens + float(side["aligned"][1])
    sums.sequences += len(side["span_real"])
    k = side["span_real"].shape[1]
    for s, t in pairs:
        key = pair_key((s, t))
        h_s = span_mean(out.hidden_states[s], side["student_span"], k)[counted]
        h_t = span_mean(batch[f"hidden/{t}"], side["teacher_span"], k)[counted]
        sums.pooled[key].append((h_s, h_t))
        # A one-stream run's exported projector of the pair (a cross-tokenizer run has one stream).
        weight, bias = projectors.get(f"layers.{key}.weight"), projectors.get(f"layers.{key}.bias")
        if weight is not None:
            h_s = F.linear(h_s, weight.to(h_s), None if bias is None else bias.to(h_s))
        if h_s.shape[-1] == h_t.shape[-1]:
            sums.cos[key] = sums.cos.get(key, 0.0) + float(F.cosine_similarity(h_s, h_t, dim=-1).sum())


def _result(sums: _Sums, ranked: bool, notes: list[str]) -> dict[str, Any]:
    """The metrics of a pass (``evaluate_spans``' return, less its pairs)."""
    cka = {}
    for key, parts in ((k, v) for k, v in sums.pooled.items() if v):
        h_s, h_t = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        cka[key] = float(linear_cka(h_s[None].float(), h_t[None].float(), torch.ones(1, len(h_s)).to(h_s)))
    unmeasured = [key for key in sums.pooled if key not in sums.cos]
    if unmeasured:
        notes.append(f"no span cosine for {unmeasured}: the widths differ and the student has no trained projector")
    spans = max(sums.spans, 1.0)
    cosine = {k: v / spans for k, v in sums.cos.items()}
    floor = max(sums.teacher_texts.values(), default=0) / spans
    return {"span_top1": sums.agree / spans if ranked else None, "span_top1_floor": floor if ranked else None,
            "span_cosine": cosine, "span_cka": cka,
            "span_cosine_mean": _mean(cosine), "span_cka_mean": _mean(cka),
            "aligned_share": sums.one / max(sums.tokens, 1.0), "spans": int(sums.spans),
            "sequences": int(sums.sequences), "tokens": int(sums.tokens), "notes": notes}


def _mean(values: dict[str, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None
