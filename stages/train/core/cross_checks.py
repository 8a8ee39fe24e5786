"""What a ``--cross-tokenizer`` run needs of its cache, checked before the student loads (``plan`` asks it).

It sits on the ground floor beside ``checks`` and ``plan``, which ask it; ``cross.cross_model`` (the run itself)
is floors above, since it wraps the run's loss (``objective``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.stages.common.cache_texts import MissingTextError, has_texts, read_texts
from kdcache.stages.targets import logits as logit_kinds

if TYPE_CHECKING:
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.storage import CacheReader


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
