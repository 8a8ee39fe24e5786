"""Checks before training: does this cache hold what this student and these losses need?

Everything is compared before DeepSpeed starts, and every mismatch is reported at once in plain words (a user
fixing one problem should not discover the next one on the following run). ``plan.plan_training`` gathers
these findings; the helpers here know nothing of token streams beyond what the spec says. What a
``--cross-tokenizer`` run needs of its cache is checked here too (``cross_problems``), apart from
``cross.cross_model`` (the run itself), which is floors above since it wraps the run's loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdcache.stages.common.cache_texts import MissingTextError, has_texts, read_texts
from kdcache.stages.targets import attention as attention_sources, logits as logit_kinds
from kdcache.stages.train.core.layer_maps import LayerMap, Pair, pair_key, validate_layer_map
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.core.student import StudentFacts
from kdcache.storage import CacheReader, KdcacheError, compare_fingerprints, open_store

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec


class CacheCheckError(KdcacheError):
    """The cache and the student (or the chosen losses) do not fit; every problem is listed."""

    def __init__(self, problems: list[str], what: str = "training cannot start"):
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what} ({len(self.problems)} problem(s)):\n{body}")


def open_cache(path: str | Path, *, allow_partial: bool = False, decode_threads: int | None = None,
               reader: type[CacheReader] = CacheReader) -> CacheReader:
    """Open a cache for reading, with a clear message when there is none: the one reader a command uses.

    Args:
        path: the cache folder or URL.
        allow_partial: accept a cache whose writers have not all finished (its committed shards only).
        decode_threads: arrays the reader decodes at once (None: one per core; ``CacheReader``).
        reader: the class to open it as (the Python API's ``Cache`` adds ``dataset`` to the reader).

    Raises:
        CacheCheckError: no directory or no manifest at ``path``.
        storage.core.errors.KdcacheError: the cache is partial, corrupt or from a newer format.
    """
    store = open_store(path)
    if store.size("manifest.json") is None:
        why = "does not exist" if not store.exists("") else "has no manifest.json (not a finished cache)"
        # Training, eval and sweeps all open caches here, so the headline names the cache, not a caller.
        raise CacheCheckError([f"cache {str(path)!r} {why}; run `kdcache precompute` first, or point --cache "
                               "at the folder or URL holding manifest.json"], what="cannot open the cache")
    return reader(store, allow_partial=allow_partial, decode_threads=decode_threads)


def vocab_problems(reader: CacheReader, student_vocab: int, student_tokenizer: dict[str, Any] | None, *,
                   logits_needed: bool) -> list[str]:
    """Vocabulary checks: every cached token id must embed, logits must line up, tokenizers must agree; a refusal
    ends with the way a student of another tokenizer goes (``cross_hint``).

    Training (``plan.plan_training``), evaluation and the sweep's up-front check all call this, so a student
    that does not fit a cache gets the same sentences wherever it is refused.

    Args:
        reader: an open ``storage.CacheReader``.
        student_vocab: rows of the student's embedding (its config's ``vocab_size``).
        student_tokenizer: the student's tokenizer fingerprint, or None when it has no tokenizer.
        logits_needed: the caller compares the student's logits with the cached ones (the KL term, LM metrics).
    """
    spec, fp = reader.spec, (reader.fingerprints or {}).get("tokenizer") or {}
    cache_vocab = int(fp.get("vocab_size") or spec.vocab_size or 0)
    problems = []
    if cache_vocab and student_vocab < cache_vocab:
        problems.append(f"vocab size mismatch: the cache's tokenizer has {cache_vocab} tokens but the student's "
                        f"embedding has {student_vocab} rows; train a student built for the teacher's "
                        "tokenizer (e.g. `kdcache init-student`, or set vocab_size in its config)")
    elif (kind := logit_kinds.of(spec.logit_layout)) and logits_needed:  # the KL's rule of this cache's kind
        problems += kind.vocab_problems(spec, student_vocab)
    problems += tokenizer_problems(fp, student_tokenizer)
    return problems + (cross_hint(reader) if problems else [])


def tokenizer_problems(cached: dict[str, Any], student_tokenizer: dict[str, Any] | None) -> list[str]:
    """The cache's tokenizer fingerprint against the student's: one sentence naming both sizes and hashes."""
    ours, theirs = str(cached.get("vocab_hash") or ""), str((student_tokenizer or {}).get("vocab_hash") or "")
    # Hashes written by different hash helpers ("sha256:..." or bare hex) cannot be compared.
    comparable = ours.startswith("sha256:") == theirs.startswith("sha256:") and len(ours) == len(theirs)
    if student_tokenizer is None or not ours or not comparable:
        return []
    # The size goes with the hash, so the message names both vocabularies (not "the student expects ?").
    expected = {k: student_tokenizer[k] for k in ("vocab_hash", "vocab_size") if k in student_tokenizer}
    return compare_fingerprints({"tokenizer": cached}, {"tokenizer": expected})


def stream_problems(spec: CacheSpec, student: StudentFacts) -> list[str]:
    """A cache of two token streams needs an encoder-decoder student, and one stream needs one stack."""
    if spec.is_encoder_decoder and not student.is_encoder_decoder:
        return ["the cache was written by an encoder-decoder teacher (two token streams), but the student "
                "is not an encoder-decoder; train an encoder-decoder student (e.g. `kdcache init-student` on the "
                "teacher, or a BART/T5 config)"]
    if student.is_encoder_decoder and not spec.is_encoder_decoder:
        return [f"the student is an encoder-decoder but the cache holds one token stream "
                f"({', '.join(spec.features) or 'ids only'}); precompute it with an encoder-decoder teacher "
                f"and --source-column/--target-column"]
    return []


def feature_problems(options: TrainOptions, spec: CacheSpec, student: StudentFacts) -> list[str]:
    """Each nonzero loss weight needs its feature in the cache (and logits need a student head)."""
    held = ", ".join(spec.features) or "nothing but input_ids"
    hidden = any(layers for group, layers in spec.layer_groups() if group.endswith("hidden"))
    attention = any(layers for group, layers in spec.layer_groups() if not group.endswith("hidden"))
    problems = []
    loss = options.loss
    if loss.ce_weight > 0 and not student.has_lm_head:
        problems.append("the CE term (--alpha) needs a student with an LM head; this student has none "
                        "(use --alpha 0, or a *ForCausalLM / *ForMaskedLM student)")
    if loss.kl_weight > 0 and not spec.logits:
        problems.append(f"the KL term (--beta) needs the teacher's logits, but the cache holds {held}; re-run "
                        "precompute with logits (full or top-k), or use --beta 0")
    elif loss.kl_weight > 0 and not student.has_lm_head:
        problems.append("the KL term (--beta) needs student logits, but the student has no LM head")
    elif loss.kl_weight > 0 and (kind := logit_kinds.of(spec.logit_layout)) and not loss.cross_tokenizer:
        # The top-k variant and the temperature against its logit kind; a cross-tokenizer run's vocabulary term
        # has checks of its own (``cross_problems``: GOLD reads both, ULD neither).
        problems += kind.loss_problems(spec, loss.logit)
    if loss.gamma > 0 and options.maps.for_stream("").maps_layers and not hidden:
        problems.append(f"the hidden-state term (--gamma) needs hidden states, but the cache holds {held}; "
                        "re-run precompute with --layers, or use --gamma 0 / --layer-map none")
    if loss.delta > 0 and not attention:
        problems.append(f"the attention term (--delta) needs attention maps, but the cache holds {held}; "
                        "re-run precompute with attention layers, or use --delta 0")
    elif loss.delta > 0:
        problems += attention_sources.of(spec.attention_layout).loss_problems(loss.attention.attention_loss)
    return problems


def restricted_map(layer_map: LayerMap, student_depth: int, depth: int, cached: tuple[int, ...], seed: int, what: str,
                   problems: list[str], notes: list[str] | None = None) -> list[Pair]:
    """A map's pairs restricted to student blocks (s >= 1) whose teacher layer is cached.

    ``none`` counts as ``uniform`` here: it switches off the hidden term, not the attention term that follows it.
    A map that keeps no pair is a problem (appended to ``problems``), since the term would silently vanish; with
    ``notes``, a map that keeps some but not all says which it kept, and the ``--layers`` that would keep all.
    """
    try:
        pairs = (layer_map if layer_map.maps_layers else LayerMap()).build(student_depth, depth, seed=seed)
    except KdcacheError as exc:
        problems.append(f"{what} map {str(layer_map)!r}: {exc}")
        return []
    kept = [(s, t) for s, t in pairs if s >= 1 and t in cached]
    if not kept:
        problems.append(f"no pair of the {what} map {str(layer_map)!r} meets a cached {what} layer (cached: "
                        f"{list(cached)}); pass an explicit:S-T map naming cached layers")
    elif notes is not None and len(kept) < len(pairs):
        needed = ",".join(str(t) for t in sorted({t for _, t in pairs}))
        notes.append(f"the {layer_map} {what} map keeps the pairs whose teacher layer the cache holds: "
                     f"{', '.join(pair_key(p) for p in kept)} (of {len(pairs)}; precompute with --layers {needed} for "
                     "all of them, or name pairs with --layer-map explicit:S-T)")
    return kept


def checked_map(layer_map: LayerMap, seed: int, student_depth: int, depth: int, cached: tuple[int, ...], what: str,
                problems: list[str]) -> list[Pair]:
    """Build a layer map of ``student_depth`` student layers onto ``depth`` teacher blocks and validate it
    against the ``cached`` teacher layers; problems are appended, not raised."""
    try:
        pairs = layer_map.build(student_depth, depth, seed=seed)
        validate_layer_map(pairs, student_depth, cached, what=what)
    except KdcacheError as exc:
        problems.append(f"{what} layer map {str(layer_map)!r}: {exc}")
        return []
    if what.endswith("attention") and any(s < 1 for s, _ in pairs):
        problems.append("attention layers are blocks 1..N; layer 0 (the embeddings) has no attention map")
    return pairs


def cross_problems(reader: CacheReader, options: TrainOptions) -> list[str]:
    """What stops a cross-tokenizer run on this cache (in place of ``checks.vocab_problems``' tokenizer rules):
    ``text_problems``, and logits that are not a ranked top-k."""
    problems = text_problems(reader, "--cross-tokenizer")
    kind = logit_kinds.of(reader.spec.logit_layout)
    if options.loss.kl_weight > 0 and kind is not None and not kind.ranked:
        problems.append(f"--cross-tokenizer compares the teacher's cached top-k across vocabularies, but this cache "
                        f"holds --logits {reader.spec.logits}; use a top-k cache or --beta 0")
    temperature = options.loss.logit.resolved_temperature()
    if options.loss.cross_tokenizer == "gold" and options.loss.logit.topk_kl == "other" and temperature != 1:
        problems.append(f"--cross-tokenizer gold with --topk-kl other compares full-vocabulary probabilities "
                        f"rebuilt from the cached logsumexp, exact only at T=1, but the temperature is "
                        f"{temperature:g}; use --temperature 1, or --topk-kl renorm")
    if options.loss.delta > 0:
        problems.append("--cross-tokenizer aligns hidden states and logits, not attention maps; set --delta 0")
    return problems


def cross_hint(reader: CacheReader) -> list[str]:
    """The line a refused vocabulary adds: a student with a tokenizer of its own trains with ``--cross-tokenizer``,
    which needs the cache's recorded texts."""
    line = ("if the student has a tokenizer of its own, train and evaluate it with --cross-tokenizer (losses "
            "and scores on aligned text spans)")
    if not has_texts(reader.store):  # whether they are there, not the whole file read and checked
        line += ", which needs the cache's texts: this cache has none, re-run stage one with --record-text"
    return [line]


def text_problems(reader: CacheReader, what: str) -> list[str]:
    """What stops aligning another tokenizer's tokens with this cache's, for ``what`` (training or evaluation):
    no recorded texts, or not one per sequence; two token streams."""
    problems = []
    try:
        texts = read_texts(reader.store, what)
        if len(texts) != len(reader):
            problems.append(f"{what}: the cache's texts/ hold {len(texts)} texts for its {len(reader)} "
                            f"sequences; it is damaged or from another cache (rebuild it with --record-text)")
    except MissingTextError as exc:
        problems.append(str(exc))
    if len(reader.spec.streams) > 1:
        problems.append(f"{what} aligns one token stream, but this cache holds {list(reader.spec.streams)} "
                        f"(an encoder-decoder teacher's); use a student with the teacher's tokenizer there")
    return problems
