"""Checks before training a seq2seq student on a seq2seq cache, and the plan that comes out of them.

Each side gets its own layer map: ``--encoder-layer-map`` and ``--decoder-layer-map`` (both default to
``--layer-map``), since an encoder and a decoder are usually shrunk by different factors. Self-attention pairs
follow each side's map restricted to the cached attention blocks (or ``--attention-layers`` for both sides);
cross-attention pairs follow ``--cross-attention-map``, by default the decoder's map restricted to the cached
cross-attention blocks. All attention terms share the weight δ and are logged one by one.

Like ``checks.plan_training``, every problem is collected and reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdcache.stages.train.checks import CacheCheckError, TrainPlan, _checked_map, restricted_map, vocab_problems
from kdcache.stages.train.options import TrainOptions
from kdcache.stages.train.student import StudentFacts

Pair = tuple[int, int]
TOPK_NAMES = ("logits/topk_values", "logits/topk_ids", "logits/lse")


@dataclass(frozen=True)
class Seq2SeqPlan(TrainPlan):
    """A TrainPlan whose ``hidden_pairs`` / ``attention_pairs`` are the decoder's, plus the encoder's and the
    cross-attention pairs. ``seq2seq`` lets the loop and streaming tell it apart without importing this."""

    encoder_hidden_pairs: tuple[Pair, ...] = ()
    encoder_attention_pairs: tuple[Pair, ...] = ()
    cross_attention_pairs: tuple[Pair, ...] = ()
    encoder_hidden_sizes: dict[int, int] | None = None
    encoder_depth: int = 0
    seq2seq: bool = True


def teacher_depths(reader: Any) -> tuple[int, int]:
    """(encoder, decoder) block counts: recorded by stage one, else the deepest cached layer of each side."""
    teacher = (reader.fingerprints or {}).get("teacher") or {}
    spec = reader.spec
    enc = teacher.get("num_encoder_layers") or max(
        [*spec.encoder_hidden_layers, *spec.encoder_attention_layers], default=0)
    dec = teacher.get("num_decoder_layers") or max(
        [*spec.decoder_hidden_layers, *spec.decoder_attention_layers, *spec.cross_attention_layers], default=0)
    return int(enc), int(dec)


def _side_pairs(options: TrainOptions, side: str, student_depth: int, depth: int, spec: Any,
                problems: list[str]) -> tuple[list[Pair], list[Pair]]:
    """(hidden pairs, self-attention pairs) of the ``side`` stack."""
    text = getattr(options, f"{side}_layer_map") or options.layer_map
    hidden_cached = getattr(spec, f"{side}_hidden_layers")
    attention_cached = getattr(spec, f"{side}_attention_layers")
    facts = StudentFacts(student_depth, 0, 0, 0, True, False, False)
    hidden: list[Pair] = []
    if options.gamma > 0 and text != "none" and hidden_cached:
        hidden = _checked_map(text, options.seed, facts, depth, hidden_cached, f"{side} hidden", problems)
    attention: list[Pair] = []
    if options.delta > 0 and attention_cached:
        if options.attention_layers is not None:
            attention = _checked_map(options.attention_layers, options.seed, facts, depth, attention_cached,
                                     f"{side} attention", problems)
        else:
            attention = restricted_map(text, student_depth, depth, attention_cached, options.seed,
                                       f"{side} attention", problems)
    return hidden, attention


def _cross_pairs(options: TrainOptions, student_depth: int, depth: int, spec: Any,
                 problems: list[str]) -> list[Pair]:
    text = options.cross_attention_map
    if options.delta <= 0 or not spec.cross_attention_layers or text == "none":
        return []
    facts = StudentFacts(student_depth, 0, 0, 0, True, False, False)
    if text:
        return _checked_map(text, options.seed, facts, depth, spec.cross_attention_layers, "cross attention",
                            problems)
    decoder_map = options.decoder_layer_map or options.layer_map
    return restricted_map(decoder_map, student_depth, depth, spec.cross_attention_layers, options.seed,
                          "cross attention", problems)


def _feature_problems(options: TrainOptions, spec: Any, student: StudentFacts) -> list[str]:
    held = ", ".join(spec.features) or "nothing but token ids"
    problems = []
    if not student.is_encoder_decoder:
        problems.append("the cache was written by an encoder-decoder teacher (two token streams), but the student "
                        "is not an encoder-decoder; train a seq2seq student (e.g. `kdcache init-student` on the "
                        "teacher, or a BART/T5 config)")
    if options.beta > 0 and not spec.logits:
        problems.append(f"the KL term (--beta) needs the teacher's logits, but the cache holds {held}; use --beta 0")
    if options.gamma > 0 and not (spec.encoder_hidden_layers or spec.decoder_hidden_layers):
        problems.append(f"the hidden-state term (--gamma) needs hidden states, but the cache holds {held}; "
                        "use --gamma 0")
    if options.delta > 0 and not (spec.encoder_attention_layers or spec.decoder_attention_layers
                                  or spec.cross_attention_layers):
        problems.append(f"the attention term (--delta) needs attention maps, but the cache holds {held}; "
                        "use --delta 0")
    return problems


def seq2seq_stream_names(spec: Any, pairs: dict[str, list[Pair]], logits: str | None) -> list[str]:
    """Arrays to stream: both streams' ids, the teacher layers the pairs use, and the logits the KL reads."""
    names = ["encoder/input_ids", "decoder/input_ids"]
    for group in ("encoder/hidden", "encoder/attention", "decoder/hidden", "decoder/attention", "cross_attention"):
        names += [f"{group}/{t}" for t in sorted({t for _, t in pairs[group]})]
    names += ["logits/full"] if logits == "full" else list(TOPK_NAMES) if logits == "topk" else []
    return names


def plan_seq2seq(options: TrainOptions, reader: Any, student: StudentFacts,
                 student_tokenizer: dict[str, Any] | None) -> Seq2SeqPlan:
    """Compare a seq2seq cache and a seq2seq student; return the plan or raise listing every problem."""
    spec = reader.spec
    if not spec.is_seq2seq:
        raise CacheCheckError([f"the student is an encoder-decoder but the cache holds one token stream "
                               f"({', '.join(spec.features) or 'ids only'}); precompute it with a seq2seq teacher "
                               f"and --source-column/--target-column"])
    problems = vocab_problems(options, reader, student, student_tokenizer) + _feature_problems(options, spec, student)
    enc_depth, dec_depth = teacher_depths(reader)
    enc_hidden, enc_attention = _side_pairs(options, "encoder", student.num_layers, enc_depth, spec, problems)
    dec_hidden, dec_attention = _side_pairs(options, "decoder", student.decoder_layers, dec_depth, spec, problems)
    cross = _cross_pairs(options, student.decoder_layers, dec_depth, spec, problems)
    if problems:
        raise CacheCheckError(problems)
    pairs = {"encoder/hidden": enc_hidden, "encoder/attention": enc_attention, "decoder/hidden": dec_hidden,
             "decoder/attention": dec_attention, "cross_attention": cross}
    logits = spec.logits if options.beta > 0 else None
    names = seq2seq_stream_names(spec, pairs, logits)
    sizes = _hidden_sizes(reader, [n for n in names if "/hidden/" in n])
    return Seq2SeqPlan(
        hidden_pairs=tuple(dec_hidden), attention_pairs=tuple(dec_attention), logits=logits, names=tuple(names),
        teacher_hidden_sizes={int(n.rsplit("/", 1)[1]): d for n, d in sizes.items() if n.startswith("decoder/")},
        teacher_depth=dec_depth, encoder_hidden_pairs=tuple(enc_hidden), encoder_attention_pairs=tuple(enc_attention),
        cross_attention_pairs=tuple(cross), encoder_depth=enc_depth,
        encoder_hidden_sizes={int(n.rsplit("/", 1)[1]): d for n, d in sizes.items() if n.startswith("encoder/")})


def _hidden_sizes(reader: Any, names: list[str]) -> dict[str, int]:
    """d_t of each cached hidden array the plan streams, from the cache's first sequence."""
    if not names:
        return {}
    first = reader.get(reader.shard_ranges[0][0], names=names)
    return {name: int(first[name].shape[-1]) for name in names}
