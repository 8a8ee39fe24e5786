"""``kdcache train --cross-tokenizer``: a student with its own tokenizer trains from a teacher's cache.

The cache's batch holds the teacher's tokens and targets and each row's global sequence id; the recorded text
(``stages.common.cache_texts``, written with ``precompute --record-text``) is tokenized with the student's
tokenizer and aligned with the teacher's tokens once per sequence (``SpanAligner``, kept for later epochs). Then:

* the student runs as the run's loss runs it (``DistillationLoss.student_outputs``: its LM head applied chunk by
  chunk in the losses where it is a plain linear layer, else its own forward), on its own tokens;
* CE on the student's own tokens (its loss mask: the spans holding a trained teacher token, ``align.student_mask``),
  never building ``[B, L_s, V_s]`` at once;
* the vocabulary term, ``gold`` or ``uld`` (``losses.cross_vocab``), between the teacher's cached top-k at each
  span's last teacher token and the student's logits at the span's last student token, counted where the
  teacher's own KL would count that token (``masks.token_masks(...).predicts``);
* hidden states: both sides averaged over each span's tokens (``cross_vocab.span_mean``), then the run's loss
  itself (its projectors, its hidden losses, its logged names) over spans instead of tokens.

Packed rows are tokenized by the student as one text (its positions do not restart at the teacher's document
starts). Attention terms are not aligned (``core.checks.cross_problems`` refuses ``--delta``).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from transformers import AutoTokenizer

from kdcache.stages.common.cache_texts import CacheTexts, MissingTextError, read_texts
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.vocab_pass import term_value
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.cross.align import Alignment, align, aligned_share, student_ends, student_mask
from kdcache.stages.train.losses.cross_vocab import (
    cross_vocab_term,
    shared_student_ids,
    shared_vocab,
    span_mean,
    span_rows,
)
from kdcache.stages.train.losses.logits import causal_ce
from kdcache.stages.train.objective.compound import RunLoss
from kdcache.storage import ArrayKind, read_table

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kdcache.stages.train.core.options import LossOptions, TrainOptions
    from kdcache.storage import CacheReader


class SpanAligner:
    """Student tokens and spans per cached sequence, computed on first use and kept (they never change), from the
    cache's recorded ``texts`` by the student's fast ``tokenizer``, cut at ``max_length`` (its position limit)."""

    def __init__(self, texts: CacheTexts, tokenizer: PreTrainedTokenizerBase, max_length: int | None):
        self.texts, self.tokenizer, self.max_length = texts, tokenizer, max_length
        self._done: dict[int, tuple[np.ndarray, Alignment]] = {}

    def __call__(self, sample_id: int) -> tuple[np.ndarray, Alignment]:
        """``(student ids [L_s] int64, alignment)`` of global sequence ``sample_id``."""
        if sample_id not in self._done:
            ids, ends = student_ends(self.tokenizer, self.texts.texts[sample_id], max_length=self.max_length)
            self._done[sample_id] = ids, align(self.texts.ends[sample_id], ends)
        return self._done[sample_id]

    def batch(self, sample_ids: list[int], teacher_masks: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """The student's side of a batch, padded: ``student/input_ids``, ``student/mask``, ``student/loss_mask``
        ``[B, L_s]``, ``student_span [B, L_s]``, ``teacher_span [B, L_t]``, ``teacher_last``, ``student_last``,
        ``span_real [B, K]`` (spans beyond a row's count are -1 / 0), and ``aligned [2]`` (one-to-one teacher
        tokens, teacher tokens)."""
        rows = [self(i) for i in sample_ids]
        for i, (_, a), t_mask in zip(sample_ids, rows, teacher_masks):
            if len(a.teacher_span) != len(t_mask):  # the batch's ids must be global sequence ids
                raise MissingTextError(f"sequence {i}: the batch holds {len(t_mask)} teacher tokens but its recorded "
                                       f"text has {len(a.teacher_span)}; the cache's texts/ do not belong to its "
                                       f"shards")
        sizes = {"ls": max(max(len(ids) for ids, _ in rows), 1), "lt": max(len(m) for m in teacher_masks),
                 "k": max(max(a.spans for _, a in rows), 1)}
        out = {name: np.full((len(rows), sizes[n]), fill, np.int64) for name, (n, fill) in _SIDE.items()}
        for b, ((ids, a), t_mask) in enumerate(zip(rows, teacher_masks)):
            n, spans = len(ids), a.spans
            out["student/input_ids"][b, :n], out["student/mask"][b, :n] = ids, 1
            out["student/loss_mask"][b, :n] = student_mask(a, t_mask)
            out["student_span"][b, :n], out["teacher_span"][b, :len(a.teacher_span)] = a.student_span, a.teacher_span
            out["teacher_last"][b, :spans], out["student_last"][b, :spans] = a.last("teacher"), a.last("student")
            out["span_real"][b, :spans] = 1
        tensors = {name: torch.from_numpy(v) for name, v in out.items()}
        one = sum(a.one_to_one() for _, a in rows)
        tensors["aligned"] = torch.tensor([one, sum(len(a.teacher_span) for _, a in rows)], dtype=torch.float32)
        return tensors

    def extend(self, batch: dict[str, Any]) -> None:
        """Add the student's side (``batch``'s keys above) to a collated host batch, in place: the reader's
        ``streaming.BatchExtension``, so tokenizing and aligning run where batches are made, off the step."""
        # Each row's teacher loss mask [L_t] (all ones without a cached one), cut to its real tokens.
        real = batch["mask"].cpu().numpy().astype(bool)
        loss = batch["loss_mask"].cpu().numpy() if ArrayKind.LOSS_MASK in batch else real.astype(np.int64)
        batch.update(self.batch(batch["sample_ids"].tolist(), [loss[b][real[b]] for b in range(len(real))]))


# What SpanAligner.batch adds, but "aligned": per key the length it is padded to (student tokens, teacher tokens or
# spans) and its padding (-1: no token, for the span indexes).
_SIDE = {"student/input_ids": ("ls", 0), "student/mask": ("ls", 0), "student/loss_mask": ("ls", 0),
         "student_span": ("ls", -1), "teacher_span": ("lt", -1), "teacher_last": ("k", -1),
         "student_last": ("k", -1), "span_real": ("k", 0)}
SIDE_KEYS = (*_SIDE, "aligned")


class CrossDistillModel(nn.Module):
    """What DeepSpeed trains with ``--cross-tokenizer``: the student, ``criterion`` (the run's loss,
    ``train.loss.DistillationLoss`` built without its logit KL, with its projectors: it runs the student and gives
    the span-pooled hidden term) and the vocabulary term (module docstring)."""

    shared: torch.Tensor  # [V_t] buffers (registered below): per teacher id its student id, -1 where none
    student_shared: torch.Tensor  # [V_s] bool: the student ids some teacher id maps to

    def __init__(self, student: PreTrainedModel, criterion: RunLoss, aligner: SpanAligner, shared: torch.Tensor,
                 loss: LossOptions, *, announce: bool = False):
        super().__init__()
        # The aligner runs in the reader (``aligner.extend``, the stream's extension); the model reads its arrays.
        self.student, self.criterion, self.aligner = student, criterion, aligner
        self.register_buffer("shared", shared, persistent=False)
        self.loss = loss  # the run's weights, --cross-tokenizer, and the KL's temperature and --topk-kl (GOLD's part)
        self.vocab_loss = loss.cross_tokenizer or "gold"
        # Only a vocabulary term reads it; a student without an LM head (α = β = 0) may have no vocabulary at all.
        vocab = int(getattr(student.config, "vocab_size", 0) or 0) if loss.kl_weight > 0 else 0
        student_shared = shared_student_ids(shared, vocab) if vocab else torch.zeros(0, dtype=torch.bool)
        self.register_buffer("student_shared", student_shared, persistent=False)
        self.want_hidden = any(part.layer_map for part in (criterion.part(s) for s in criterion.streams))
        # The criterion says which path the vocabulary terms take (rank 0, without --quiet); its own parts hold no
        # logit KL here, so it is told: this model's vocabulary term is outside them.
        criterion.announce_head = announce

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Args: the teacher's batch on the device (``streaming.collate`` + ``to_device``), with the student's side
        added by ``SpanAligner.extend`` before the copy (no host work or sync here)."""
        device = batch["mask"].device
        missing = [k for k in SIDE_KEYS if k not in batch]
        if missing:  # a stream built without the aligner's extension: a wiring fault, not a user's
            raise RuntimeError(f"cross-tokenizer batch lacks {missing}: stream it with SpanAligner.extend")
        side = {k: batch[k] for k in SIDE_KEYS}
        # The student on its own tokens, run by the criterion as on the ordinary path: ``logits`` as ``HeadLogits``
        # where its head is a plain linear layer (``[B, L_s, V_s]`` never built), else materialised. Its rows are
        # one text each (no ``position_ids``), so there are no packed documents to keep apart.
        out = self.criterion.student_outputs(self.student, {"input_ids": side["student/input_ids"],
                                                             "mask": side["student/mask"]})
        s_masks = token_masks(side["student/mask"], side["student/loss_mask"], causal=True)
        t_masks = token_masks(batch["mask"], batch.get("loss_mask"), batch.get("position_ids"), causal=True)
        real = side["span_real"].bool()
        terms: dict[str, torch.Tensor] = {}
        total = torch.zeros((), device=device)
        # CE is asked of the loss function, not of the criterion: one call of the criterion has one mask, and CE
        # counts the student's tokens where its hidden term counts spans.
        if self.loss.ce_weight > 0:  # a student without an LM head trains on hidden states alone (α = β = 0)
            terms["ce"] = causal_ce(out.logits, side["student/input_ids"], s_masks.real, pairs=s_masks.pairs)
            total = self.loss.ce_weight * terms["ce"]
        if self.loss.kl_weight > 0:
            terms[self.vocab_loss] = self._vocab_term(out.logits, batch, side, real & span_rows(t_masks.predicts,
                                                                                                side["teacher_last"]))
            total = total + self.loss.kl_weight * terms[self.vocab_loss]
        logs: dict[str, torch.Tensor] = {}
        if self.want_hidden:
            hidden = self._hidden_terms(out.hidden_states, batch, side, t_masks.trained)
            total = total + hidden.pop("loss")
            logs.update(hidden)
        share = side["aligned"]
        return {"loss": total, **{k: v.detach() for k, v in terms.items()}, **logs,
                "aligned_share": (share[0] / share[1].clamp_min(1.0)).to(device)}

    def _vocab_term(self, logits: torch.Tensor | HeadLogits, batch: Mapping[str, torch.Tensor],
                    side: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """``gold`` or ``uld`` over the spans ``mask [B, K]`` counts, in one chunked pass over the span rows."""
        t_last, s_last = side["teacher_last"], side["student_last"]
        values, ids = span_rows(batch["logits/topk_values"], t_last), span_rows(batch["logits/topk_ids"], t_last)
        lse = span_rows(batch["logits/lse"], t_last) if "logits/lse" in batch else values.new_zeros(values.shape[:2])
        at_spans = (HeadLogits(span_rows(logits.hidden, s_last), logits.weight, logits.bias)
                    if isinstance(logits, HeadLogits) else span_rows(logits, s_last))
        return term_value(at_spans, cross_vocab_term(self.vocab_loss, at_spans, values, ids, lse, mask, self.shared,
                                                     self.student_shared,
                                                     temperature=self.loss.logit.resolved_temperature(),
                                                     variant=self.loss.logit.topk_kl))

    def _hidden_terms(self, states: tuple[torch.Tensor, ...], batch: Mapping[str, torch.Tensor],
                      side: Mapping[str, torch.Tensor], trained: torch.Tensor) -> dict[str, torch.Tensor]:
        """The criterion over spans: both sides' states ``[B, L, d]`` pooled to ``[B, K, d]``, each span real where
        the row has it and trained where it holds a trained teacher token. Without logits its parts compute the
        hidden term alone (CE and the vocabulary term are over other rows: the student's tokens, the spans' ends)."""
        pairs = self.criterion.part(self.criterion.streams[-1]).layer_map
        k = side["span_real"].shape[1]
        used = {s for s, _ in pairs}
        pooled = tuple(span_mean(h, side["student_span"], k) if i in used else h for i, h in enumerate(states))
        t_span = side["teacher_span"]
        spans = {f"hidden/{t}": span_mean(batch[f"hidden/{t}"], t_span, k) for _, t in pairs}
        spans["loss_mask"] = span_mean(trained.float()[..., None], t_span, k)[..., 0] > 0
        spans["mask"] = side["span_real"]
        return self.criterion(SimpleNamespace(logits=None, hidden_states=pooled, attentions=None), spans)


def build_cross_model(options: TrainOptions, reader: CacheReader, student: PreTrainedModel, criterion: RunLoss,
                      *, announce: bool) -> CrossDistillModel:
    """The cross-tokenizer model for this run: texts read (and checked) once, the student's tokenizer loaded, the
    shared vocabulary mapped."""
    texts = read_texts(reader.store, "--cross-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(options.run.student)
    if not tokenizer.is_fast:  # alignment reads each token's characters (offsets), which only fast tokenizers give
        raise MissingTextError(f"--cross-tokenizer: the student's tokenizer at {options.run.student!r} is a slow "
                               f"(Python) tokenizer without character offsets; save it with its tokenizer.json "
                               f"(a fast tokenizer)")
    vocab = int(getattr(student.config, "vocab_size", 0) or 0)
    if vocab and len(tokenizer) > vocab:  # its ids would index past the student's embedding (and logits)
        raise MissingTextError(f"--cross-tokenizer: the student's tokenizer at {options.run.student!r} has "
                               f"{len(tokenizer)} tokens, but its model's vocabulary (config vocab_size) is {vocab}; "
                               f"expected a tokenizer the student was built for")
    teacher = cache_tokenizer(reader)
    size = int(reader.spec.vocab_size or len(teacher))
    shared = shared_vocab(teacher.get_vocab(), tokenizer.get_vocab(), size)
    if announce:
        sample = [align(texts.ends[i], student_ends(tokenizer, texts.texts[i])[1]) for i in range(min(len(texts), 64))]
        print(f"kdcache train: --cross-tokenizer {options.loss.cross_tokenizer}: {int((shared >= 0).sum())} of "
              f"{size} teacher tokens share a string with the student's vocabulary; aligned share "
              f"{aligned_share(sample):.3f} on the first {len(sample)} sequences", file=sys.stderr)
    max_length = getattr(student.config, "max_position_embeddings", None)
    return CrossDistillModel(student, criterion, SpanAligner(texts, tokenizer, max_length), shared, options.loss,
                             announce=announce)


def cache_tokenizer(reader: CacheReader) -> PreTrainedTokenizerBase:
    """The teacher's tokenizer, from the cache's ``tokenizer/`` folder (copied to a temporary folder to load; its
    file table read first: a missing or damaged folder is a ``ManifestError``, not a tokenizer library's error)."""
    with tempfile.TemporaryDirectory(prefix="kdcache-teacher-tokenizer-") as tmp:
        for key in read_table(reader.store, "tokenizer"):
            (Path(tmp) / key.split("/", 1)[1]).write_bytes(reader.store.read(key))
        return AutoTokenizer.from_pretrained(tmp)


def without_logit_kl(options: TrainOptions) -> TrainOptions:
    """The options the ordinary criterion is built from: the vocabulary term is this module's, not a logit kind's."""
    return replace(options, loss=replace(options.loss, beta=0.0))
