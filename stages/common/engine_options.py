"""``EngineOptions``: how a stage runs its model, one class for both stages.

Stage one runs the teacher's forward pass (``teacher``, ``device``, ``batch_size``...); stage two runs the
student under DeepSpeed (``zero_stage``, ``lr``...). Each field names the stage that uses it
(``metadata["stage"]``) and each stage's options declare theirs on the group (``engine: EngineOptions =
field(metadata={"stage": "train"})``): ``stages.common.option_groups.leaves`` then lists only that stage's
fields, so flags, YAML keys and ``RUN/options.json`` are what they were and option names stay unique within a
stage (``batch_size`` and ``seed`` here are stage one's; stage two keeps its own in ``DataOptions``).

A field with ``metadata["required"]`` must be given when its stage uses it (``--teacher``); its default only
stands in for the stage that does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

PRECOMPUTE, TRAIN = "precompute", "train"
# A hub id is "name" or "org/name"; anything else that names no existing file is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_PARALLEL = re.compile(r"^(none|tp:[1-9]\d*|layers:[1-9]\d*)$")
_MEMORY = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
T = TypeVar("T")


def _opt(default: T, stage: str, help_text: str, **meta: object) -> T:
    return field(default=default, metadata={"help": help_text, "stage": stage, **meta})


@dataclass(frozen=True)
class EngineOptions:
    """The teacher and how it runs (stage one); DeepSpeed and the optimizer (stage two)."""

    teacher: str = _opt("", PRECOMPUTE, "teacher: a local folder or a hub id", required=True)
    revision: str | None = _opt(None, PRECOMPUTE, "hub revision of the teacher")
    teacher_dtype: str = _opt("auto", PRECOMPUTE, "dtype the teacher runs in (auto: the checkpoint's, fp32 on cpu)",
                              choices=["auto", "fp32", "fp16", "bf16"])
    device: str = _opt("auto", PRECOMPUTE, "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    batch_size: int = _opt(32, PRECOMPUTE, "sequences per forward pass")
    logits_chunk: int = _opt(512, PRECOMPUTE, "valid tokens per pass through the LM head for top-k logits, which "
                                              "bounds the teacher's memory for logits by chunk x vocab; 0 = the "
                                              "whole batch at once")
    seed: int = _opt(0, PRECOMPUTE, "torch seed (the teacher runs in eval mode; this pins anything stochastic)")
    queue_size: int = _opt(2, PRECOMPUTE, "computed shards that may wait for a writer thread; host memory holds at "
                                          "most queue-size + writers shards beside the one being computed, and "
                                          "on a GPU two batches in pinned memory on their way to the host")
    writers: int = _opt(0, PRECOMPUTE, "threads that encode, compress and write shards side by side (0: half the "
                                       "host's cores, 1 to 8)")
    writer_processes: bool = _opt(False, PRECOMPUTE, "write shards in --writers worker processes fed through shared "
                                  "memory instead of threads, so that no thread of ours holds the teacher process's "
                                  "GIL while it launches kernels (each shard in flight takes its size in /dev/shm)")
    compile_teacher: bool = _opt(False, PRECOMPUTE, "run the teacher's forward through torch.compile (inductor: fused "
                                 "kernels, fewer launches; decoder-only and encoder teachers); each batch shape "
                                 "compiles once (seconds to a minute), so it pays on a GPU over many batches of "
                                 "one shape (--packing concat); on a CPU the eager forward is faster (a note says "
                                 "so); where compiling fails, a line says why and it runs eagerly")
    progress: bool = _opt(True, PRECOMPUTE, "show a progress bar on rank 0")
    estimate: bool = _opt(False, PRECOMPUTE, "write no cache: print the rows and tokens, the bytes per token of each "
                                             "target (a short timed sample of the teacher, compressed with the real "
                                             "codecs), the total size and time, and whether the destination has "
                                             "room")
    teacher_parallel: str = _opt("none", PRECOMPUTE, "a teacher larger than one device: tp:N (transformers' tensor "
                                 "parallelism over N torchrun ranks; W ranks make W/N data-parallel groups) or "
                                 "layers:N (layer-wise placement over N GPUs per process); none: the whole "
                                 "teacher on each rank's device")
    device_memory: str | None = _opt(None, PRECOMPUTE, "memory of one device for the --teacher-parallel check, "
                                     "e.g. 80GB (default: the GPU's own; the host's memory per process on a CPU)")
    deepspeed: str | None = _opt(None, TRAIN, "your own DeepSpeed ds_config.json (overrides "
                                              "--zero-stage/--offload/--precision)")
    zero_stage: int = _opt(0, TRAIN, "ZeRO stage of the built-in DeepSpeed config", choices=[0, 1, 2, 3])
    offload: bool = _opt(False, TRAIN, "offload optimizer states to the CPU (ZeRO >= 1)")
    precision: str = _opt("auto", TRAIN, "auto = bf16 on GPUs that support it, else fp16 on GPU, fp32 on CPU",
                          choices=list(PRECISIONS))
    vocab_kernel: str = _opt("auto", TRAIN, "road of the vocabulary losses on a CUDA device: auto (the fused Triton "
                             "kernel, checked against the pure-torch pass on its first chunk; where it fails, a line "
                             "says so and the pure-torch pass runs), fused (the same, but a failure stops the run), "
                             "torch (never the kernel)", choices=["auto", "fused", "torch"])
    gradient_checkpointing: bool = _opt(False, TRAIN, "recompute student activations")
    lr: float = _opt(1e-4, TRAIN, "AdamW learning rate")
    weight_decay: float = _opt(0.0, TRAIN, "AdamW weight decay")
    warmup_steps: int = _opt(0, TRAIN, "linear LR warm-up steps")

    def validate(self) -> list[str]:
        """Every problem of this group (a stage's unused fields hold their defaults, which pass)."""
        return self._teacher_side() + self._deepspeed_side()

    def _teacher_side(self) -> list[str]:
        checks = [("batch_size", self.batch_size >= 1, "must be >= 1"),
                  ("queue_size", self.queue_size >= 1, "must be >= 1"),
                  ("writers", self.writers >= 0, "must be >= 0 (0: half the host's cores)"),
                  ("logits_chunk", self.logits_chunk >= 0, "must be >= 0"),
                  ("device", bool(_DEVICE.match(self.device)), "expected auto, cpu, mps, cuda or cuda:N"),
                  ("teacher_parallel", bool(_PARALLEL.match(self.teacher_parallel)),
                   "expected none, tp:N or layers:N with N >= 1"),
                  ("device_memory", self.device_memory is None or bool(_MEMORY.match(self.device_memory)),
                   "expected a size such as 80GB, 24GiB or 512MB")]
        return teacher_problems(self.teacher) + failed(self, checks)

    def _deepspeed_side(self) -> list[str]:
        problems = [f"{name} must be >= 0, got {getattr(self, name)}"
                    for name in ("weight_decay", "warmup_steps") if getattr(self, name) < 0]
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if self.offload and self.zero_stage == 0 and self.deepspeed is None:
            problems.append("offload needs --zero-stage 1, 2 or 3 (ZeRO 0 has no optimizer offload)")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            problems.append(f"deepspeed config {self.deepspeed!r} does not exist")
        return problems


def failed(group: object, checks: list[tuple[str, bool, str]]) -> list[str]:
    """``name: got VALUE, RULE`` for each (name, passed, rule) that did not pass."""
    return [f"{name}: got {getattr(group, name)!r}, {rule}" for name, ok, rule in checks if not ok]


def looks_like_path(value: str, *, data: bool = False, data_extensions: tuple[str, ...] = ()) -> bool:
    """True when ``value`` can only be a local path, never a hub id ("name" or "org/name").

    Args:
        value: the teacher or data string.
        data: also count a data-file extension (one of ``data_extensions``, e.g. ``train.jsonl``) as a path.
        data_extensions: lower-case suffixes with their dot.
    """
    if value.startswith(("/", ".", "~")) or not _HUB_ID.match(value):
        return True
    return data and Path(value).suffix.lower() in data_extensions


def teacher_problems(teacher: str) -> list[str]:
    """What is wrong with ``--teacher`` before anything loads (nothing when empty: a missing teacher is reported
    as a required option)."""
    if not teacher:
        return []
    path = Path(teacher).expanduser()
    if path.exists():
        if not path.is_dir():
            return [f"teacher: {teacher!r} is a file; expected a model folder (with config.json) or a hub id"]
        if not (path / "config.json").is_file():
            return [f"teacher: folder {teacher!r} has no config.json; is it a saved Hugging Face model?"]
        return []
    if looks_like_path(teacher):
        return [f"teacher: path {teacher!r} does not exist"]
    return []
