"""``CacheTrainer``: a ``transformers.Trainer`` that trains a student from a kdcache cache instead of a teacher.

Everything kdcache-specific is the same code ``kdcache train`` runs (``api``): the batches and their order
(``CacheDataset``), the student's forward (``StudentRunner``) and the loss (``DistillationLoss``); what stays
``Trainer``'s is the optimizer, scheduler, mixed precision, DeepSpeed, callbacks, ``report_to`` and checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from kdcache.stages.train.api import ApiError, CacheDataset, DistillationLoss, seed_dropout
from kdcache.stages.train.checkpoint import PROJECTORS_FILE, save_projectors, write_plan
from kdcache.stages.train.core import open_cache
from kdcache.stages.train.feed import DataPosition, check_resumable
from kdcache.stages.train.objective import StepCounts, term_counts

if TYPE_CHECKING:
    from kdcache.stages.train.objective import Counts
    from kdcache.storage import CacheReader

STATE_FILE = "kdcache_state.json"  # beside each checkpoint's weights: the stream position and the micro-step
# The cache decides the first three; evaluation through Trainer would batch a CacheDataset a second time and run the
# student on a cache batch as if it were model inputs (see the class docstring).
REFUSED = ("train_dataset", "data_collator", "compute_loss_func", "eval_dataset")
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
      target because the student's ``forward`` does not name them. ``train_dataset``, ``data_collator`` and
      ``compute_loss_func`` are refused for that reason.
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
    * **Evaluation.** Not through ``Trainer``: an ``eval_dataset``, an ``eval_strategy`` other than ``"no"`` and
      ``evaluate()`` are refused (its loop would batch a ``CacheDataset`` a second time and call the student on a
      cache batch). Score the saved student with ``kdcache eval --cache HELDOUT``, or take the loss terms on a
      held-out cache as ``DistillationLoss`` over its ``CacheDataset``, in eval mode.
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
        cache: a cache folder or URL, or an open ``CacheReader``.
        loss: a ``DistillationLoss`` built for ``model``; default: one built from ``loss_options``.
        loss_options: ``DistillationLoss``'s keyword options (``gamma``, ``layer_map``...; ``seed`` defaults to
            ``args.seed``).
        shuffle_block, prefetch: the stream's settings (``kdcache train``'s ``--shuffle-block``, ``--prefetch``).
        **kwargs: the rest of ``Trainer``'s arguments (callbacks, ``processing_class``, ``optimizers``...).
    """

    def __init__(self, model: nn.Module, args: TrainingArguments, cache: str | os.PathLike[str] | CacheReader, *,
                 loss: DistillationLoss | None = None,
                 loss_options: dict[str, Any] | None = None, shuffle_block: int = 256, prefetch: int = 4,
                 **kwargs: Any):
        given = sorted(set(kwargs) & set(REFUSED))
        if given:
            raise ApiError(f"CacheTrainer takes its {', '.join(given)} from the cache; leave them out")
        args = copy.copy(args)  # ignore_data_skip and max_steps are set below: the caller's arguments stay theirs
        _check_parallel(args)
        reader = open_cache(os.fspath(cache)) if isinstance(cache, (str, os.PathLike)) else cache
        options = {"seed": args.seed, **(loss_options or {})}  # the projectors' init follows the run's seed
        self.distill = loss if loss is not None else DistillationLoss(reader, model, **options)
        _check_optimizer(kwargs.get("optimizers"), self.distill)
        self._stream_options = {"shuffle_block": shuffle_block, "prefetch": prefetch}
        self._position, self._micro_step = DataPosition(), 0
        self._sums: dict[str, torch.Tensor] = {}  # each term's sum since the last log, on the device
        self._step_counts: deque[tuple[Counts, StepCounts]] = deque()  # the step's micro-batches not yet run
        self._count = 0
        self._data = self._dataset(args)
        args.ignore_data_skip = True  # the stream resumes from its own position (see the class docstring)
        if args.deepspeed:
            model.add_module(LOSS_MODULE, self.distill)
        if args.max_steps <= 0:
            args.max_steps = max(1, math.ceil(args.num_train_epochs * self._data.steps_per_epoch
                                              / args.gradient_accumulation_steps))
        super().__init__(model=model, args=args, train_dataset=self._data, **kwargs)
        self.distill.to(self.args.device)
        self.model_accepts_loss_kwargs = False  # the loss is ours: Trainer scales it for accumulation
        self.add_callback(_ZeroLossGrads(self.distill))

    def _dataset(self, args: TrainingArguments) -> CacheDataset:
        return self.distill.dataset(batch_size=args.per_device_train_batch_size, seed=args.seed,
                                    rank=args.process_index, world_size=args.world_size, start=self._position,
                                    **self._stream_options)

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
        counts = [term_counts(self.distill.criterion, batch) for batch in batches]
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

    def evaluate(self, *args: object, **kwargs: object) -> dict[str, float]:
        """Refused: see the class docstring's Evaluation."""
        raise ApiError("CacheTrainer does not evaluate through Trainer.evaluate; score the saved student with "
                       "`kdcache eval --cache HELDOUT --run RUN --student STUDENT`, or run DistillationLoss over a "
                       "held-out cache's CacheDataset in eval mode")

    # ---- saving and resuming --------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The student as ``Trainer`` saves it, and beside it the projectors and where the stream stands."""
        if self.is_deepspeed_enabled:  # the loss module rode inside the model: the student is saved without it
            whole = state_dict if state_dict is not None else cast(nn.Module, self.model).state_dict()
            state_dict = {k: v for k, v in whole.items() if LOSS_MODULE not in k.split(".")}
        super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        out = Path(output_dir or str(self.args.output_dir))
        # The run's record beside the student (kdcache train's layout): `kdcache eval --run` scores the folder.
        save_projectors(out, self.distill.projectors, self.distill.criterion.critics)
        write_plan(out, self.distill.plan.to_json())
        state = {**self._position.to_dict(), "micro_step": self._micro_step, "seed": self.args.seed,
                 "world_size": self.args.world_size, "batch_size": self.args.per_device_train_batch_size}
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
        extras = torch.load(folder / PROJECTORS_FILE, map_location="cpu")  # load_state_dict copies to the device
        self.distill.projectors.load_state_dict(extras["projectors"])
        critics = self.distill.criterion.critics
        if critics is not None and "critics" in extras:
            critics.load_state_dict(extras["critics"])


def _check_parallel(args: TrainingArguments) -> None:
    """Refuse what would train silently wrong: ZeRO-3 (projectors outside its partitions), several processes
    without DeepSpeed (the student's forward bypasses DDP's)."""
    config = args.deepspeed
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        config = json.loads(Path(config).read_text())
    stage = int(((config or {}).get("zero_optimization") or {}).get("stage", 0)) if isinstance(config, dict) else 0
    if stage >= 3:
        raise ApiError(f"deepspeed zero_optimization.stage {stage}: CacheTrainer supports ZeRO 0-2 (the projectors "
                       "train beside the student, outside ZeRO-3's partitions); use stage 2, or `kdcache train`")
    strategy = str(getattr(getattr(args, "eval_strategy", "no"), "value", getattr(args, "eval_strategy", "no")))
    if strategy != "no":
        raise ApiError(f"eval_strategy {strategy!r}: CacheTrainer does not evaluate through Trainer (see its "
                       "docstring); set eval_strategy='no' and score the saved student with `kdcache eval`")
    if getattr(args, "n_gpu", 1) > 1:
        raise ApiError(f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): CacheTrainer runs the student "
                       "outside that wrapper; start one process per GPU with DeepSpeed (TrainingArguments("
                       "deepspeed=...)), or make one GPU visible")
    if args.world_size > 1 and not args.deepspeed:
        raise ApiError(f"{args.world_size} processes without DeepSpeed: CacheTrainer runs the student outside DDP's "
                       "wrapper; pass TrainingArguments(deepspeed=...) (ZeRO 0-2)")


def _check_optimizer(optimizers: object, loss: nn.Module) -> None:
    """Refuse an optimizer of the caller's that lacks the loss's trainable parameters (the projectors would stay
    as initialised); ``create_optimizer`` adds them to ``Trainer``'s own."""
    optimizer = optimizers[0] if isinstance(optimizers, (tuple, list)) and optimizers else None
    wanted = {id(p) for p in loss.parameters() if p.requires_grad}
    if optimizer is None or not wanted:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not wanted <= held:
        raise ApiError("optimizers=(optimizer, ...): the optimizer must hold the loss's parameters too (the "
                       "projectors); build DistillationLoss first, pass it as loss=, and give the optimizer "
                       "[*student.parameters(), *loss.parameters()]")
