"""A student scored on a held-out cache while it trains: every loss term of the run, and its agreement with the
teacher (top-1, KL) where the cache holds logits. ``CacheTrainer.evaluate`` and ``kdcache train --eval-cache``
both call ``HeldOut.score``; the agreement is ``LmStats``, the sums ``kdcache eval`` keeps.

A held-out cache is checked against the training cache first: the same teacher (config and weights hashes), the
same tokenizer, the same target settings (logit mode, top-k, samples...) and every array the loss reads. Anything
else would score the student against another model's targets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.hidden.device_codecs import load_projection
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train.core.masks import stream_masks
from kdcache.stages.train.evaluation.agreement import LmStats
from kdcache.stages.train.evaluation.evaluate import EvaluationError, cache_batches
from kdcache.stages.train.feed.streaming import to_device
from kdcache.storage import prefixed

if TYPE_CHECKING:
    from kdcache.stages.targets.logits.teacher_head import TeacherHead
    from kdcache.storage import CacheReader

# The settings that say what a cached target means: two caches differing in one of them hold different targets.
TARGET_SETTINGS = ("logits", "top_k", "samples", "sampling", "sample_temperature", "heads", "packing")
StudentRun = Callable[[Mapping[str, Any]], Any]  # a device batch -> the student's outputs (the loss's)
Criterion = Callable[[Any, Mapping[str, Any]], dict[str, torch.Tensor]]  # outputs, batch -> {"loss", terms...}


def heldout_problems(train: CacheReader, held: CacheReader, names: tuple[str, ...] | list[str]) -> list[str]:
    """Why ``held`` cannot score a student trained on ``train`` with a loss reading ``names``; empty when it can."""
    mine, theirs = held.fingerprints or {}, train.fingerprints or {}
    problems = []
    teacher, trained = mine.get("teacher") or {}, theirs.get("teacher") or {}
    if any(teacher.get(k) != trained.get(k) for k in ("config_hash", "weights_hash")):
        problems.append(f"its teacher {teacher.get('name_or_path')!r} is not the training cache's "
                        f"{trained.get('name_or_path')!r} (their config or weights hashes differ)")
    tokenizer, trained_tokenizer = mine.get("tokenizer") or {}, theirs.get("tokenizer") or {}
    if tokenizer.get("vocab_hash") != trained_tokenizer.get("vocab_hash"):
        problems.append("its tokenizer is not the training cache's (their vocabulary hashes differ)")
    settings, trained_settings = mine.get("settings") or {}, theirs.get("settings") or {}
    problems += [f"setting {key} is {settings.get(key)!r} there and {trained_settings.get(key)!r} in the training "
                 f"cache" for key in TARGET_SETTINGS if settings.get(key) != trained_settings.get(key)]
    missing = [name for name in names if name not in held.spec.sequence_names()]
    if missing:
        problems.append(f"it lacks {', '.join(missing)}, which the loss reads")
    return problems


class HeldOut:
    """A held-out cache, checked against the training cache, and how a student is scored on it.

    Args:
        names: the arrays the loss reads (``TrainPlan.names``).
        limit: score only the first ``limit`` sequences (None: all of them).
        label: how the messages name the held-out cache (``eval_cache``, ``--eval-cache``).

    Raises:
        EvaluationError: naming the held-out cache and every way it differs from the training cache.
    """

    def __init__(self, reader: CacheReader, train: CacheReader, names: tuple[str, ...] | list[str], *,
                 batch_size: int, limit: int | None = None, label: str = "eval_cache"):
        problems = heldout_problems(train, reader, names)
        if problems:
            raise EvaluationError(f"{label} {str(reader.root)!r} cannot score a student trained on "
                                  f"{str(train.root)!r}: {'; '.join(problems)}; expected a held-out cache written "
                                  f"by the same teacher with the same settings")
        if batch_size < 1:
            raise EvaluationError(f"{label}: batch size {batch_size}; expected >= 1")
        self.reader, self.names, self.batch_size, self.limit = reader, list(names), batch_size, limit
        self.kind = logit_kinds.of(reader.spec.logit_layout)
        self.projection = load_projection(reader)  # a rank codec's bases, to decode its hidden states
        self._head: TeacherHead | None = None  # the teacher's LM head of a ``--logits head`` cache, loaded on first use

    @torch.no_grad()
    def score(self, run: StudentRun, criterion: Criterion, *, lm: str | None,
              device: torch.device | str) -> dict[str, float]:
        """Every loss term, its mean over the held-out sequences, and the agreement with the teacher.

        Every rank scores the whole cache (it is not split), so each rank returns the same numbers.

        Args:
            run: the student's forward on a device batch (``DistillationLoss.student_outputs``), in eval mode.
            criterion: the run's loss in eval mode: ``criterion(outputs, batch) -> {"loss", term: value}``.
            lm: "causal" or "seq2seq" for a student with an LM head (agreement is measured), None otherwise.

        Returns:
            ``{"loss", each term, "sequences", "tokens"}`` and with teacher logits and an LM student
            ``"top1_agreement"``, ``"kl"`` (KL(teacher || student) per valid token, at T=1) and ``"perplexity"``.
            A term is the mean of its batch values weighted by each batch's sequences.
        """
        stats = self._stats(lm, device)
        sums: dict[str, float] = {}
        sequences = tokens = 0
        main = self.reader.spec.streams[-1]
        for host in cache_batches(self.reader, self.names, self.batch_size, limit=self.limit):
            batch = to_device(host, device, self.reader.spec.hidden_codec, self.projection)
            out = run(batch)
            count = int(batch["sample_ids"].shape[0])
            for name, value in criterion(out, batch).items():
                sums[name] = sums.get(name, 0.0) + float(value) * count
            masks = stream_masks(batch, prefixed(main, ""), causal=lm == "causal")
            if stats is not None:
                stats.update(out.logits, batch[prefixed(main, "input_ids")], masks, batch)
            sequences += count
            tokens += int(masks.trained.sum())
        if not sequences:
            raise EvaluationError(f"the held-out cache {str(self.reader.root)!r} gave no sequences to score")
        result = {name: total / sequences for name, total in sums.items()}
        if stats is not None:
            lm_result = stats.result()
            result.update({k: float(lm_result[k]) for k in ("top1_agreement", "kl", "perplexity") if k in lm_result})
        return {**result, "sequences": float(sequences), "tokens": float(tokens)}

    def _stats(self, lm: str | None, device: torch.device | str) -> LmStats | None:
        """``kdcache eval``'s running sums of the agreement, when the cache has logits and the student a head."""
        if lm is None or self.kind is None:
            return None
        if self.kind.teacher_head and self._head is None:
            self._head = load_teacher_head(self.reader.store, self.reader.spec.hidden_layers)
        head = self._head.to(device) if self._head is not None else None
        return LmStats(self.kind, lm == "causal", head, self.reader.spec.sample_temperature)
