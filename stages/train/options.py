"""Options of stage two (``kdcache train``).

The field names are the YAML keys of the ``train:`` section and, with dashes, the CLI flags; the flags named in
issue 4 (``--cache --student --out --deepspeed --zero-stage --offload --layer-map --hidden-loss --alpha --beta
--gamma --delta --temperature --topk-kl --epochs --max-steps --lr --batch-size --grad-accum --seed --resume
--config``) are a contract. This module imports neither torch nor zarr/pyarrow (only the layer-map syntax and
the error types), so ``kdcache --help`` and config validation stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kdcache.stages.train.layer_maps import map_problems

HIDDEN_LOSSES = ("mse", "cosine", "cka", "cka_sqrt", "wgan")
TOPK_KL_VARIANTS = ("renorm", "other")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def _opt(help_text: str, **extra: object) -> dict[str, object]:
    return {"help": help_text, **extra}


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": None}  # tracker -> the package it needs


def tracker_problems(report_to: tuple[str, ...]) -> list[str]:
    """Unknown tracker names, and trackers whose package is not installed (naming the extra to install)."""
    import importlib.util

    problems = []
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            problems.append(f"report_to {name!r} is not a tracker; expected any of {sorted(TRACKERS)} or none")
        elif (package := TRACKERS[name]) and importlib.util.find_spec(package) is None:
            problems.append(f"report_to {name}: the {package} package is not installed; "
                            f"pip install \"kdcache[{name}]\"")
    return problems


@dataclass(frozen=True)
class TrainOptions:
    """Everything ``run_training`` needs; validated before any model or cache is opened."""

    # Read by pydantic when pipeline.config validates YAML values: `layers: [1, 3]` gives numbers for strings.
    __pydantic_config__ = {"coerce_numbers_to_str": True}

    cache: str = field(metadata=_opt("the cache directory written by `kdcache precompute`"))
    student: str = field(metadata=_opt(
        "a student: a HF model folder (pretrained weights) or a config.json / folder holding only a config "
        "(random init)"))
    out: str = field(metadata=_opt("the run directory: checkpoints, metrics.jsonl, the exported student"))
    deepspeed: str | None = field(default=None, metadata=_opt(
        "your own DeepSpeed ds_config.json (overrides --zero-stage/--offload/--precision)"))
    zero_stage: int = field(default=0, metadata=_opt("ZeRO stage (0-3) of the built-in DeepSpeed config"))
    offload: bool = field(default=False, metadata=_opt("offload optimizer states to the CPU (ZeRO >= 1)"))
    layer_map: str = field(default="uniform", metadata=_opt(
        "student-to-teacher hidden layer map: uniform|last (alias last-k)|reverse|all-to-one|random|none|"
        "explicit:1-2,2-4"))
    hidden_loss: str = field(default="mse", metadata=_opt("hidden-state loss", choices=list(HIDDEN_LOSSES)))
    alpha: float = field(default=1.0, metadata=_opt("weight of the CE term (causal shift)"))
    beta: float = field(default=1.0, metadata=_opt("weight of the logit KL term"))
    gamma: float = field(default=1.0, metadata=_opt("weight of the hidden-state term"))
    delta: float = field(default=0.0, metadata=_opt("weight of the attention KL term"))
    temperature: float = field(default=2.0, metadata=_opt("KD temperature T of the logit KL"))
    topk_kl: str = field(default="renorm", metadata=_opt("top-k KL variant for top-k caches",
                                                         choices=list(TOPK_KL_VARIANTS)))
    epochs: int | None = field(default=None, metadata=_opt("passes over the cache (default 1 if no --max-steps)"))
    max_steps: int | None = field(default=None, metadata=_opt("optimizer steps to run (wins over --epochs)"))
    lr: float = field(default=1e-4, metadata=_opt("AdamW learning rate"))
    weight_decay: float = field(default=0.0, metadata=_opt("AdamW weight decay"))
    warmup_steps: int = field(default=0, metadata=_opt("linear LR warm-up steps"))
    batch_size: int = field(default=8, metadata=_opt("sequences per micro-batch per rank"))
    grad_accum: int = field(default=1, metadata=_opt("micro-batches accumulated per optimizer step"))
    seed: int = field(default=0, metadata=_opt("seed of the data order, init and dropout"))
    resume: bool = field(default=False, metadata=_opt("continue from the latest checkpoint in --out"))
    config: str | None = field(default=None, metadata=_opt("YAML file; its `train:` section gives defaults"))
    attention_layers: str | None = field(default=None, metadata=_opt(
        "student-to-teacher attention map for the delta term, same syntax as --layer-map "
        "(default: the hidden map restricted to the cache's attention layers)"))
    precision: str = field(default="auto", metadata=_opt(
        "auto = bf16 on GPUs that support it, else fp16 on GPU, fp32 on CPU", choices=list(PRECISIONS)))
    gradient_checkpointing: bool = field(default=False, metadata=_opt("recompute student activations"))
    log_every: int = field(default=10, metadata=_opt(
        "write metrics.jsonl (and trackers, and a progress line when the output is not a terminal) every N "
        "optimizer steps"))
    report_to: tuple[str, ...] = field(default=(), metadata=_opt(
        "trackers beside metrics.jsonl, through DeepSpeed's monitor: tensorboard, wandb, csv (comma-separated; "
        "none by default); they write under RUN/ (wandb: its own project 'kdcache')"))
    quiet: bool = field(default=False, metadata=_opt("no progress bar or progress lines"))
    save_every: int = field(default=0, metadata=_opt("checkpoint every N optimizer steps (0: only at the end)"))
    num_workers: int = field(default=0, metadata=_opt("DataLoader worker processes (decoding already runs "
                                                      "in threads; 0 is usually right)"))
    prefetch: int = field(default=4, metadata=_opt("micro-batches decoded ahead of the step"))
    decode_threads: int = field(default=0, metadata=_opt(
        "threads decoding cached arrays (arrays of a shard decode in parallel); 0 = one per core of the host"))
    shuffle_block: int = field(default=256, metadata=_opt(
        "sequences shuffled together after the shard shuffle; every shard a block touches stays decoded in host "
        "memory until the block is done, so lower it for long sequences or wide caches"))
    critic_steps: int = field(default=1, metadata=_opt("wgan: critic updates per student step"))
    critic_lr: float = field(default=1e-4, metadata=_opt("wgan: critic learning rate"))
    trace_samples: bool = field(default=False, metadata=_opt(
        "record the sequence ids and loss of every micro-step in RUN/samples-rank{r}.jsonl"))
    export: bool = field(default=True, metadata=_opt("save the student with save_pretrained at the end"))
    allow_partial: bool = field(default=False, metadata=_opt("train on a partial cache (missing shards)"))
    # Encoder-decoder students (per-stream maps, stages.train.plan). Not Optional: the config reads "none" as null,
    # and "none" is a map here. Empty means "use --layer-map".
    encoder_layer_map: str = field(default="", metadata=_opt(
        "encoder-decoder: encoder student-to-teacher map, same syntax as --layer-map (default: --layer-map)"))
    decoder_layer_map: str = field(default="", metadata=_opt(
        "encoder-decoder: decoder student-to-teacher map (default: --layer-map)"))
    cross_attention_map: str = field(default="", metadata=_opt(
        "encoder-decoder: decoder-block map of the cross-attention KL (weight --delta; default: the decoder map "
        "restricted to the cached cross-attention blocks; none = no cross-attention term)"))

    def validate(self) -> list[str]:
        """Checks across fields and against the disk; returns every problem found."""
        problems: list[str] = []
        for name in ("batch_size", "grad_accum", "log_every", "prefetch", "shuffle_block", "critic_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        problems += tracker_problems(self.report_to)
        if self.decode_threads < 0:
            problems.append(f"decode_threads must be >= 0 (0 = one per core), got {self.decode_threads}")
        for name in ("epochs", "max_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        for name in ("alpha", "beta", "gamma", "delta", "weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.temperature <= 0:
            problems.append(f"temperature must be > 0, got {self.temperature}")
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if self.save_every < 0 or self.num_workers < 0 or self.warmup_steps < 0:
            problems.append("save_every, num_workers and warmup_steps must be >= 0")
        problems += map_problems("layer_map", self.layer_map)
        for key in ("encoder_layer_map", "decoder_layer_map", "cross_attention_map"):
            if getattr(self, key):
                problems += map_problems(key, getattr(self, key))
        if self.attention_layers is not None:
            problems += map_problems("attention_layers", self.attention_layers)
        if self.offload and self.zero_stage == 0 and self.deepspeed is None:
            problems.append("offload needs --zero-stage 1, 2 or 3 (ZeRO 0 has no optimizer offload)")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            problems.append(f"deepspeed config {self.deepspeed!r} does not exist")
        if not Path(self.student).exists():
            problems.append(f"student {self.student!r} does not exist (a model folder or a config.json)")
        return problems

    def to_dict(self) -> dict[str, object]:
        """Plain dict, written to RUN/options.json."""
        return dataclasses.asdict(self)
