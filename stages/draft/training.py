"""``kdcache draft``: train an EAGLE-3 head from a cache written with ``--layers draft``, with no target in memory.

The cache is read as ``kdcache train`` reads it (``CacheStream``, decoded on the device by its ``to_device`` with the
cache's hidden codec), and the head trains under the same DeepSpeed engine set-up (``engine.build_engine``). What
the draft needs beside the three layers comes from the cache too: the target's embedding and token counts
(``draft/``), its next-token distribution (the logits, or ``teacher_head/`` on the last layer).

Checkpoints are stage two's (``stages.train.checkpoint``): every ``save_every`` steps and at the end, with the
stream's position and the losses so far in the client state, so ``resume`` reads exactly the batches an
uninterrupted run would have read next (the order is a pure function of seed, epoch and shard ranges) and ends
with its weights. The run folder's rules are train's (``run_record``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.draft.export import LAYOUTS, export_draft
from kdcache.stages.draft.model import DraftShape, Eagle3Draft, default_heads
from kdcache.stages.draft.objective import DraftObjective, distribution_arrays
from kdcache.stages.draft.run_record import check_out, check_resume, write_record
from kdcache.stages.draft.vocab import DraftInputError, DraftVocab
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.draft.draft_inputs import read_draft_inputs
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train import checkpoint as ckpt
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.engine import DistInfo, build_engine, init_distributed
from kdcache.stages.train.feed.streaming import (
    CacheStream,
    DataPosition,
    check_resumable,
    next_position,
    resumable_state,
)
from kdcache.stages.train.interrupt import TrainingInterrupted
from kdcache.stages.train.stop_on_signal import StopOnSignal
from kdcache.storage import CacheReader

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

DEFAULT_DRAFT_VOCAB = 32000


@dataclass(frozen=True)
class DraftOptions:
    """What ``kdcache draft`` takes (its flags, by the same names)."""

    cache: str
    out: str
    ttt_steps: int = 3  # K: steps the draft is fed its own outputs in training
    draft_vocab: int = 0  # N, at most V; 0: min(32000, V), EAGLE-3's usual size
    max_steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    heads: int = 0  # 0: default_heads(d)
    intermediate: int = 0  # 0: 4 d
    layout: str = "speculators"  # export.LAYOUTS: speculators (vLLM reads it) or sglang
    save_every: int = 0  # a checkpoint every N steps (0: at the end only)
    resume: bool = False  # continue from the latest checkpoint in out, under its record

    def problems(self) -> list[str]:
        """Values out of range, each with what was expected."""
        checks = [("ttt_steps", self.ttt_steps, 1, "at least 1 (the steps a draft is trained to chain)"),
                  ("max_steps", self.max_steps, 1, "at least 1"), ("batch_size", self.batch_size, 1, "at least 1"),
                  ("save_every", self.save_every, 0, "at least 0 (0: a checkpoint at the end only)")]
        out = [f"--{name.replace('_', '-')}: got {value}, expected {wanted}"
               for name, value, least, wanted in checks if value < least]
        return out + ([] if self.layout in LAYOUTS else
                      [f"--layout: got {self.layout!r}, expected one of {', '.join(LAYOUTS)}"])


def open_draft_cache(cache: str) -> tuple[CacheReader, dict[str, torch.Tensor], dict[str, Any]]:
    """The cache, its ``draft/`` tensors and record, checked to hold the layers the draft fuses.

    Raises:
        KdcacheError: no ``draft/``, or a fused layer missing from the cache.
    """
    reader = CacheReader(cache)
    tensors, info = read_draft_inputs(reader.store)
    missing = [j for j in info["layers"] if j not in reader.spec.hidden_layers]
    if missing:
        raise DraftInputError(f"the cache's draft/ names layers {info['layers']}, but hidden layers {missing} are not "
                              f"in the cache (it holds {list(reader.spec.hidden_layers)}); rerun stage one with "
                              f"--layers draft")
    return reader, tensors, info


def new_draft(tensors: dict[str, torch.Tensor], info: dict[str, Any], options: DraftOptions) -> Eagle3Draft:
    """A freshly initialised draft over the cache's embedding and most frequent tokens."""
    d, vocab = int(info["hidden_size"]), int(info["vocab_size"])
    size = options.draft_vocab or min(DEFAULT_DRAFT_VOCAB, vocab)
    if not 1 <= size <= vocab:
        raise DraftInputError(f"--draft-vocab: got {options.draft_vocab}, expected 1..{vocab}, at most the target's "
                              f"vocabulary size V (0: min({DEFAULT_DRAFT_VOCAB}, V))")
    words = DraftVocab.most_frequent(tensors["token_counts"], size)
    heads = options.heads or default_heads(d)
    if d % heads:
        raise DraftInputError(f"--heads: got {heads}, expected a divisor of the hidden size {d}")
    shape = DraftShape(d, vocab, size, heads, options.intermediate or 4 * d,
                       tuple(info["layers"]))
    torch.manual_seed(options.seed)
    return Eagle3Draft(shape, tensors["embedding"], words.d2t, words.t2d)


def run_draft(options: DraftOptions) -> dict[str, Any]:
    """Train (or, with ``resume``, go on training), export to ``options.out``, and return a summary (steps, first
    and last loss, accuracy per step).

    Raises:
        DraftInputError: bad values, a cache without the draft's inputs, an ``out`` holding a draft or a checkpoint
            without ``resume``; ``RunChangedError``: a resume whose options or cache differ from the run's record.
    """
    problems = options.problems()
    if problems:
        raise DraftInputError("; ".join(problems))
    check_out(options.out, options.resume)  # before the cache is read: a taken folder costs nothing
    reader, tensors, info = open_draft_cache(options.cache)
    if options.resume:  # before anything is written: a refused resume leaves the run folder as it was
        check_resume(asdict(options), reader.fingerprints)
    kind = logit_kinds.of(reader.spec.logit_layout)
    names = ["input_ids", *(f"hidden/{j}" for j in info["layers"]), *distribution_arrays(reader.spec, kind)]
    assert kind is not None  # distribution_arrays refused a cache without logits
    draft = new_draft(tensors, info, options)
    dist_info = init_distributed()
    head = load_teacher_head(reader.store, reader.spec.hidden_layers) if kind.teacher_head else None
    objective = DraftObjective(draft, kind, head, options.ttt_steps).to(dist_info.device)
    engine = build_engine(objective, _engine_options(options), dist_info.device)
    run = _DraftRun(options, engine, reader, dist_info)
    stream = CacheStream(reader, sorted(set(names)), batch_size=options.batch_size, seed=options.seed,
                         rank=dist_info.rank, world_size=dist_info.world_size, start=run.position)
    if dist_info.rank == 0:
        write_record(asdict(options), reader.fingerprints, dist_info.world_size)
    start = time.perf_counter()
    losses = run.train(stream)
    out = Path(options.out)
    if dist_info.rank == 0:
        target = {**info, "name_or_path": reader.fingerprints.get("teacher", {}).get("name_or_path")}
        export_draft(draft, out, target, options.ttt_steps, options.layout)
        (out / "draft_run.json").write_text(json.dumps({"options": asdict(options), "losses": losses}, indent=1))
    return {"steps": len(losses), "layout": options.layout, "first_loss": losses[0]["loss"],
            "last_loss": losses[-1]["loss"], "resumed_from": run.resumed_from,
            "last_accuracy": losses[-1]["accuracy"], "out": str(out), "seconds": time.perf_counter() - start}


def _engine_options(options: DraftOptions) -> TrainOptions:
    """The engine set-up ``kdcache train`` uses, for the draft's batch, rate and run folder."""
    return TrainOptions.of(cache=options.cache, student=options.out, out=options.out, batch_size=options.batch_size,
                           lr=options.lr, seed=options.seed, warmup_steps=0)


_READ_EVERY = 64  # steps whose losses wait on the device before one read (a read waits for the device)


class _DraftRun:
    """The step loop with stage two's checkpoints: the stream's position and the losses so far travel in each
    checkpoint's client state; a resumed run restores them with the weights, optimiser and step count."""

    def __init__(self, options: DraftOptions, engine: DeepSpeedEngine, reader: CacheReader, dist_info: DistInfo):
        self.options, self.engine, self.reader, self.dist = options, engine, reader, dist_info
        self.position, self.losses = DataPosition(), list[dict[str, float]]()
        self._pending: list[torch.Tensor] = []  # [2] (loss, accuracy) per step, still on the device
        self.resumed_from: int | None = None
        self.checkpoint_bytes = ckpt.estimate_bytes(engine.module, bool(engine.bfloat16_enabled()
                                                                         or engine.fp16_enabled()))
        if options.resume:
            self._restore()
        every = options.save_every
        count = (options.max_steps - 1) // every + 1 if every else 1  # the periodic ones, and the last
        line = ckpt.check_room(options.out, self.checkpoint_bytes, count)
        if dist_info.rank == 0:
            print(f"kdcache draft: {line}", file=sys.stderr)

    def _restore(self) -> None:
        state = ckpt.load_latest(self.engine, self.options.out)
        if state is None:
            raise DraftInputError(f"--resume: no checkpoint in {Path(self.options.out) / ckpt.CHECKPOINT_DIR}")
        self.position = check_resumable(state["data"], self.dist.world_size, self.options.batch_size,
                                        self.options.seed)
        self.losses, self.resumed_from = list(state["losses"]), int(state["step"])
        if self.options.max_steps < self.resumed_from:  # the loop would not run and the export keep the later step
            raise DraftInputError(f"--max-steps: {self.options.max_steps} is below the checkpoint's step "
                                  f"{self.resumed_from}; a resumed run continues from there: pass at least "
                                  f"{self.resumed_from}")

    def train(self, stream: CacheStream) -> list[dict[str, float]]:
        """Optimiser steps up to ``max_steps`` (epochs repeat); per step its loss and step-0 accuracy. A signal
        (Ctrl-C, SIGTERM) ends the step under way, saves, and raises ``TrainingInterrupted``."""
        batches = iter(stream)  # CacheStream repeats epochs: it never ends
        self.engine.train()
        with StopOnSignal(self.dist.world_size, announce=self.dist.rank == 0, speaker="kdcache draft") as stop:
            while self.engine.global_steps < self.options.max_steps:
                self._step(next(batches), stream)
                step, every, stopping = int(self.engine.global_steps), self.options.save_every, stop.requested()
                if stopping or (every and step % every == 0 and step < self.options.max_steps):
                    self._save()
                if stopping:
                    raise TrainingInterrupted(stop.signum, step, self.options.out)
            if self.engine.global_steps > (self.resumed_from or 0) or not ckpt.has_checkpoint(self.options.out):
                self._save()  # the last one, unless a resumed run had no step left to take
        self._flush()
        return self.losses

    def _flush(self) -> None:
        """Read the pending steps' losses to the host at once: one wait for the device every _READ_EVERY steps
        (and at each checkpoint), not one a step."""
        if self._pending:
            rows = torch.stack(self._pending).tolist()
            self.losses += [{"loss": loss, "accuracy": accuracy} for loss, accuracy in rows]
            self._pending.clear()

    def _step(self, batch: dict[str, Any], stream: CacheStream) -> None:
        """One optimiser step on a host batch of ``stream`` (which decodes it on the device, with the projection
        it loaded once); its loss and accuracy kept, and the stream's position after it."""
        epoch, step_in_epoch = batch.pop("epoch"), batch.pop("step_in_epoch")
        out = self.engine(stream.to_device(batch, self.dist.device))
        self.engine.backward(out["loss"])
        self.engine.step()
        self._pending.append(torch.stack([out["loss"].detach().float(), out["accuracy"].detach().float()]))
        if len(self._pending) >= _READ_EVERY:
            self._flush()
        self.position = next_position(epoch, step_in_epoch, self.dist.world_size, self.options.batch_size,
                                      stream.steps_per_epoch)

    def _save(self) -> None:
        self._flush()  # the checkpoint holds every step's loss so far
        data = resumable_state(self.position, self.dist.world_size, self.options.batch_size, self.options.seed)
        ckpt.save_checkpoint(self.engine, self.options.out, step=int(self.engine.global_steps),
                             micro_step=int(self.engine.global_steps), data_state=data,
                             extra={"losses": self.losses}, estimate=self.checkpoint_bytes)
