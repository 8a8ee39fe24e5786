"""Student-vs-teacher agreement measured against a cache: no teacher in memory.

Everything the teacher contributes comes from a (usually held-out) cache; the student comes from a run's
``student/`` folder, its layer maps from ``plan.json`` and its projectors from ``projectors.pt``. This module
never imports stage one and never loads a teacher. Batches are made by stage two's own ``collate`` and fed to
the student by the same ``student_inputs``, so every cache layout (one token stream, or encoder and decoder)
is evaluated by the same code:

* Language-model students (the cache has logits): perplexity of the main stream's tokens (the next token for a
  causal LM; the cached target for an encoder-decoder), top-1 agreement with the teacher, and
  KL(teacher || student) per valid token at T=1.
* Encoders are compared the way sentence-embedding users compare them: mean-pooled final states, their cosine
  (same width, or through the run's projector for the last pair), and the Spearman correlation of the two
  models' pairwise-similarity matrices.
* Every run: linear CKA for every (student layer, cached teacher layer) pair of each stream — the alignment
  heatmaps, one per stack — and its values on the run's layer maps.
* Runs with attention pairs: the run's attention KL per pair (``AttentionAgreement``), whatever the cache's
  attention source. A maps cache is read as training reads it (the student's eager maps against
  ``attention/{t}``); a q/k cache through the same recorder and blocked KL as training (the student keeps SDPA).
  Both give DESIGN's attention KL, so an evaluation reads alike for both sources: ``attention: {"kl": mean over
  pairs, "pairs": {"s1_t2": ...}, "source": ...}``, each pair's KL averaged over the counted query rows of every
  batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.targets import attention as attention_sources, logits as logit_kinds
from kdcache.stages.targets.attention.attention_maps import use_maps_attention
from kdcache.stages.targets.attention.qk_attention import QKRecorder
from kdcache.stages.targets.hidden.device_codecs import load_projection
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train.core.checks import CacheCheckError, stream_problems, vocab_problems
from kdcache.stages.train.core.layer_maps import LayerMap, LayerMapError, Pair, pair_key
from kdcache.stages.train.core.masks import TokenMasks, stream_masks
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.core.student import (
    ADAPTER_CONFIG,
    load_config,
    load_student,
    student_facts,
    tokenizer_fingerprint_of,
)
from kdcache.stages.train.evaluation.agreement import (
    CkaMatrix,
    LmStats,
    cka_result,
    final_state_agreement,
    mean_pool,
)
from kdcache.stages.train.feed.streaming import collate, to_device
from kdcache.stages.train.objective.compound import CompoundLoss, StudentOutput
from kdcache.stages.train.objective.distill import check_documents_apart, recorded, student_inputs, student_view
from kdcache.storage import CacheReader, KdcacheError, prefixed, read_json_object

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.stages.train.core.student import StudentFacts
    from kdcache.storage import CacheSpec


class EvaluationError(KdcacheError):
    """The run or the cache cannot be evaluated (no exported student, nothing comparable in the cache)."""


def cache_batches(reader: CacheReader, names: list[str], batch_size: int, *, limit: int | None = None,
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """Padded batches of cached sequences, in cache order, read a whole shard at a time, carrying each row's global
    sequence id.

    Yields:
        ``streaming.collate`` batches in the stored dtypes (``to_device`` makes targets float32 where they go,
        dense logits excepted):
        per stream ``input_ids`` / ``mask`` ``[B, L]``, and every other name in ``names``.
    """
    rows = islice(_numbered(reader, names), limit)
    while pending := list(islice(rows, batch_size)):
        ids, sequences = zip(*pending)
        yield collate(list(sequences), list(ids))  # global ids: the texts are looked up by them


def _numbered(reader: CacheReader, names: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each committed sequence with its global id, taken from its shard's range (so that a partial cache's
    missing shards do not shift the ids after them)."""
    for index in reader.committed_shards:
        yield from enumerate(reader.iter_sequences([index], names), reader.spec.shard_range(index)[0])


# ---- one run against one cache -----------------------------------------------------------------------------
def load_run(run_dir: str | Path, student_path: str | Path | None = None
             ) -> tuple[PreTrainedModel, dict[str, list[Pair]], dict[str, torch.Tensor]]:
    """The student (eval mode), the run's hidden layer map per stream and its projector weights.

    Args:
        run_dir: the run; its ``student/`` is scored unless ``student_path`` names another student.
        student_path: any student (a model folder, or a config.json folder: random init, seed 0), e.g. the
            untrained initial student as the run's baseline. It has no trained projectors.

    Raises:
        EvaluationError: no student to score (the run has no ``student/`` and none was named).
    """
    run = Path(run_dir)
    if student_path is None and not (run / "plan.json").is_file():  # with --student, a run to be (its baseline)
        raise EvaluationError(f"--run {str(run)!r} is not a training run (no plan.json there); expected the --out "
                              f"folder of a `kdcache train`, a folder CacheTrainer.save_model or "
                              f"DistillationLoss.save_run wrote, or name a student with --student to score it there")
    if student_path is None and not _holds_model(trained_student(run)):
        raise EvaluationError(f"{run} has no exported student/ (still training, failed, or --no-export); "
                              "evaluate a finished run, or name a student with --student")
    student = load_student(student_path or trained_student(run), seed=0).eval()
    plan = read_json_object(run / "plan.json")
    by_stream = plan.get("streams") or {"": plan}
    pairs = {stream: [(int(s), int(t)) for s, t in part.get("hidden_pairs", [])] for stream, part in by_stream.items()}
    # The attention pairs of a one-stream run ride along under their own key (evaluation's attention agreement).
    pairs["attention"] = [(int(s), int(t)) for s, t in plan.get("attention_pairs", [])] if "streams" not in plan else []
    projectors: dict[str, torch.Tensor] = {}
    if student_path is None and (run / "projectors.pt").is_file():
        projectors = torch.load(run / "projectors.pt", map_location="cpu").get("projectors", {})
    return student, pairs, projectors


def trained_student(run: Path) -> Path:
    """The trained student of a run: ``RUN/student`` (``kdcache train``, ``DistillationLoss.save_run``), or the run
    folder itself when the student was saved there with the record beside it (``CacheTrainer.save_model``). Either
    may hold a PEFT model's adapters, which score loaded into their base model (``load_student``)."""
    return run if _holds_model(run) and not (run / "student").is_dir() else run / "student"


def _holds_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / ADAPTER_CONFIG).is_file()


def default_pairs(student_layers: list[int], teacher_layers: list[int]) -> list[Pair]:
    """The uniform map (``--layer-map``'s default) from the student's blocks to the teacher's, j -> floor(jN/M),
    keeping the pairs whose teacher layer the evaluation cache holds; none when the student has more blocks than
    the cache's deepest layer (no uniform map exists then)."""
    blocks, depth = max(student_layers), max(teacher_layers)
    try:
        pairs = LayerMap().build(blocks, depth)  # the default map: uniform
    except LayerMapError:
        return []
    return [(s, t) for s, t in pairs if t in teacher_layers and s > 0]


@torch.no_grad()
def evaluate_run(run_dir: str | Path, reader: CacheReader, *, batch_size: int = 16, limit: int | None = None,
                 teacher_layer: int | None = None, device: str | torch.device = "cpu",
                 student: str | Path | None = None) -> dict[str, Any]:
    """Evaluate a run's exported student against a cache, in one pass over the cache.

    Args:
        run_dir: the run directory (``student/``, ``plan.json``, ``projectors.pt``).
        teacher_layer: the teacher layer final states are compared with (default: the deepest cached one).
        student: score this student instead of the run's (see ``load_run``).

    Returns:
        A JSON-ready dict: ``kind`` ("causal_lm" | "encoder_decoder_lm" | "encoder"), the metrics of that kind, ``cka``
        (the main stream's alignment matrix and its values on the layer map; ``cka_streams`` has every stream's
        when the cache has two), ``sequences`` evaluated and their trained ``tokens`` (the loss mask's), and
        ``notes`` explaining anything skipped.
    """
    model, pairs, projectors = load_run(run_dir, student)
    facts = student_facts(model)
    check_student_fits(reader, facts, tokenizer_fingerprint_of(student or trained_student(Path(run_dir))))
    model.to(device)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to; its stub takes no device
    state = _EvalState(reader, facts, teacher_layer, device, pairs.pop("attention"), model)
    sequences = tokens = 0
    projection = load_projection(reader)  # a rank codec's bases
    for batch in cache_batches(reader, state.names, batch_size, limit=limit):
        batch = to_device(batch, device, reader.spec.hidden_codec, projection)
        if not sequences:
            check_documents_apart(model, batch)
        out = state.attention.forward(model, student_inputs(model, batch), output_hidden_states=True)
        state.update(out, batch)
        sequences += int(batch["sample_ids"].shape[0])
        tokens += sum(int(stream_masks(batch, prefixed(s, ""), causal=False).trained.sum()) for s in state.streams)
    return {**state.result(pairs, projectors), "sequences": sequences, "tokens": tokens}


def lm_kind(facts: StudentFacts) -> str | None:
    """How ``HeldOut.score`` measures a student's agreement with the teacher (its ``lm``): "causal", "seq2seq", or
    None for a student without an LM head."""
    if facts.is_encoder_decoder:
        return "seq2seq"
    return "causal" if facts.is_causal and facts.has_lm_head else None


KINDS = {"causal": "causal_lm", "seq2seq": "encoder_decoder_lm", None: "encoder"}  # an evaluation's kind, by lm_kind


class AttentionAgreement:
    """Sums of the attention KL of each pair over an evaluation's batches (one-stream caches).

    Args:
        spec: the cache's spec (its ``attention_source`` and ``attention_scores``).
        pairs: the run's attention pairs whose teacher block is cached.
        student: the student; maps need its eager attention, a q/k cache records its queries and keys.
        causal: the student's causality.
    """

    def __init__(self, spec: CacheSpec, pairs: list[Pair], student: PreTrainedModel, causal: bool) -> None:
        self.source, self.pairs = attention_sources.of(spec.attention_layout), pairs
        self.sums = dict.fromkeys((pair_key(p) for p in pairs), 0.0)
        self.rows = 0
        blocks = sorted({s for s, _ in pairs})
        self.recorder = QKRecorder(student, blocks, causal) if not self.source.student_maps and pairs else None
        if self.source.student_maps and pairs:
            use_maps_attention(student)  # fused kernels return no maps; eager's come after dropout
        # Training's own attention term alone, so both read the student's maps or q/k as training does.
        self.term = CompoundLoss(LossOptions(alpha=0.0, beta=0.0, gamma=0.0, delta=1.0), attention_map=pairs,
                                 teacher_scores=None if self.source.student_maps else spec.attention_scores or {})

    @property
    def names(self) -> list[str]:
        """The cached arrays the pairs read."""
        kinds = self.source.stream_kinds("kl")
        return [f"{kind}/{t}" for t in sorted({t for _, t in self.pairs}) for kind in kinds]

    def forward(self, model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], **kwargs: bool) -> StudentOutput:
        """The student's outputs, with its maps or its recorded ``attention_qkv`` when pairs need them."""
        if self.recorder is None:
            return model(**inputs, output_attentions=bool(self.pairs), **kwargs)
        return recorded(self.recorder, lambda: model(**inputs, **kwargs))

    def update(self, out: StudentOutput, batch: Mapping[str, torch.Tensor], masks: TokenMasks) -> None:
        """Add one batch: each pair's KL times the batch's counted query rows."""
        rows = int(masks.trained.sum())
        if not self.pairs or not rows:
            return
        logs = self.term(out, batch, masks.real)  # "attention/s1_t2": each pair's KL over the trained query rows
        for pair in self.pairs:
            self.sums[pair_key(pair)] += float(logs[f"attention/{pair_key(pair)}"]) * rows
        self.rows += rows

    def result(self) -> dict[str, Any] | None:
        """``{"kl", "pairs", "source"}``, or None when the run has no attention pair in this cache."""
        if not self.pairs or not self.rows:
            return None
        pairs = {key: total / self.rows for key, total in self.sums.items()}
        return {"kl": sum(pairs.values()) / len(pairs), "pairs": pairs, "source": self.source.name}


class _EvalState:
    """What one pass over the cache accumulates: CKA sums per stream, LM sums, pooled final states."""

    def __init__(self, reader: CacheReader, facts: StudentFacts, teacher_layer: int | None,
                 device: str | torch.device, attention_pairs: list[Pair], model: PreTrainedModel):
        """``attention_pairs``: the run's; the attention KL is measured on those whose teacher block is cached."""
        spec = reader.spec
        self.kind, self.streams, self.main = KINDS[lm_kind(facts)], list(spec.streams), spec.streams[-1]
        self.depth = facts.decoder_layers if self.main == "decoder" else facts.num_layers
        cached = {s: sorted(hidden) for s, hidden, _ in spec.stream_layers()}
        depths = {"": facts.num_layers, "encoder": facts.num_layers, "decoder": facts.decoder_layers}
        self.cka = {s: CkaMatrix(list(range(depths[s] + 1)), layers) for s, layers in cached.items() if layers}
        deepest = cached[self.main][-1] if cached[self.main] else None
        self.final = teacher_layer if teacher_layer is not None else deepest
        kind = logit_kinds.of(spec.logit_layout)
        uses_head = kind is not None and kind.teacher_head and self.kind != "encoder"
        head = load_teacher_head(reader.store, spec.hidden_layers).to(device) if uses_head else None
        self.lm = (LmStats(kind, self.kind == "causal_lm", head, spec.sample_temperature)
                   if self.kind != "encoder" else None)
        self.pooled_s: list[torch.Tensor] = []  # [B, d_s] per batch: the student's last layer, mean-pooled
        self.pooled_t: list[torch.Tensor] = []  # [B, d_t]: the teacher's final cached layer
        self.notes: list[str] = []
        self.names = spec.token_names()
        self.names += [prefixed(s, f"hidden/{j}") for s, layers in cached.items() for j in layers]
        self.names += spec.logit_arrays() if self.lm is not None else []
        _check_inputs(bool(spec.logits), self.final, cached[self.main], self.kind, self.notes)
        cached_blocks = set(spec.attention_layers)
        self.attention = AttentionAgreement(spec, [p for p in attention_pairs if p[1] in cached_blocks], model,
                                            facts.is_causal)
        self.names += self.attention.names

    def update(self, out: Any, batch: dict[str, torch.Tensor]) -> None:
        for stream, cka in self.cka.items():
            valid = stream_masks(batch, prefixed(stream, ""), causal=False).trained
            hidden = student_view(out, stream, stream == self.main).hidden_states
            cka.update({j: h[valid].float() for j, h in enumerate(hidden)},
                       {j: batch[prefixed(stream, f"hidden/{j}")][valid] for j in cka.teacher_layers})
        masks = stream_masks(batch, prefixed(self.main, ""), causal=self.kind == "causal_lm")
        ids, mask = batch[prefixed(self.main, "input_ids")], masks.trained
        if self.lm is not None:
            self.lm.update(out.logits, ids, masks, batch)
        self.attention.update(out, batch, masks)
        if self.kind == "encoder" and self.final is not None:
            self.pooled_s.append(mean_pool(out.hidden_states[-1].float().cpu(), mask.cpu()))
            self.pooled_t.append(mean_pool(batch[f"hidden/{self.final}"].cpu(), mask.cpu()))

    def result(self, pairs: dict[str, list[Pair]], projectors: dict[str, torch.Tensor]) -> dict[str, Any]:
        main_pairs = pairs.get(self.main, [])
        result: dict[str, Any] = {"kind": self.kind, "teacher_layer": self.final,
                                  "layer_map": [list(p) for p in main_pairs]}
        if self.lm is not None:
            result.update(self.lm.result())
        if self.pooled_s:
            result.update(final_state_agreement(torch.cat(self.pooled_s), torch.cat(self.pooled_t), projectors,
                                                self.depth, self.final, self.notes))
        if self.main in self.cka:
            cka = self.cka[self.main]
            if not main_pairs:  # a baseline scored before training has no map yet: the default one, uniform
                main_pairs = default_pairs(cka.student_layers, cka.teacher_layers)
                if main_pairs:
                    result["layer_map_note"] = "no layer map in the run yet: CKA on the uniform map"
            result["cka"] = cka_result(cka, main_pairs)
        if len(self.streams) > 1 and self.cka:
            result["cka_streams"] = {s: cka_result(cka, pairs.get(s, [])) for s, cka in self.cka.items()}
        attention = self.attention.result()
        if attention is not None:
            result["attention"] = attention
        result["notes"] = self.notes
        return result


def check_student_fits(reader: CacheReader, facts: StudentFacts, tokenizer: dict[str, Any] | None) -> None:
    """Refuse a student that does not fit the cache, with training's own sentences (``checks.vocab_problems``).
    ``tokenizer``: the student's tokenizer fingerprint, or None when its folder holds no tokenizer.

    Raises:
        CacheCheckError: every mismatch (token streams, vocabulary, tokenizer), before anything is scored.
    """
    problems = stream_problems(reader.spec, facts)
    if not problems:  # a student of the wrong family has no vocabulary worth comparing
        logits_needed = lm_kind(facts) is not None and bool(reader.spec.logits)
        problems = vocab_problems(reader, facts.vocab_size, tokenizer, logits_needed=logits_needed)
    if problems:
        raise CacheCheckError(problems, what="evaluation cannot start")


def _check_inputs(logits: bool, final: int | None, cached: list[int], kind: str, notes: list[str]) -> None:
    """Refuse a teacher layer the cache lacks; note what will be skipped (``logits``: the cache holds teacher's)."""
    if final is None:
        notes.append("the cache holds no hidden states: no CKA and no final-state agreement")
    if final is not None and final not in cached:
        raise EvaluationError(f"teacher layer {final} is not in the cache (it holds {cached})")
    if kind == "encoder" and logits:
        notes.append("the cache has logits but the student is not a causal LM: logit metrics skipped")
    if kind != "encoder" and not logits:
        notes.append("the cache holds no teacher logits: perplexity only (no top-1 agreement, no KL)")


def student_folder_problems(reader: CacheReader, student: str | Path) -> list[str]:
    """The vocabulary and tokenizer checks of ``check_student_fits`` from a student's folder alone (its config
    and tokenizer, no weights): the sweep runs them before its first run, for its evaluation cache."""
    vocab = int(getattr(load_config(student), "vocab_size", 0) or 0)
    # The logit comparison needs the model class (does it have a head?); the child's eval checks that part.
    return vocab_problems(reader, vocab, tokenizer_fingerprint_of(student), logits_needed=False)
