"""What ``hf_trainer.CacheTrainer`` refuses of its arguments before it builds anything, because it would train
silently wrong: a parallel set-up its student's forward bypasses, an optimizer without the loss's parameters."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn
from transformers import TrainingArguments

from kdcache.stages.train.api import ApiError


def check_parallel(args: TrainingArguments) -> None:
    """Refuse what would train silently wrong: ZeRO-3 (projectors outside its partitions), several processes
    without DeepSpeed (the student's forward bypasses DDP's)."""
    config = args.deepspeed
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        config = json.loads(Path(config).read_text())
    stage = int(((config or {}).get("zero_optimization") or {}).get("stage", 0)) if isinstance(config, dict) else 0
    if stage >= 3:
        raise ApiError(f"deepspeed zero_optimization.stage {stage}: CacheTrainer supports ZeRO 0-2 (the projectors "
                       "train beside the student, outside ZeRO-3's partitions); use stage 2, or `kdcache train`")
    if getattr(args, "n_gpu", 1) > 1:
        raise ApiError(f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): CacheTrainer runs the student "
                       "outside that wrapper; start one process per GPU with DeepSpeed (TrainingArguments("
                       "deepspeed=...)), or make one GPU visible")
    if args.world_size > 1 and not args.deepspeed:
        raise ApiError(f"{args.world_size} processes without DeepSpeed: CacheTrainer runs the student outside DDP's "
                       "wrapper; pass TrainingArguments(deepspeed=...) (ZeRO 0-2)")


def check_optimizer(optimizers: object, loss: nn.Module) -> None:
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
