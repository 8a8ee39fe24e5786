"""Stage two from your own training code: a cache's batches as a torch dataset, and what the run's loss
(``loss.DistillationLoss``, built from a cache and a student) resolves from them.

``kdcache train`` is built on these same pieces: ``fit_student`` (the options a cache and a student decide, the
plan and its checks), ``teacher_head_for``, and ``CacheStream`` / ``to_device`` (the batches, their targets decoded
on the device). The CLI, ``DistillationLoss`` and ``CacheTrainer`` share them and the one loss module, so they
cannot compute different losses from the same cache.

A plain loop (``B`` micro-batch, ``L`` padded length)::

    loss = DistillationLoss("cache", student, gamma=1.0)
    data = loss.dataset(batch_size=8)
    for batch in torch.utils.data.DataLoader(data, batch_size=None):
        batch = data.to_device(batch, "cpu")           # [B, L] ids and masks, float32 targets [B, L, d] ...
        terms = loss(student(**loss.inputs(batch)), batch)
        terms["loss"].backward()
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.common.option_groups import leaves
from kdcache.stages.targets import attention as attention_sources
from kdcache.stages.targets.attention.attention_maps import MAPS_ATTENTION, register_maps_attention
from kdcache.stages.targets.logits.loss_flags import DEFAULT_TEMPERATURE
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train.core.checks import CacheCheckError, open_cache as open_checked, vocab_problems
from kdcache.stages.train.core.options import LossOptions, MapOptions, TrainOptions
from kdcache.stages.train.core.plan import TrainPlan, plan_training, unused_targets
from kdcache.stages.train.core.student import StudentFacts, student_facts
from kdcache.stages.train.feed.ahead import PREFETCH_MIB
from kdcache.stages.train.feed.streaming import (
    Batch,
    CacheStream,
    DataPosition,
    check_resumable,
    next_position,
    resumable_state,
)
from kdcache.stages.train.objective.distill import unwrapped_student
from kdcache.storage import CacheReader, KdcacheError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import Unpack  # typing's own from Python 3.11

    from kdcache.stages.targets.logits.teacher_head import TeacherHead

API_SPEAKER = "kdcache"  # how the Python API heads its notes (``kdcache train``'s are headed by the command)
# The keyword options of ``DistillationLoss``: those of ``kdcache train``'s loss and maps groups, and the seed.
LOSS_OPTIONS = tuple(f.name for group in (LossOptions, MapOptions) for _, _, f in leaves(group)) + ("seed",)


class ApiError(KdcacheError):
    """The Python API was given something it cannot use (an unknown option, a cache it cannot train from)."""


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?: (?!/)([^\s,;)]+))?")


def api_spelling(text: str) -> str:
    """``text`` with the loss options' CLI flags as the API spells them: ``--gamma 0`` -> ``gamma=0``,
    ``--layer-map none`` -> ``layer_map='none'``, ``(--gamma)`` -> ``(gamma=)``; other flags stay as they are."""
    def one(match: re.Match[str]) -> str:
        name, value = match.group(1).replace("-", "_"), match.group(2)
        if name not in LOSS_OPTIONS:
            return match.group(0)
        if value is None:
            return f"{name}="
        return f"{name}={value}" if re.fullmatch(r"-?[0-9.e+-]+", value) else f"{name}={value!r}"

    return _FLAG.sub(one, text)


def _say(speaker: str, line: str, announce: bool) -> None:
    if announce and int(os.environ.get("RANK", "0")) == 0:  # rank 0 speaks for all
        print(f"{speaker}: {api_spelling(line) if speaker == API_SPEAKER else line}", file=sys.stderr)


def seed_dropout(seed: int, micro_step: int, rank: int) -> None:
    """Seed this micro-step's dropout from (seed, micro-step, rank) rather than carrying RNG state, so that a resumed
    run repeats an uninterrupted one's dropout masks (``kdcache train`` and ``CacheTrainer`` both call it)."""
    torch.manual_seed((seed * 1_000_003 + micro_step) * 1_009 + rank)


def fit_student(options: TrainOptions, reader: CacheReader, student: PreTrainedModel, *,
                tokenizer: dict[str, Any] | None, speaker: str = "kdcache train",
                announce: bool = True) -> tuple[TrainOptions, StudentFacts, TrainPlan]:
    """What the student decides of the options (``--alpha``), and the plan, checked against the cache.

    Args:
        options: the run's options, with the cache's defaults already filled in (``with_cache_defaults``).
        student: the transformers model (a PEFT model's own, ``unwrapped_student``).
        tokenizer: the student's tokenizer fingerprint, or None when its folder has none.
        speaker, announce: how the notes are headed, and whether to print them (rank 0).

    Raises:
        CacheCheckError: every mismatch between cache and student, at once.
    """
    facts = student_facts(student)
    options, said = options.with_student_defaults(facts.has_lm_head, not facts.is_causal and
                                                  not facts.is_encoder_decoder)
    if said:
        _say(speaker, said, announce)
    plan = plan_training(options, reader, facts, tokenizer)
    for note in plan.notes:
        _say(speaker, f"note: {note}", announce)
    # A temperature given without a logit KL to scale: the user's own option doing nothing, said even where notes are
    # not. The options come with the cache's defaults filled in, so the default temperature is never named.
    temperature = options.loss.logit.temperature
    if temperature not in (None, DEFAULT_TEMPERATURE) and (plan.logit_kind is None or not options.loss.kl_weight > 0):
        why = "the cache holds no teacher logits" if plan.logit_kind is None else "the KL's weight (beta) is 0"
        idle = f"temperature {temperature} does nothing here: it scales the logit KL, and {why}"
        if announce:
            _say(speaker, f"note: {idle}", announce)
        else:
            warnings.warn(f"{speaker}: {idle}", UserWarning, stacklevel=4)
    unused = unused_targets(reader.spec, plan, options)
    if unused:
        _say(speaker, f"note: cached targets this run leaves unused: {'; '.join(unused)}", announce)
    return options, facts, plan


def teacher_head_for(reader: CacheReader, plan: TrainPlan, *, speaker: str = "kdcache train",
                     announce: bool = True) -> TeacherHead | None:
    """The teacher's LM head of a ``--logits head`` cache when the KL uses it (its size stated), else None."""
    if plan.logit_kind is None or not plan.logit_kind.teacher_head:
        return None
    head = load_teacher_head(reader.store, reader.spec.hidden_layers)
    _say(speaker, head.describe(), announce)
    return head


def loss_options(reader: CacheReader, options: Mapping[str, Any]) -> TrainOptions:
    """``kdcache train``'s options from keyword options named as its flags (``gamma=1.0``, ``layer_map="last"``),
    with what the cache decides filled in.

    Raises:
        ApiError: an option that is not a loss or map option, or a value its group refuses.
    """
    unknown = sorted(set(options) - set(LOSS_OPTIONS))
    if unknown:
        guesses = [repr(name) + "".join(f" (did you mean {near!r}?)" for near in
                                        difflib.get_close_matches(name, LOSS_OPTIONS, 1)) for name in unknown]
        raise ApiError(f"unknown option(s) {', '.join(guesses)}; expected any of {', '.join(LOSS_OPTIONS)}")
    if options.get("cross_tokenizer"):
        raise ApiError(f"cross_tokenizer={options['cross_tokenizer']!r}: a student with another tokenizer trains "
                       "through `kdcache train --cross-tokenizer` only, for now; expected None")
    built = TrainOptions.of(cache=str(reader.root), student="", out="", **options)
    problems = built.loss.validate() + built.maps.validate()
    if problems:
        raise ApiError(api_spelling("bad loss options: " + "; ".join(problems)))
    return built.with_cache_defaults(reader.spec)[0]


def use_maps_attention(student: object, reader: CacheReader, delta: float) -> None:
    """Switch the student to the attention that returns its maps before dropout when the attention term reads maps
    (``kdcache train`` loads it so; a model loaded by the user has SDPA, which returns none), and say so with a
    warning: the user's model changes."""
    if delta <= 0 or not attention_sources.of(reader.spec.attention_layout).student_maps:
        return
    model = unwrapped_student(student)
    before = getattr(model.config, "_attn_implementation", None)
    if before == MAPS_ATTENTION:
        return
    register_maps_attention()
    model.set_attn_implementation(MAPS_ATTENTION)
    warnings.warn(f"DistillationLoss: the attention term (delta={delta:g}) reads the student's attention maps, so its "
                  f"attention implementation was switched from {before!r} to {MAPS_ATTENTION!r} (eager, maps taken "
                  f"before dropout); set delta=0 to keep the model as it was", UserWarning, stacklevel=3)


def check_tokenizer(reader: CacheReader, student: object, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a tokenizer given beside the student (``processing_class``) that is not the cache's.

    Raises:
        CacheCheckError: the vocabulary or tokenizer differs from the cache's (training's own sentences).
    """
    vocab = int(getattr(unwrapped_student(student).config, "vocab_size", 0) or 0)
    problems = vocab_problems(reader, vocab, tokenizer_fingerprint(tokenizer), logits_needed=False)
    if problems:
        raise CacheCheckError([api_spelling(p) for p in problems], what="the tokenizer does not fit the cache")


class CacheDataset(CacheStream):
    """A rank's micro-batches of a cache, in ``kdcache train``'s deterministic order; use it with
    ``DataLoader(dataset, batch_size=None)``.

    Each item is a dict on the host: per token stream ``input_ids`` and ``mask`` ``[B, L]`` (plus ``loss_mask`` and
    ``position_ids`` when the cache has them), the targets ``[B, L, ...]`` still in their stored dtype (coded
    hidden states as their codes), ``sample_ids [B]``, and ``epoch`` / ``step_in_epoch`` (ints) saying where it
    came from. ``to_device`` moves a batch and decodes its targets there; ``position_after`` is the exact resume
    state once a batch is consumed (give it back as ``start=``). ``state_dict()`` / ``load_state_dict()`` say the
    same as torchdata's ``StatefulDataLoader`` does: where the stream stands after the batches it has handed out
    (read in this process: ``DataLoader(..., num_workers=0)``, as ``CacheTrainer`` and ``kdcache train`` read it).

    Args:
        cache: a cache folder or URL, or an open ``CacheReader``.
        arrays: the cached arrays to read (``DistillationLoss.arrays``: what the loss needs).
        batch_size: sequences per micro-batch on this rank.
        seed: the order's seed (shards, then blocks of ``shuffle_block`` sequences, are shuffled per epoch).
        rank, world_size: this rank's share; None: from ``torch.distributed`` when it is initialised, else 0 of 1.
        start: where to begin (a ``position_after`` of an earlier run, or its ``to_dict()``).
    """

    def __init__(self, cache: str | os.PathLike[str] | CacheReader, arrays: tuple[str, ...] | list[str], *,
                 batch_size: int, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 start: DataPosition | Mapping[str, int] | None = None, shuffle_block: int = 256, prefetch: int = 4,
                 decode_threads: int = 0, pin_memory: bool = False, prefetch_mib: int = PREFETCH_MIB):
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = (torch.distributed.get_rank() if dist else 0) if rank is None else rank
        world_size = (torch.distributed.get_world_size() if dist else 1) if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ApiError(f"rank {rank} of world size {world_size}: expected 0 <= rank < world_size")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ApiError(f"batch_size={batch_size!r}: expected a whole number of sequences >= 1")
        if isinstance(start, Mapping):
            start = DataPosition(int(start["epoch"]), int(start["sample_index"]))
        reader = open_cache(os.fspath(cache)) if isinstance(cache, (str, os.PathLike)) else cache
        super().__init__(reader, arrays, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         start=start or DataPosition(), shuffle_block=shuffle_block, prefetch=prefetch,
                         decode_threads=decode_threads, pin_memory=pin_memory, prefetch_mib=prefetch_mib)
        self.reader = reader  # the open cache this process streams from

    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            self.start = self.position_after(batch)  # handed out: a resume starts after it (the state_dict's)
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Where the stream resumes (after the last batch handed out), and the settings that fix its order."""
        return resumable_state(self.start, self.world_size, self.batch_size, self.seed)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Start the next pass at ``state`` (a ``state_dict()``), refusing one of another seed, batch size or world.

        Raises:
            StreamStateError: naming each setting that differs.
        """
        self.start = check_resumable(dict(state), self.world_size, self.batch_size, self.seed)

    def position_after(self, batch: Mapping[str, Any]) -> DataPosition:
        """Where this rank's stream stands once ``batch`` (one of its items) is consumed on every rank."""
        return next_position(int(batch["epoch"]), int(batch["step_in_epoch"]), self.world_size, self.batch_size,
                             self.steps_per_epoch)


class StreamArgs(TypedDict, total=False):
    """``CacheDataset``'s arguments besides the cache, its arrays and the batch size."""

    seed: int
    rank: int | None
    world_size: int | None
    start: DataPosition | Mapping[str, int] | None
    shuffle_block: int
    prefetch: int
    prefetch_mib: int
    decode_threads: int
    pin_memory: bool


class Cache(CacheReader):
    """An open cache (``kdcache.open_cache``): the storage reader, and ``dataset`` to train from it."""

    def dataset(self, *, batch_size: int, arrays: tuple[str, ...] | list[str] | None = None,
                **kwargs: Unpack[StreamArgs]) -> CacheDataset:
        """A ``CacheDataset`` of this cache: ``arrays`` (default every per-sequence array; ``CacheTrainer`` keeps
        the order and settings and streams its loss's arrays), ``kwargs`` its other arguments."""
        return CacheDataset(self, arrays if arrays is not None else self.spec.sequence_names(),
                            batch_size=batch_size, **kwargs)


def open_cache(path: str | os.PathLike[str], *, allow_partial: bool = False,
               decode_threads: int | None = None) -> Cache:
    """Open a cache to train from, as a ``Cache``, with training's message when there is none
    (``core.checks.open_cache``).

    Args:
        path: the cache folder or URL.
        allow_partial: read the committed shards of a cache still being written.
        decode_threads: arrays decoded at once (None: one per core).
    """
    opened = open_checked(os.fspath(path), allow_partial=allow_partial, decode_threads=decode_threads, reader=Cache)
    return cast(Cache, opened)
