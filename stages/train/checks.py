"""Checks before training: does this cache hold what this student and these losses need?

Everything is compared before DeepSpeed starts, and every mismatch is reported at once in plain words (a user
fixing one problem should not discover the next one on the following run). The result is a ``TrainPlan``:
the layer pairs, the logit kind and the list of arrays to stream, so nothing else re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdcache.stages.train.layer_maps import build_layer_map, validate_layer_map
from kdcache.stages.train.options import TrainOptions
from kdcache.stages.train.student import StudentFacts
from kdcache.storage.errors import KdcacheError

Pair = tuple[int, int]


class CacheCheckError(KdcacheError):
    """The cache and the student (or the chosen losses) do not fit; every problem is listed."""

    def __init__(self, problems: list[str], what: str = "training cannot start"):
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what} ({len(self.problems)} problem(s)):\n{body}")


@dataclass(frozen=True)
class TrainPlan:
    """What training reads from the cache and how the loss uses it."""

    hidden_pairs: tuple[Pair, ...]
    attention_pairs: tuple[Pair, ...]
    logits: str | None  # "full" | "topk" | None: what the KL term reads
    names: tuple[str, ...]  # arrays streamed per sequence
    teacher_hidden_sizes: dict[int, int] = field(default_factory=dict)  # d_t per teacher hidden layer
    teacher_heads: int | None = None  # H' stored per attention layer
    teacher_depth: int = 0


def open_cache(path: str | Path, *, allow_partial: bool = False) -> Any:
    """Open a cache for reading, with a clear message when there is none.

    Raises:
        CacheCheckError: no directory or no manifest at ``path``.
        storage.errors.KdcacheError: the cache is partial, corrupt or from a newer format.
    """
    from kdcache.storage import CacheReader
    from kdcache.storage.stores import open_store

    store = open_store(path)
    if store.size("manifest.json") is None:
        why = "does not exist" if not store.exists("") else "has no manifest.json (not a finished cache)"
        # Training, eval and sweeps all open caches here, so the headline names the cache, not a caller.
        raise CacheCheckError([f"cache {str(path)!r} {why}; run `kdcache precompute` first, or point --cache "
                               "at the folder or URL holding manifest.json"], what="cannot open the cache")
    return CacheReader(store, allow_partial=allow_partial)


def teacher_depth(reader: Any) -> int:
    """N, the teacher's block count, needed by the formula layer maps.

    The manifest records it under ``fingerprints.teacher.num_layers`` when stage one wrote it; otherwise the
    deepest cached layer is the best estimate (exact whenever the cache holds the teacher's last layer).
    """
    teacher = (reader.fingerprints or {}).get("teacher") or {}
    for key in ("num_layers", "num_hidden_layers"):
        if isinstance(teacher.get(key), int):
            return int(teacher[key])
    layers = list(reader.spec.hidden_layers) + list(reader.spec.attention_layers)
    return max(layers, default=0)


def plan_training(options: TrainOptions, reader: Any, student: StudentFacts,
                  student_tokenizer: dict[str, Any] | None) -> TrainPlan:
    """Compare cache and student; return the plan, or raise listing every problem.

    Args:
        options: the run's options (weights decide which features are needed).
        reader: an open ``storage.CacheReader``.
        student: the student's shape.
        student_tokenizer: the student's tokenizer fingerprint, or None when it has no tokenizer.

    Raises:
        CacheCheckError: one or more mismatches, each explained.
    """
    if getattr(reader.spec, "is_seq2seq", False) or student.is_encoder_decoder:  # two token streams
        from kdcache.stages.train.seq2seq_plan import plan_seq2seq

        return plan_seq2seq(options, reader, student, student_tokenizer)
    spec, problems = reader.spec, []
    problems += vocab_problems(options, reader, student, student_tokenizer)
    problems += feature_problems(options, spec, student)
    depth = teacher_depth(reader)
    hidden, attention = [], []
    if options.gamma > 0 and options.layer_map != "none" and spec.hidden_layers:
        hidden = _checked_map(options.layer_map, options.seed, student, depth, spec.hidden_layers, "hidden",
                              problems)
    if options.delta > 0 and spec.attention_layers:
        attention = attention_pairs(options, student, depth, spec.attention_layers, problems)
    if problems:
        raise CacheCheckError(problems)
    logits = spec.logits if options.beta > 0 else None
    names = stream_names(hidden, attention, logits)
    sizes, heads = _target_shapes(reader, hidden, attention)
    if heads is not None and heads % student.num_heads:
        raise CacheCheckError([f"the cache stores {heads} attention heads per layer and the student has "
                               f"{student.num_heads}; the attention loss averages teacher heads in groups of "
                               "H_t/H_s, so H_t must be a multiple of H_s (or cache a head subset that is)"])
    return TrainPlan(tuple(hidden), tuple(attention), logits, tuple(names), sizes, heads, depth)


def vocab_problems(options: TrainOptions, reader: Any, student: StudentFacts,
                   student_tokenizer: dict[str, Any] | None) -> list[str]:
    """Vocabulary checks: every cached token id must embed, logits must line up, tokenizers must agree."""
    from kdcache.storage import compare_fingerprints

    spec, fp = reader.spec, (reader.fingerprints or {}).get("tokenizer") or {}
    cache_vocab = int(fp.get("vocab_size") or spec.vocab_size or 0)
    problems = []
    if cache_vocab and student.vocab_size < cache_vocab:
        problems.append(f"vocab size mismatch: the cache's tokenizer has {cache_vocab} tokens but the student's "
                        f"embedding has {student.vocab_size} rows; train a student built for the teacher's "
                        "tokenizer (e.g. `kdcache init-student`, or set vocab_size in its config)")
    elif spec.logits == "full" and options.beta > 0 and student.vocab_size != spec.vocab_size:
        problems.append(f"vocab size mismatch: the cache's full logits have {spec.vocab_size} entries per token, "
                        f"the student's head {student.vocab_size}; the KL needs the same vocabulary")
    if student_tokenizer is not None and fp.get("vocab_hash") and _same_hash_kind(fp, student_tokenizer):
        expected = {"tokenizer": {k: student_tokenizer[k] for k in ("vocab_hash",) if k in student_tokenizer}}
        problems += compare_fingerprints({"tokenizer": fp}, expected)
    return problems


def _same_hash_kind(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Hashes written by different hash helpers ("sha256:..." or bare hex) cannot be compared."""
    ha, hb = str(a.get("vocab_hash", "")), str(b.get("vocab_hash", ""))
    return ha.startswith("sha256:") == hb.startswith("sha256:") and len(ha) == len(hb)


def feature_problems(options: TrainOptions, spec: Any, student: StudentFacts) -> list[str]:
    """Each nonzero loss weight needs its feature in the cache (and logits need a student head)."""
    held = ", ".join(spec.features) or "nothing but input_ids"
    problems = []
    if options.alpha > 0 and not student.has_lm_head:
        problems.append("the CE term (--alpha) needs a student with an LM head; this student has none "
                        "(use --alpha 0, or a *ForCausalLM / *ForMaskedLM student)")
    if options.beta > 0 and not spec.logits:
        problems.append(f"the KL term (--beta) needs the teacher's logits, but the cache holds {held}; re-run "
                        "precompute with logits (full or top-k), or use --beta 0")
    elif options.beta > 0 and not student.has_lm_head:
        problems.append("the KL term (--beta) needs student logits, but the student has no LM head")
    elif options.beta > 0 and spec.logits == "topk" and options.topk_kl == "other" and options.temperature != 1:
        problems.append(f"--topk-kl other rebuilds full-vocabulary probabilities from the cached logsumexp, which "
                        f"is exact only at T=1, but --temperature is {options.temperature:g}; use --temperature 1, "
                        "or --topk-kl renorm (which applies any temperature)")
    if options.gamma > 0 and options.layer_map != "none" and not spec.hidden_layers:
        problems.append(f"the hidden-state term (--gamma) needs hidden states, but the cache holds {held}; "
                        "re-run precompute with --layers, or use --gamma 0 / --layer-map none")
    if options.delta > 0 and not spec.attention_layers:
        problems.append(f"the attention term (--delta) needs attention maps, but the cache holds {held}; "
                        "re-run precompute with attention layers, or use --delta 0")
    return problems


def attention_pairs(options: TrainOptions, student: StudentFacts, depth: int, cached: tuple[int, ...],
                    problems: list[str]) -> list[Pair]:
    """The (student block, teacher block) pairs of the attention term.

    By default the hidden layer map (``--layer-map``) restricted to the teacher blocks whose attention is
    cached; ``--attention-layers`` gives a map of its own.
    """
    if options.attention_layers is not None:
        return _checked_map(options.attention_layers, options.seed, student, depth, cached, "attention", problems)
    return restricted_map(options.layer_map, student.num_layers, depth, cached, options.seed, "attention",
                          problems)


def restricted_map(text: str, student_depth: int, depth: int, cached: tuple[int, ...], seed: int, what: str,
                   problems: list[str]) -> list[Pair]:
    """A map's pairs restricted to student blocks (s >= 1) whose teacher layer is cached.

    ``none`` counts as ``uniform`` here: it switches off the hidden term, not the attention term that follows it.
    A map that keeps no pair is a problem (appended to ``problems``), since the term would silently vanish.
    """
    try:
        pairs = build_layer_map(text if text != "none" else "uniform", student_depth, depth, seed=seed)
    except KdcacheError as exc:
        problems.append(f"{what} map {text!r}: {exc}")
        return []
    kept = [(s, t) for s, t in pairs if s >= 1 and t in cached]
    if not kept:
        problems.append(f"no pair of the {what} map {text!r} meets a cached {what} layer (cached: {list(cached)}); "
                        f"pass an explicit:S-T map naming cached layers")
    return kept


def _checked_map(text: str, seed: int, student: StudentFacts, depth: int, cached: tuple[int, ...], what: str,
                 problems: list[str]) -> list[Pair]:
    """Build a layer map and validate it; problems are appended, not raised."""
    try:
        pairs = build_layer_map(text, student.num_layers, depth, seed=seed)
        validate_layer_map(pairs, student.num_layers, cached, what=what)
    except KdcacheError as exc:
        problems.append(f"{what} layer map {text!r}: {exc}")
        return []
    if what == "attention" and any(s < 1 for s, _ in pairs):
        problems.append("attention layers are blocks 1..N; layer 0 (the embeddings) has no attention map")
    return pairs


def stream_names(hidden: list[Pair], attention: list[Pair], logits: str | None) -> list[str]:
    """The per-sequence arrays to stream: nothing the losses do not read."""
    names = ["input_ids"]
    names += [f"hidden/{t}" for t in sorted({t for _, t in hidden})]
    names += [f"attention/{t}" for t in sorted({t for _, t in attention})]
    if logits == "full":
        names.append("logits/full")
    elif logits == "topk":
        names += ["logits/topk_values", "logits/topk_ids", "logits/lse"]
    return names


def _target_shapes(reader: Any, hidden: list[Pair], attention: list[Pair]) -> tuple[dict[int, int], int | None]:
    """Teacher widths d_t (per hidden layer) and stored heads H', read from the cache's first sequence."""
    names = [f"hidden/{t}" for t in sorted({t for _, t in hidden})]
    names += [f"attention/{t}" for t in sorted({t for _, t in attention})][:1]
    if not names:
        return {}, None
    first = reader.get(reader.shard_ranges[0][0], names=names)
    sizes = {int(n.split("/")[1]): int(first[n].shape[-1]) for n in names if n.startswith("hidden/")}
    heads = next((int(first[n].shape[0]) for n in names if n.startswith("attention/")), None)
    return sizes, heads


def _layers_text(layers: list[int]) -> str:
    return ", ".join(str(j) for j in layers)


def unused_targets(spec: Any, plan: TrainPlan, options: TrainOptions) -> list[str]:
    """Cached targets this run's weights and maps leave unused, each with the reason and how to use it.

    A single-stream cache only (a seq2seq plan names its pairs per stack); an empty list when all are used.
    """
    if getattr(spec, "is_seq2seq", False):
        return []
    notes = []
    hidden = sorted(set(spec.hidden_layers) - {t for _, t in plan.hidden_pairs})
    if hidden:
        why = ("--gamma is 0" if options.gamma <= 0 else "--layer-map is none" if options.layer_map == "none"
               else f"the layer map {options.layer_map!r} pairs no student layer with them")
        notes.append(f"hidden layers {_layers_text(hidden)} ({why})")
    attention = sorted(set(spec.attention_layers) - {t for _, t in plan.attention_pairs})
    if attention:
        why = ("--delta is 0: set --delta > 0 to distil attention maps" if options.delta <= 0
               else "the attention map pairs no student block with them")
        notes.append(f"attention layers {_layers_text(attention)} ({why})")
    if spec.logits and plan.logits is None:
        notes.append(f"logits/{spec.logits} (--beta is 0)")
    return notes
