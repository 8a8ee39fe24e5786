"""``CacheTrainer``: a ``transformers.Trainer`` that trains a student from a kdcache cache instead of a teacher.

Everything kdcache-specific is the same code ``kdcache train`` runs (``api``, ``loss``): the batches and their order
(``CacheDataset``), and the run's one loss (``DistillationLoss``: the student's forward and its terms); what stays
``Trainer``'s is the optimizer, scheduler, mixed precision, DeepSpeed, callbacks, ``report_to`` and checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, speed_metrics

from kdcache.stages.train.api import ApiError, CacheDataset, check_tokenizer, seed_dropout
from kdcache.stages.train.checkpoint import PROJECTORS_FILE, read_projectors, save_projectors, write_plan
from kdcache.stages.train.core.checks import open_cache
from kdcache.stages.train.evaluation.evaluate import lm_kind
from kdcache.stages.train.evaluation.heldout import HeldOut
from kdcache.stages.train.feed.ahead import PREFETCH_MIB
from kdcache.stages.train.feed.streaming import CacheStream, DataPosition, check_resumable, resumable_state
from kdcache.stages.train.hf_args import DistillationArguments, options_of
from kdcache.stages.train.hf_checks import check_optimizer, check_parallel
from kdcache.stages.train.loss import DistillationLoss
from kdcache.stages.train.objective.step_norm import StepCounts, term_counts
from kdcache.storage import CacheReader

if TYPE_CHECKING:
    from kdcache.stages.train.objective.step_norm import Counts

STATE_FILE = "kdcache_state.json"  # beside each checkpoint's weights: the stream position and the micro-step
TRAINING_ARGS_FILE = "training_args.bin"  # what Trainer._save adds to every folder it writes
# The cache's collate pads the targets, and the loss is DistillationLoss (see the class docstring).
REFUSED = ("data_collator", "compute_loss_func")
CacheSource = str | os.PathLike[str] | CacheReader | CacheStream  # a cache as the API takes it
LOSS_MODULE = "kdcache_loss"  # under DeepSpeed, the loss module's name inside the model DeepSpeed wraps


class _ZeroLossGrads(TrainerCallback):
    """Clears the loss module's gradients after each optimizer step: ``Trainer`` zeroes only its model's, and the
    projectors live beside the model, not in it."""

    def __init__(self, module: nn.Module):
        self.module = module

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: object) -> None:
        self.module.zero_grad(set_to_none=True)


class CacheTrainer(Trainer):
    """A ``transformers.Trainer`` whose data and loss come from a kdcache cache; the teacher is never loaded.

    What it does where ``Trainer``'s defaults would go wrong with cached targets:

    * **Columns.** The train dataset and collator are the cache's (``CacheDataset``, batches already padded per
      token stream with their masks); they never pass through ``remove_unused_columns``, which would drop every
      target because the student's ``forward`` does not name them. A ``train_dataset`` must be a cache (or a
      ``CacheDataset`` of one: its order and stream settings are kept, its arrays become the loss's);
      ``data_collator`` and ``compute_loss_func`` are refused.
    * **Targets.** Nothing pads or casts the targets but the cache's own collate; they reach the device in their
      stored dtype and are decoded there (``_prepare_inputs``), as ``kdcache train`` does.
    * **Loss.** ``compute_loss`` is ``DistillationLoss`` on the student's outputs; each term (``ce``, ``topk_kl``,
      ``hidden/s1_t2``...) is averaged since the last log and logged beside ``loss``, so it reaches every
      ``report_to`` integration.
    * **Projectors.** They join the optimizer as one more parameter group, their gradients are clipped together
      with the student's (as ``kdcache train`` clips all) and cleared after each step, and they are saved beside
      the student (``projectors.pt``, ``kdcache train``'s format) with the run's ``plan.json``, so that
      ``kdcache eval --run`` scores a ``save_model`` folder, and loaded again on resume.
    * **Resume.** ``resume_from_checkpoint`` restarts the stream at its saved position (``kdcache_state.json``)
      instead of letting ``Trainer`` re-read and skip the batches already trained on (``ignore_data_skip`` is set).
      Dropout is seeded per micro-step as in ``kdcache train``, so a resumed run repeats an uninterrupted one.
    * **Steps and epochs.** With ``max_steps`` unset, ``num_train_epochs`` passes over the cache. The stream has no
      length (``Trainer`` would restart it each epoch), so the logged ``epoch`` is the stream's own: epochs of the
      cache consumed, from its position.
    * **Evaluation.** On a held-out cache (``eval_cache``, or an ``eval_dataset`` that is a cache), checked
      against the training cache's teacher and settings: ``evaluate()`` and ``eval_strategy`` report every loss
      term and the agreement with the teacher (``HeldOut.score``) as ``eval_*``, so ``metric_for_best_model``,
      ``load_best_model_at_end`` (the projectors are loaded with the student) and ``EarlyStoppingCallback`` work.
      Student and loss run in eval mode there, and no training step changes (dropout is seeded per micro-step).
    * **Optimizer.** One you pass (``optimizers=(optimizer, scheduler)``) must already hold the loss's parameters
      (``loss.parameters()``: the projectors); otherwise they would never train, and it is refused.
    * **DeepSpeed.** ``TrainingArguments(deepspeed=...)`` works up to ZeRO-2. DeepSpeed optimizes only parameters
      of the module it wraps, so there the loss module is attached to the model as ``model.kdcache_loss`` (and
      left out of every saved student: ``_save`` drops its keys); DeepSpeed then clips, steps and checkpoints the
      projectors with the student. ZeRO-3 is refused (the projectors' forward runs outside the student's, where
      ZeRO-3 would not gather them). Without DeepSpeed
      a single process is supported (the student runs outside a DDP wrapper's forward, which would not sync it).

    Args:
        model: the student (a transformers model, or a PEFT model: its adapters train, its frozen weights stay).
        args: ``TrainingArguments``; ``per_device_train_batch_size`` and ``seed`` set the cache's batches and order.
            ``DistillationArguments`` also carry the loss options and ``eval_cache``.
        cache: a cache folder or URL, or an open ``CacheReader`` (or give it as ``train_dataset``).
        loss: a ``DistillationLoss`` built for ``model``; default: one built from ``loss_options``.
        loss_options: ``DistillationLoss``'s keyword options (``gamma``, ``layer_map``...; ``seed`` defaults to
            ``args.seed``).
        eval_cache: a held-out cache (folder, URL or ``CacheReader``) of the same teacher and settings, scored by
            ``evaluate()`` in batches of ``per_device_eval_batch_size``.
        shuffle_block, prefetch, prefetch_mib: the stream's settings (``kdcache train``'s ``--shuffle-block``,
            ``--prefetch``, ``--prefetch-mib``).
        **kwargs: the rest of ``Trainer``'s arguments (callbacks, ``processing_class``, ``optimizers``...).
    """

    def __init__(self, model: nn.Module, args: TrainingArguments, cache: CacheSource | None = None, *,
                 loss: DistillationLoss | None = None, loss_options: dict[str, Any] | None = None,
                 eval_cache: CacheSource | None = None, shuffle_block: int = 256, prefetch: int = 4,
                 prefetch_mib: int = PREFETCH_MIB, **kwargs: Any):
        given = sorted(set(kwargs) & set(REFUSED))
        if given:
            raise ApiError(f"CacheTrainer builds its own {', '.join(given)} (the cache's collate pads the targets, "
                           "and the loss is DistillationLoss); leave them out")
        args = copy.copy(args)  # ignore_data_skip and max_steps are set below: the caller's arguments stay theirs
        check_parallel(args)
        source = _training_source(cache, kwargs, args)
        if isinstance(source, CacheStream):  # its order and stream settings are kept; its arrays become the loss's
            shuffle_block, prefetch, prefetch_mib = source.shuffle_block, source.prefetch, source.prefetch_bytes >> 20
        reader = _reader(source, "train_dataset" if cache is None else "cache")
        if eval_cache is None and isinstance(args, DistillationArguments):
            eval_cache = args.eval_cache
        tokenizer = kwargs.get("processing_class")
        tokenizer = tokenizer if hasattr(tokenizer, "get_vocab") else None  # an image processor checks nothing
        options = options_of(args, loss_options)  # the projectors' init follows args.seed unless given
        self.distill = loss if loss is not None else DistillationLoss(reader, model, tokenizer=tokenizer, **options)
        if loss is not None and tokenizer is not None:
            check_tokenizer(self.distill.reader, model, tokenizer)
        check_optimizer(kwargs.get("optimizers"), self.distill)
        self.heldout = self._heldout(eval_cache, kwargs.pop("eval_dataset", None), args)
        self._stream = (shuffle_block, prefetch, prefetch_mib)  # the stream's settings
        self._position, self._micro_step = DataPosition(), 0
        self._sums: dict[str, torch.Tensor] = {}  # each term's sum since the last log, on the device
        self._step_counts: deque[tuple[Counts, StepCounts]] = deque()  # the step's micro-batches not yet run
        self._count = 0
        self._exporting = False  # save_model called by the user, not by a checkpoint
        self._data = self._dataset(args)
        args.ignore_data_skip = True  # the stream resumes from its own position (see the class docstring)
        if args.deepspeed:
            model.add_module(LOSS_MODULE, self.distill)
        if args.max_steps <= 0:
            args.max_steps = max(1, math.ceil(args.num_train_epochs * self._data.steps_per_epoch
                                              / args.gradient_accumulation_steps))
        super().__init__(model=model, args=args, train_dataset=self._data, eval_dataset=self.heldout, **kwargs)
        self.distill.to(self.args.device)
        self.model_accepts_loss_kwargs = False  # the loss is ours: Trainer scales it for accumulation
        self.add_callback(_ZeroLossGrads(self.distill))

    def _heldout(self, eval_cache: CacheSource | None, eval_dataset: object, args: TrainingArguments
                 ) -> HeldOut | None:
        """The held-out cache (``eval_cache`` or ``eval_dataset``), checked against the training cache."""
        if eval_cache is not None and eval_dataset is not None:
            raise ApiError("both eval_cache and eval_dataset name a held-out cache; pass one of them")
        source = eval_cache if eval_cache is not None else eval_dataset
        if source is None:
            strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
            if strategy != "no":
                raise ApiError(f"eval_strategy {strategy!r} needs a held-out cache: pass eval_cache=PATH (a cache "
                               "the same teacher wrote with the same settings), or set eval_strategy='no'")
            return None
        label = "eval_cache" if eval_cache is not None else "eval_dataset"
        return HeldOut(_reader(source, label), self.distill.reader, self.distill.arrays,
                       batch_size=args.per_device_eval_batch_size, label=label)

    def _dataset(self, args: TrainingArguments) -> CacheDataset:
        return self.distill.dataset(batch_size=args.per_device_train_batch_size, seed=args.seed,
                                    rank=args.process_index, world_size=args.world_size, start=self._position,
                                    shuffle_block=self._stream[0], prefetch=self._stream[1],
                                    prefetch_mib=self._stream[2])

    # ---- data -----------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The cache's micro-batches from the current position; not prepared by accelerate, which would split
        them between ranks a second time (the dataset already takes this rank's share)."""
        self._data = self._dataset(self.args)
        return torch.utils.data.DataLoader(self._data, batch_size=None, num_workers=0)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return self._data.to_device(inputs, self.args.device)

    # ---- the step -------------------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch, dropout seeded from (seed, micro-step, rank) as ``kdcache train`` seeds it."""
        seed_dropout(self.args.seed, self._micro_step, self.args.process_index)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._position = self._data.position_after(inputs)
        self._micro_step += 1
        return loss

    def get_batch_samples(self, epoch_iterator: Iterator[dict[str, torch.Tensor]], num_batches: int,
                          *device: torch.device) -> tuple[list, torch.Tensor | int | None]:
        """``Trainer``'s micro-batches of one optimizer step; each term's rows are counted over them here (and over
        the ranks at the first forward), as ``num_items_in_batch`` counts labels, so that every term is
        normalised by its whole step's count (``step_norm``; ``kdcache train`` does the same)."""
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, *device)  # device: since 4.48
        counts = [term_counts(self.distill, batch) for batch in batches]
        step = StepCounts(counts)
        self._step_counts.extend((own, step) for own in counts)
        return batches, items

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """``DistillationLoss`` on the student's outputs, each term scaled to its share of the optimizer step
        (``Trainer`` divides by the accumulation steps itself); the terms of a training step are kept for the next
        log, where their mean is the step's per-row mean."""
        student = self.accelerator.unwrap_model(model)
        out = self.distill.student_outputs(student, inputs)
        counted = self._step_counts.popleft() if model.training and self._step_counts else None
        scales = None if counted is None else counted[1].scales(counted[0], self.args.world_size, self.args.device)
        terms = self.distill(out, inputs, scales)
        if model.training:
            for name, value in terms.items():
                if name != "loss":
                    self._sums[name] = self._sums.get(name, 0.0) + value.detach().float()
            self._count += 1
        return (terms["loss"], out) if return_outputs else terms["loss"]

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer``'s optimizer over the student, plus the projectors (and other loss parameters) as one group."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        params = [p for p in self.distill.parameters() if p.requires_grad]
        known = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if params and not known & {id(p) for p in params}:
            optimizer.add_param_group({"params": params, "weight_decay": self.args.weight_decay})
        return optimizer

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """Clip student and projector gradients together (DeepSpeed already clips every parameter it optimizes)."""
        if self.is_deepspeed_enabled:
            return super()._clip_grad_norm(model)
        params = [*model.parameters(), *self.distill.parameters()]
        return self.accelerator.clip_grad_norm_(params, self.args.max_grad_norm)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add each loss term's mean since the last log (over ranks too) to a training log, and the cache epoch."""
        if self.state.epoch is not None:
            used = self._data.steps_per_epoch * self._data.world_size * self._data.batch_size  # sequences an epoch
            self.state.epoch = self._position.epoch + self._position.sample_index / used
        if "loss" in logs and self._count:
            names = sorted(self._sums)
            values = torch.stack([self._sums[n] / self._count for n in names])
            if self.args.world_size > 1:
                values = self.accelerator.reduce(values, reduction="mean")
            logs.update(zip(names, (float(v) for v in values)))
            self._sums, self._count = {}, 0
        super().log(logs, start_time)

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset: object = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Every loss term and the agreement with the teacher on the held-out cache (``HeldOut.score``), named
        as ``Trainer`` names them (``eval_loss``, ``eval_topk_kl``, ``eval_top1_agreement``...), logged and handed
        to the callbacks (best checkpoint, early stopping). ``eval_dataset``: another held-out cache, this once."""
        heldout = self.heldout if eval_dataset is None else self._heldout(None, eval_dataset, self.args)
        if heldout is None:
            raise ApiError("evaluate(): no held-out cache; pass CacheTrainer(..., eval_cache=PATH), or "
                           "evaluate(eval_dataset=PATH), a cache the same teacher wrote with the same settings")
        start = time.time()
        scores = self._score(heldout)
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in scores.items()}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=int(scores["sequences"])))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _score(self, heldout: HeldOut) -> dict[str, float]:
        """``heldout.score`` with the student and the loss in eval mode, put back as they were."""
        student = self.accelerator.unwrap_model(self.model)
        modes = student.training, self.distill.training
        student.eval()
        self.distill.eval()
        try:
            return heldout.score(lambda batch: self.distill.student_outputs(student, batch), self.distill,
                                 lm=lm_kind(self.distill.facts), device=self.args.device)
        finally:
            student.train(modes[0])
            self.distill.train(modes[1])

    def predict(self, *args: object, **kwargs: object) -> NoReturn:
        """Refused: a cache holds targets, not inputs to predict on; ``evaluate`` scores a held-out cache."""
        raise ApiError("CacheTrainer.predict: a cache holds the teacher's targets, not inputs to predict on; use "
                       "evaluate() for a held-out cache, or call the student on your own inputs")

    # ---- saving and resuming --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The student as ``save_pretrained`` writes it, with ``projectors.pt`` beside it; a checkpoint (an
        internal call) also holds the stream position and the training arguments, an export neither."""
        self._exporting = not _internal_call
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._exporting = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The student as ``Trainer`` saves it, and beside it the projectors and (in a checkpoint) where the stream
        stands."""
        if self.is_deepspeed_enabled:  # the loss module rode inside the model: the student is saved without it
            whole = state_dict if state_dict is not None else cast(nn.Module, self.model).state_dict()
            state_dict = {k: v for k, v in whole.items() if LOSS_MODULE not in k.split(".")}
        super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        out = Path(output_dir or str(self.args.output_dir))
        # The run's record beside the student (kdcache train's layout): `kdcache eval --run` scores the folder.
        save_projectors(out, self.distill.projectors, self.distill.critics)
        write_plan(out, self.distill.plan.to_json())
        if self._exporting:  # a student's folder: Trainer._save wrote the arguments there unasked
            (out / TRAINING_ARGS_FILE).unlink(missing_ok=True)
            return
        state = {**resumable_state(self._position, self.args.world_size, self.args.per_device_train_batch_size,
                                   self.args.seed), "micro_step": self._micro_step}
        (out / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``; resuming also loads the projectors and the stream position of the checkpoint."""
        folder: str | None = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        if resume_from_checkpoint is True:
            folder = get_last_checkpoint(str(self.args.output_dir))
            if folder is None:
                raise ApiError(f"resume_from_checkpoint=True: no checkpoint in {self.args.output_dir!r}")
        if folder:
            self._load_state(Path(folder))
        self._step_counts.clear()  # an earlier call stopped inside a step: its counts are not this run's
        return super().train(resume_from_checkpoint=folder, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _load_state(self, folder: Path) -> None:
        missing = [name for name in (STATE_FILE, PROJECTORS_FILE) if not (folder / name).is_file()]
        if missing:
            raise ApiError(f"{folder} has no {' or '.join(missing)}; expected a checkpoint written by CacheTrainer")
        state = json.loads((folder / STATE_FILE).read_text())
        self._position = check_resumable(state, self.args.world_size, self.args.per_device_train_batch_size,
                                         self.args.seed)
        self._micro_step = int(state["micro_step"])
        self._load_projectors(folder)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's student, and its projectors with it."""
        super()._load_best_model()
        if self.state.best_model_checkpoint:
            self._load_projectors(Path(self.state.best_model_checkpoint))

    def _load_projectors(self, folder: Path) -> None:
        extras = read_projectors(folder)  # on the CPU: load_state_dict copies to the device
        self.distill.projectors.load_state_dict(extras["projectors"])
        critics = self.distill.critics
        if critics is not None and "critics" in extras:
            critics.load_state_dict(extras["critics"])


def _reader(source: object, label: str) -> CacheReader:
    """The open cache of ``source``: a folder or URL, an open ``CacheReader``, or a ``CacheDataset`` of one."""
    if isinstance(source, (str, os.PathLike)):
        return open_cache(os.fspath(source))
    if isinstance(source, CacheReader):
        return source
    if isinstance(source, CacheStream):
        return source.reader if isinstance(source, CacheDataset) else open_cache(source.cache)
    raise ApiError(f"{label}={type(source).__name__}: expected a cache: its folder or URL, kdcache.open_cache(path), "
                   "or a kdcache.CacheDataset of it")


def _training_source(cache: CacheSource | None, kwargs: dict[str, Any], args: TrainingArguments) -> object:
    """The training cache as given: ``cache``, or a ``train_dataset`` taken out of ``kwargs``; a dataset's batch size
    or seed that contradicts ``args`` (which set the stream) is refused."""
    if cache is not None and kwargs.get("train_dataset") is not None:
        raise ApiError("both cache and train_dataset name the training cache; pass one of them")
    source = cache if cache is not None else kwargs.pop("train_dataset", None)
    if not isinstance(source, CacheStream):
        return source
    problems = [f"{name} {mine} where TrainingArguments has {theirs}" for name, mine, theirs in
                (("batch_size", source.batch_size, args.per_device_train_batch_size), ("seed", source.seed, args.seed))
                if mine != theirs]
    if problems:
        raise ApiError(f"train_dataset: {'; '.join(problems)}; expected the same (TrainingArguments' "
                       "per_device_train_batch_size and seed decide the cache's batches and order)")
    return source
