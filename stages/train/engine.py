"""DeepSpeed set-up: the process group, the engine's config, and the engine itself.

The process group comes from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), which torchrun and the deepspeed launcher both set; without a launcher we
make a world of one. gloo on the CPU, nccl on GPUs.

DeepSpeed loads with this module: only the training loop and the draft's trainer import it, never a light path
(``kdcache --help``, ``inspect``, ``verify``, the options).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from torch import nn
from torch.utils.cpp_extension import get_default_build_root

from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.optimizer_step import MAX_GRAD_NORM, train_optimizer, train_schedule
from kdcache.storage import KdcacheError


class EngineConfigError(KdcacheError):
    """The DeepSpeed config cannot be used (unreadable, or contradicting the run)."""


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device


def init_distributed() -> DistInfo:
    """Join (or create) the process group; idempotent, so tests can train several times in one process."""
    if "RANK" not in os.environ:  # no launcher: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as sock:  # a port free now, for the world of one to meet on
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    check_build_locks()
    if not dist.is_initialized():
        if not cuda:
            # Keep DeepSpeed from JIT-building its shared-memory allreduce op for a CPU process group. It builds it on
            # the first init_distributed of every environment (46 s with no output here, minutes when two
            # environments share ~/.cache/torch_extensions), and a build cut off at the wrong moment leaves a lock
            # that every later run waits on forever. Training reduces through gloo and never calls the op; marked
            # incompatible, DeepSpeed takes its plain path (deepspeed.comm.torch.build_shm_op returns None).
            deepspeed.ops.__compatible_ops__[SHM_OP] = False
        # DeepSpeed prints on stdout as it starts (an op it built, say): a terminal's stderr at most.
        with contextlib.redirect_stdout(sys.stderr if sys.stderr.isatty() else io.StringIO()):
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False,
                                       verbose=False)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), device)


SHM_OP = "deepspeed_shm_comm"
STALE_LOCK_S = 600.0  # a JIT build of a DeepSpeed op takes about a minute; a lock this old has lost its builder


def check_build_locks(root: Path | None = None, now: float | None = None) -> None:
    """Refuse to start where a JIT build's lock has outlived its builder: torch waits on it forever, silently.

    Raises:
        EngineConfigError: naming the lock's path, its age, and what to do.
    """
    # Where torch JIT-builds extensions (DeepSpeed's ops): TORCH_EXTENSIONS_DIR, else its default root (whose
    # folders are per Python and accelerator, py311_cpu/).
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) if root is None else root
    now = time.time() if now is None else now
    locks = sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]) if root.is_dir() else []
    ops = set(deepspeed.ops.__compatible_ops__)  # the ops this accelerator's DeepSpeed may JIT-build: its own list
    for lock in (found for found in locks if found.parent.name in ops):  # another project's: not ours
        age = now - lock.stat().st_mtime
        if age > STALE_LOCK_S:
            raise EngineConfigError(
                f"a build of DeepSpeed's {lock.parent.name} op left its lock {lock} {age / 60:.0f} min ago, and "
                f"torch would wait on it forever; if no other process is building that op, delete the lock "
                f"(rm {lock}) and run again")


def build_ds_config(options: TrainOptions, device: torch.device) -> dict[str, Any]:
    """The DeepSpeed config: the user's file (with "auto" and missing batch fields filled) or a built-in one.

    The built-in config names an optimizer only for CPU offload (DeepSpeed then uses its CPU Adam); otherwise
    the loop hands DeepSpeed a plain ``torch.optim.AdamW``, which works on every accelerator.
    """
    engine = options.engine
    if engine.deepspeed:
        return {**monitor_config(options), **_user_config(options)}  # the user's own monitor sections win
    precision = engine.precision
    if precision == "auto":  # bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU
        precision = "fp32" if device.type != "cuda" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    zero: dict[str, Any] = {"stage": engine.zero_stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": options.data.batch_size,
        "gradient_accumulation_steps": options.data.grad_accum,
        "gradient_clipping": MAX_GRAD_NORM,
        "steps_per_print": 1 << 30,  # our own logs replace DeepSpeed's
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
    }
    if engine.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": engine.lr, "weight_decay": engine.weight_decay}}
        config["zero_force_ds_cpu_optimizer"] = True
    return {**config, **monitor_config(options)}


def monitor_config(options: TrainOptions) -> dict[str, Any]:
    """DeepSpeed monitor sections for ``--report-to`` (its MonitorMaster writes them on rank 0)."""
    run = str(options.run.out)
    sections = {"tensorboard": ("tensorboard", {"output_path": run, "job_name": "tensorboard"}),
                "csv": ("csv_monitor", {"output_path": run, "job_name": "csv"}),
                "wandb": ("wandb", {"project": "kdcache", "group": Path(run).name})}
    wanted = options.run.report_to
    return {key: {"enabled": True, **values} for name, (key, values) in sections.items() if name in wanted}


def _user_config(options: TrainOptions) -> dict[str, Any]:
    try:
        with open(options.engine.deepspeed) as fh:  # type: ignore[arg-type]
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineConfigError(f"cannot read the DeepSpeed config {options.engine.deepspeed!r}: {exc}") from None
    for key, value in (("train_micro_batch_size_per_gpu", options.data.batch_size),
                       ("gradient_accumulation_steps", options.data.grad_accum)):
        if config.get(key, "auto") == "auto":
            config[key] = value
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]  # DeepSpeed derives it from the two above and the world size
    return config


def build_engine(model: nn.Module, options: TrainOptions, device: torch.device) -> DeepSpeedEngine:
    """``deepspeed.initialize`` the wrapper (student + projectors) with AdamW and a linear warm-up.

    Returns:
        The engine. Its micro-batch size and accumulation come from the config, which may be the user's.
    """
    config = build_ds_config(options, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else train_optimizer(params, lr=options.engine.lr,
                                                                    weight_decay=options.engine.weight_decay)
    scheduler = None if "scheduler" in config else lambda opt: train_schedule(opt, options.engine.warmup_steps)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=config)
    return engine
