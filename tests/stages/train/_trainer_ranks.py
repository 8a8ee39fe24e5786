"""One rank of ``CacheTrainer`` under ``torchrun`` (gloo on the CPU, DeepSpeed ZeRO-0 through ``TrainingArguments``),
for test_step_norm.py: ``python -m torch.distributed.run --nproc_per_node 2 _trainer_ranks.py CACHE STUDENT OUT
BATCH STEPS LR TERMS_JSON``. Rank 0 writes the logged steps and the weights to ``OUT/result.pt``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import TrainingArguments

import kdcache
from kdcache.stages.train.core.student import load_student


def main(cache: str, student: str, out: str, batch: str, steps: str, lr: str, terms: str) -> None:
    zero0 = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=int(batch), learning_rate=float(lr),
                             max_steps=int(steps), lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, deepspeed=zero0)
    trainer = kdcache.CacheTrainer(load_student(student, seed=0), args, cache, loss_options=json.loads(terms))
    trainer.train()
    if args.process_index == 0:
        weights = [*trainer.model.state_dict().items(), *trainer.distill.projectors.state_dict().items()]
        logged = [r for r in trainer.state.log_history if "loss" in r]
        torch.save({"logged": logged, "weights": torch.cat([v.double().flatten() for k, v in weights
                                                             if "kdcache_loss" not in k])}, Path(out) / "result.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
