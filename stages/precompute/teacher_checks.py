"""Checks of the teacher against the request and the rows, in stage one's order: the default features from its
config, its position table against the longest row (before the weights), then its embedding table against the
token ids and its LM head's real vocabulary (after)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.teacher import has_lm_head

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.core.plan import TeacherSetup
    from kdcache.stages.precompute.core.targets import Targets
    from kdcache.stages.precompute.core.teacher_id import Teacher
    from kdcache.stages.precompute.rows.data import TokenStreams


def check_positions(config: PretrainedConfig, data: TokenStreams) -> None:
    """Refuse sequences longer than the teacher's position table (they would index past it)."""
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(data.longest(s) for s in data.streams)
    if isinstance(limit, int) and longest > limit:
        flags = "--max-length / --max-target-length" if len(data.streams) > 1 else "--max-length"
        raise PrecomputeError(f"max_length: sequences reach {longest} tokens, but the teacher has only {limit} "
                              f"positions; lower {flags} to {limit} or less")


def with_default_features(options: PrecomputeOptions, config: PretrainedConfig) -> PrecomputeOptions:
    """Without ``--features``: hidden states, plus logits when the teacher has a language-model head (an
    encoder such as MiniLM has none, so it caches hidden states only)."""
    if options.targets.features:
        return options
    if options.targets.logit.topk_values == "logprob" and not has_lm_head(config):
        raise PrecomputeError(f"topk_values: teacher {options.engine.teacher!r} has no language-model head, so no "
                              f"logits are cached and --topk-values logprob has nothing to store; drop it")
    features = ("hidden", "logits") if has_lm_head(config) else ("hidden",)
    return replace(options, targets=replace(options.targets, features=features))


def check_token_ids(teacher: Teacher, data: TokenStreams) -> None:
    """Refuse token ids the teacher's embedding table does not have (a tokenizer from another model)."""
    table: int = teacher.model.get_input_embeddings().num_embeddings  # type: ignore[assignment]  # an nn.Embedding
    top = data.max_id
    if top >= table:
        raise PrecomputeError(f"the tokenizer produced token id {top}, but the teacher's embedding table has only "
                              f"{table} rows; the tokenizer does not belong to this teacher")


def with_output_vocab(targets: Targets, teacher: Teacher, setup: TeacherSetup) -> Targets:
    """Use the LM head's real output size as the vocabulary (checkpoints may pad it beyond config.vocab_size)."""
    head = teacher.model.get_output_embeddings()
    kind = targets.logit_kind
    if kind is None or head is None:
        return targets
    vocab = int(head.weight.shape[0])
    # logit.top_k is --top-k for the one mode that reads it (topk), 0 for the modes that ignore it
    for problem in kind.teacher_problems(setup.name, "" in targets.streams, targets.causal, vocab,
                                         targets.logit.top_k):
        raise PrecomputeError(problem)
    return replace(targets, vocab_size=vocab)
