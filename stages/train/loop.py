"""Stage two's entry point: ``run_training(options) -> summary``.

Order of work: join the process group; open the cache and load the student (never the teacher); check that
they fit (``plan.plan_training``) before DeepSpeed starts; wrap student + loss (which holds the projectors)
in one module so DeepSpeed optimizes and shards both; stream micro-batches from the cache; step; log; save
checkpoints with the data position; export the student as a plain HF model.

Dropout is seeded per micro-step from (seed, micro-step, rank) rather than carried as RNG state, so a resumed
run continues the very loss trajectory of an uninterrupted one without saving every rank's generator.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from kdcache.stages.targets import attention as attention_sources
from kdcache.stages.targets.attention.attention_maps import MAPS_ATTENTION
from kdcache.stages.targets.logits.vocab import fused_vocab
from kdcache.stages.train import checkpoint as ckpt
from kdcache.stages.train.api import fit_student, seed_dropout, teacher_head_for
from kdcache.stages.train.checkpoint import CACHE_HASH, cache_hash, check_resume, init_record, start_projectors
from kdcache.stages.train.core.checks import open_cache
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.core.plan import TrainPlan
from kdcache.stages.train.core.student import (
    StudentFacts,
    enable_gradient_checkpointing,
    load_student,
    tokenizer_fingerprint_of,
)
from kdcache.stages.train.cross.cross_model import build_cross_model, without_logit_kl
from kdcache.stages.train.engine import DistInfo, build_engine, init_distributed
from kdcache.stages.train.evaluation.evaluate import lm_kind
from kdcache.stages.train.evaluation.heldout import HeldOut
from kdcache.stages.train.feed.device_feed import DeviceFeed
from kdcache.stages.train.feed.streaming import (
    BatchExtension,
    CacheStream,
    DataPosition,
    check_resumable,
    next_position,
    resumable_state,
)
from kdcache.stages.train.interrupt import TrainingInterrupted
from kdcache.stages.train.logging import MetricsLogger, SampleTrace, TrainProgress
from kdcache.stages.train.loss import DistillationLoss, DistillModel
from kdcache.stages.train.objective.step_norm import STEP_COUNTS, term_counts, with_step_counts
from kdcache.stages.train.stop_on_signal import StopOnSignal
from kdcache.storage import KdcacheError, split_stream

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedModel

    from kdcache.storage import CacheReader


class TrainingError(KdcacheError):
    """Training cannot start or go on (nothing to resume, no steps to run, a diverged loss)."""


def prepare(options: TrainOptions) -> tuple[CacheReader, PreTrainedModel, StudentFacts, TrainPlan, TrainOptions]:
    """Open the cache, load the student and check that they fit. Touches no teacher file.

    Returns:
        (reader, student, facts, plan, options with what the cache decides filled in).
    """
    # The run's one reader of the cache: the checks, the teacher head, the stream and the export all use it.
    reader = open_cache(options.data.cache, allow_partial=options.data.allow_partial,
                        decode_threads=options.data.decode_threads or None)
    options, chosen = options.with_cache_defaults(reader.spec)
    if chosen and int(os.environ.get("RANK", "0")) == 0:
        print(f"kdcache train: {chosen}", file=sys.stderr)
    # Maps need eager attention (fused kernels return none), taken before its dropout (attention_maps); a q/k cache
    # records the student's queries and keys.
    maps = attention_sources.of(reader.spec.attention_layout).student_maps
    attn = MAPS_ATTENTION if options.loss.delta > 0 and maps else None
    student = load_student(options.run.student, seed=options.data.seed, attn_implementation=attn)
    options, facts, plan = fit_student(options, reader, student, announce=int(os.environ.get("RANK", "0")) == 0,
                                       tokenizer=tokenizer_fingerprint_of(options.run.student))
    if options.engine.gradient_checkpointing:
        enable_gradient_checkpointing(student)
    return reader, student, facts, plan, options


def run_training(options: TrainOptions) -> dict[str, Any]:
    """Train a student from a cache under DeepSpeed; every rank calls this.

    Returns:
        A summary: steps, first/last loss, throughput, the run and student folders, the final data position.
    """
    # Checks first: a mismatch should cost a second, not a DeepSpeed start-up.
    reader, student, facts, plan, options = prepare(options)
    heldout = heldout_of(options, reader, plan)
    if ckpt.has_checkpoint(options.run.out) and not options.run.resume:
        raise TrainingError(f"{options.run.out} already holds a checkpoint; pass --resume to continue it, or "
                            "choose another --out")
    if options.run.resume and not ckpt.has_checkpoint(options.run.out):
        raise TrainingError(f"--resume: no checkpoint in {Path(options.run.out) / ckpt.CHECKPOINT_DIR}")
    if options.run.resume:  # before anything is written: a refused resume leaves the run folder as it was
        check_resume(options.run.out, options, reader.fingerprints)
    dist_info = init_distributed()
    fused_vocab.use_road(options.engine.vocab_kernel, dist_info.device)  # before the first step takes a road
    run_dir = Path(options.run.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    head = teacher_head_for(reader, plan, announce=dist_info.rank == 0)
    announce = dist_info.rank == 0 and not options.run.quiet
    model: torch.nn.Module
    extend: BatchExtension | None = None
    if options.loss.cross_tokenizer:
        ordinary = DistillationLoss.planned(without_logit_kl(options), plan, facts, reader, student, announce=announce)
        cross = build_cross_model(options, reader, student, ordinary, announce=announce)
        model, extend = cross, cross.aligner.extend  # the student's tokens are made with each batch, off the step
    else:
        model = DistillModel(student, DistillationLoss.planned(options, plan, facts, reader, student, head=head,
                                                               announce=announce))
    said = start_projectors(model, options.run.init_from)
    if said and announce:
        print(f"kdcache train: {said}", file=sys.stderr)
    engine = build_engine(model, options, dist_info.device)
    return _Trainer(options, plan, engine, dist_info, reader, extend, heldout, lm_kind(facts)).run()


def heldout_of(options: TrainOptions, reader: CacheReader, plan: TrainPlan) -> HeldOut | None:
    """``--eval-cache`` opened and checked against the training cache (the same teacher and settings), or None.

    Raises:
        EvaluationError: the held-out cache differs from the training cache (each difference named).
        TrainingError: a cross-tokenizer run (its batches are built from the training cache's texts).
    """
    if not options.run.eval_cache:
        return None
    if options.loss.cross_tokenizer:
        raise TrainingError("--eval-cache with --cross-tokenizer: a held-out loss is not scored across tokenizers "
                            "yet; score the exported student with `kdcache eval --cache HELDOUT --run RUN`")
    return HeldOut(open_cache(options.run.eval_cache), reader, plan.names, batch_size=options.data.batch_size,
                   label="--eval-cache")


HOST = "host"  # a prepared batch's facts from its host copy: {"tokens": real tokens, "sample_ids": host tensor}
DATA_WAIT_NOTE = 0.2  # share of wall time spent waiting for batches above which the log says so


class _Trainer:
    """The step loop and its bookkeeping (position, logs, checkpoints)."""

    def __init__(self, options: TrainOptions, plan: TrainPlan, engine: DeepSpeedEngine, dist_info: DistInfo,
                 reader: CacheReader, extend: BatchExtension | None = None, heldout: HeldOut | None = None,
                 lm: str | None = None):
        self.options, self.plan, self.engine, self.dist = options, plan, engine, dist_info
        self.extend = extend  # the run's own arrays added to each batch by the stream (cross-tokenizer runs)
        self.run_dir = Path(options.run.out)
        self.batch_size = int(engine.train_micro_batch_size_per_gpu())
        self.grad_accum = int(engine.gradient_accumulation_steps())
        self.zero_stage = int(engine.zero_optimization_stage())
        self.position, self.micro_step = DataPosition(), 0
        self.resumed_from: int | None = None
        self.logger = MetricsLogger(self.run_dir, rank=dist_info.rank, monitor=getattr(engine, "monitor", None))
        self.trace = SampleTrace(self.run_dir, dist_info.rank, enabled=options.run.trace_samples)
        self._sums: dict[str, torch.Tensor] = {}  # on the device, read only at a log step
        self._count = 0
        self._tokens = 0  # valid tokens since the last log, counted on the host batches
        self.tokens_seen = 0
        self._checkpoint_bytes = 0  # one checkpoint's estimated size, set before training (_check_checkpoint_room)
        self._waited, self._since_log, self._last_wait_note = 0.0, time.perf_counter(), -float("inf")
        self.losses: list[float] = []
        self.reader = reader  # streamed from in this process (a DataLoader worker opens its own)
        self.heldout, self.lm = heldout, lm  # --eval-cache, scored every --eval-every steps and at the end
        self.eval_logger = MetricsLogger(self.run_dir, rank=dist_info.rank, file="eval.jsonl", group="eval",
                                         monitor=getattr(engine, "monitor", None))

    # ---- set-up ------------------------------------------------------------------------------------
    def _restore(self) -> None:
        if not self.options.run.resume:
            return
        state = ckpt.load_latest(self.engine, self.run_dir)
        if state is None:
            raise TrainingError(f"--resume: no checkpoint in {self.run_dir / ckpt.CHECKPOINT_DIR}")
        self.position = check_resumable(state["data"], self.dist.world_size, self.batch_size, self.options.data.seed)
        self.micro_step, self.resumed_from = int(state["micro_step"]), int(state["step"])
        critics = self.engine.module.criterion.critics
        if critics is not None and "critics" in state:
            critics.load_state_dict(state["critics"])

    def _loader(self) -> torch.utils.data.DataLoader[dict[str, torch.Tensor]]:
        """The rank's stream (``self.stream``, which also moves its batches to the device) in a DataLoader."""
        o = self.options.data
        # Pinned batches let to_device copy without blocking. A worker process's pinned pages do not survive the
        # trip to this one, so with workers the DataLoader pins here; without, the stream's threads pin ahead.
        cuda = self.dist.device.type == "cuda"
        self.stream = CacheStream(self.reader, self.plan.names, batch_size=self.batch_size, seed=o.seed,
                                  rank=self.dist.rank, world_size=self.dist.world_size, start=self.position,
                                  shuffle_block=o.shuffle_block, prefetch=o.prefetch, prefetch_mib=o.prefetch_mib,
                                  decode_threads=o.decode_threads, allow_partial=o.allow_partial,
                                  pin_memory=cuda and o.num_workers == 0, extend=self.extend)
        return torch.utils.data.DataLoader(self.stream, batch_size=None, num_workers=o.num_workers,
                                           persistent_workers=False, pin_memory=cuda and o.num_workers > 0)

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run: --max-steps, else --epochs (default 1) over the cache."""
        if self.options.run.max_steps is not None:
            return self.options.run.max_steps
        total = (self.options.run.epochs or 1) * steps_per_epoch // self.grad_accum
        if total < 1:
            raise TrainingError(f"one epoch is {steps_per_epoch} micro-batches per rank, fewer than one "
                                f"optimizer step of {self.grad_accum}; lower --grad-accum or --batch-size")
        return total

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._restore()
        loader = self._loader()
        total = self.total_steps(self.stream.steps_per_epoch)
        if self.resumed_from is not None and total < self.resumed_from:  # the loop would not run, nor say so
            raise TrainingError(f"--resume: this run would end at step {total} (--max-steps or --epochs), before "
                                f"its checkpoint's step {self.resumed_from}; a resumed run continues from there: "
                                f"ask for at least {self.resumed_from} steps")
        self._write_run_files(total)
        self._check_checkpoint_room(total)
        start, start_step = time.perf_counter(), self.engine.global_steps
        quiet = self.options.run.quiet
        self.progress = TrainProgress(total, int(start_step), enabled=self.dist.rank == 0 and not quiet)
        self._since_log = start
        self.engine.train()
        feed = DeviceFeed(self._counted(loader), self._prepare, self.dist.device)  # batch i+1 beside step i
        batches = iter(feed)
        # Ctrl-C / SIGTERM: finish the optimizer step, then save below and say how to resume (interrupt.py).
        with StopOnSignal(self.dist.world_size, announce=self.dist.rank == 0) as stop:
            while self.engine.global_steps < total:
                waited = feed.waited
                batch = next(batches, None)
                self._waited += feed.waited - waited  # the step stood still: the reader was behind
                if batch is None:
                    break
                stepped = self._micro_step(batch)
                batch = None  # batch i goes before batch i+2 is prepared: one batch ahead on the device, not two
                if stepped:
                    self._after_optimizer_step(total)
                    if stop.requested():
                        break
            elapsed = time.perf_counter() - start
            if self.engine.global_steps > (self.resumed_from or 0) or not ckpt.has_checkpoint(self.run_dir):
                self._save()
        self.progress.close()
        if stop.signum:
            raise TrainingInterrupted(stop.signum, int(self.engine.global_steps), str(self.run_dir))
        student_dir = self._export() if self.options.run.export else None
        steps = self.engine.global_steps - start_step
        return {"steps": int(self.engine.global_steps), "steps_this_run": int(steps),
                "micro_steps": self.micro_step, "steps_per_s": steps / elapsed if elapsed > 0 else 0.0,
                "tokens_per_s": self.tokens_seen / elapsed if elapsed > 0 else 0.0,
                "first_loss": self.losses[0] if self.losses else None,
                "last_loss": self.losses[-1] if self.losses else None, "resumed_from": self.resumed_from,
                "position": self.position.to_dict(), "run_dir": str(self.run_dir),
                "student_dir": str(student_dir) if student_dir else None, "world_size": self.dist.world_size,
                "zero_stage": self.zero_stage}

    def _counted(self, loader: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
        """The host batches, an optimizer step's at a time with each term's counts (``step_norm``), so that every
        term is normalised by its whole step's count. A cross-tokenizer run's loss counts spans it makes on the
        device: its micro-batches keep their own means."""
        module = self.engine.module
        if not isinstance(module, DistillModel):
            return loader
        return with_step_counts(loader, self.grad_accum, lambda batch: term_counts(module.criterion, batch))

    def _micro_step(self, batch: dict[str, Any]) -> bool:
        """Forward, backward and (on a boundary) the optimizer step for one micro-batch; whether it stepped."""
        before = self.engine.global_steps
        seed_dropout(self.options.data.seed, self.micro_step, self.dist.rank)
        epoch, step_in_epoch, host = batch.pop("epoch"), batch.pop("step_in_epoch"), batch.pop(HOST)
        self._tokens += host["tokens"]
        counts = host.get(STEP_COUNTS)
        out = self.engine(batch) if counts is None else self.engine(
            batch, scales=counts[1].scales(counts[0], self.dist.world_size, self.dist.device))
        self.engine.backward(out["loss"])
        self.engine.step()
        for name, value in out.items():
            self._sums[name] = self._sums.get(name, 0.0) + value.detach().float()
        self._count += 1
        self.micro_step += 1
        self.position = next_position(epoch, step_in_epoch, self.dist.world_size, self.batch_size,
                                      self.stream.steps_per_epoch)
        if self.trace.enabled:  # reads the loss on the host: a sync per micro-step (the option's help says so)
            self.trace.record(self.micro_step - 1, epoch, step_in_epoch, host["sample_ids"].tolist(),
                              float(out["loss"]))
        return self.engine.global_steps != before

    def _prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A host batch on the device, its coded targets decoded there; under ``HOST`` what the step reads of the
        host copy (real tokens, sample ids), so that it reads no device value."""
        counts = batch.pop(STEP_COUNTS, None)
        tokens = sum(int(value.numpy().sum()) for name, value in batch.items() if split_stream(name)[1] == "mask")
        out = self.stream.to_device(batch, self.dist.device)
        out[HOST] = {"tokens": tokens, "sample_ids": batch["sample_ids"], STEP_COUNTS: counts}
        return out

    def _after_optimizer_step(self, total: int) -> None:
        step = int(self.engine.global_steps)
        if step % self.options.run.log_every == 0 or step >= total:
            self._log(step)
        every = self.options.run.eval_every
        if self.heldout is not None and ((every and step % every == 0) or step >= total):
            self._evaluate(step)
        if self.options.run.save_every and step % self.options.run.save_every == 0 and step < total:
            self._save()

    def _evaluate(self, step: int) -> None:
        """Score the held-out cache with the run's loss, in eval mode; rank 0 writes ``eval.jsonl``."""
        assert self.heldout is not None
        module = self.engine.module
        module.eval()
        try:
            loss = module.criterion
            scores = self.heldout.score(lambda batch: loss.student_outputs(module.student, batch), loss, lm=self.lm,
                                        device=self.dist.device)
        finally:
            module.train()
        self.eval_logger.log(step, {f"eval_{name}": value for name, value in scores.items()})

    def _log(self, step: int) -> None:
        """Average each term over the micro-steps since the last log and over ranks; rank 0 writes it."""
        names = sorted(self._sums)
        values = torch.stack([self._sums[n] / max(1, self._count) for n in names]).cpu()
        if self.dist.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= self.dist.world_size
        record = dict(zip(names, (float(v) for v in values)))
        self.losses.append(record["loss"])
        if not torch.isfinite(values).all():
            raise TrainingError(f"the loss diverged at step {step}: {record}; lower --lr or check the cache")
        lr = self.engine.get_lr()[0] if self.engine.get_lr() else None
        wait = self._data_wait(step)
        tokens, self._tokens = self._tokens, 0
        self.tokens_seen += tokens
        self.logger.log(step, record, lr=lr, epoch=self.position.epoch, sample_index=self.position.sample_index,
                        tokens=tokens, **wait)
        self.progress.update(step, record, wait["data_wait_share"], tokens)
        self._sums, self._count = {}, 0

    def _data_wait(self, step: int) -> dict[str, float]:
        """Seconds per optimizer step spent waiting for batches since the last log, and their share of the
        wall time; says so on rank 0 (at most once a minute) when the data, not the model, sets the pace."""
        now = time.perf_counter()
        steps = max(1, self._count // max(1, self.grad_accum))
        share = self._waited / max(now - self._since_log, 1e-9)
        out = {"data_wait_s": round(self._waited / steps, 5), "data_wait_share": round(share, 4)}
        started = step <= self.options.run.log_every  # the first interval pays the stream's start-up: not a verdict
        if share > DATA_WAIT_NOTE and not started and self.dist.rank == 0 and now - self._last_wait_note > 60:
            self._last_wait_note = now
            print(f"kdcache train: step {step}: waiting for data {share:.0%} of the time ({out['data_wait_s']:.3f} s "
                  f"per step) reading {self.options.data.cache}; raise --prefetch or --decode-threads, or move the "
                  f"cache closer to the GPUs", flush=True)
        self._waited, self._since_log = 0.0, now
        return out

    def _check_checkpoint_room(self, total: int) -> None:
        """State each checkpoint's size and the free space (rank 0); refuse a destination that cannot hold one."""
        half = bool(self.engine.bfloat16_enabled() or self.engine.fp16_enabled())
        self._checkpoint_bytes = ckpt.estimate_bytes(self.engine.module, half)
        every = self.options.run.save_every
        count = (total - 1) // every + 1 if every else 1  # the periodic ones, and the last
        line = ckpt.check_room(self.run_dir, self._checkpoint_bytes, count)
        if self.dist.rank == 0 and not self.options.run.quiet:
            print(f"kdcache train: {line}", file=sys.stderr)

    def _save(self) -> None:
        data = resumable_state(self.position, self.dist.world_size, self.batch_size, self.options.data.seed)
        critics = self.engine.module.criterion.critics
        extra = {"critics": critics.state_dict()} if critics is not None else {}
        ckpt.save_checkpoint(self.engine, self.run_dir, step=int(self.engine.global_steps),
                             micro_step=self.micro_step, data_state=data, extra=extra,
                             estimate=self._checkpoint_bytes)

    def _export(self) -> Path:
        module = self.engine.module
        cross = self.options.loss.cross_tokenizer
        with tempfile.TemporaryDirectory(prefix="kdcache-tokenizer-") as scratch:  # a remote cache's copy
            if cross and self.dist.rank == 0:  # a cross-tokenizer student's own tokenizer goes beside it
                AutoTokenizer.from_pretrained(self.options.run.student).save_pretrained(scratch)
            tokenizer = (None if self.dist.rank != 0 else Path(scratch) if cross else
                         self.reader.store.fetch_folder("tokenizer", Path(scratch)))
            return ckpt.export_student(module.student, module.criterion.projectors, self.run_dir,
                                       rank=self.dist.rank, zero_stage=self.zero_stage, tokenizer_dir=tokenizer)

    def _write_run_files(self, total: int) -> None:
        if self.dist.rank != 0:
            return
        (self.run_dir / "options.json").write_text(json.dumps(self.options.to_dict(), indent=2) + "\n")
        plan = {**self.plan.to_json(), "total_steps": total, CACHE_HASH: cache_hash(self.reader.fingerprints),
                **init_record(self.options.run.init_from),
                "batch_size": self.batch_size, "grad_accum": self.grad_accum, "world_size": self.dist.world_size,
                "zero_stage": self.zero_stage}
        ckpt.write_plan(self.run_dir, plan)
