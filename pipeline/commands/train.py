"""``kdcache train`` and ``kdcache init-student``: stage two, and building a student from teacher blocks.

Flags of ``train`` come from ``stages.train.options.TrainOptions``; every flag can also be set in the ``train:``
section of ``--config file.yaml``, the command line winning. torch, transformers and deepspeed are imported
inside ``run`` so ``kdcache --help`` stays fast.

``train`` runs as one process, or one per rank under ``torchrun`` / the ``deepspeed`` launcher.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kdcache.pipeline.commands import print_summary
from kdcache.pipeline.config import ConfigError, flag_name, from_args
from kdcache.pipeline.quiet import quiet
from kdcache.stages.train.options import TrainOptions


def register(subparsers: Any) -> None:
    """Add ``train`` and ``init-student`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "train", options=TrainOptions,
        help="train a student from a cache under DeepSpeed ZeRO (the teacher is never loaded)",
        description="Stream the cached teacher targets into a student and train it with the compound loss "
                    "alpha*CE + beta*KL + gamma*hidden + delta*attention under DeepSpeed. The cache and the "
                    "student are checked against each other first. Launch with torchrun or the deepspeed "
                    "launcher for several processes; --resume continues from the latest checkpoint in --out.")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)
    init = subparsers.add_parser(
        "init-student", help="build a shallower student by copying chosen teacher blocks",
        description="Copy the embeddings, the chosen blocks (1-based, as hidden_states numbers them) and the "
                    "head of a teacher into a new model folder. Run it once before `kdcache train`.")
    init.add_argument("--teacher", required=True, metavar="T", help="teacher model folder")
    init.add_argument("--layers", metavar="1,4,6", help="teacher blocks to keep, comma separated (both stacks "
                                                        "of an encoder-decoder)")
    init.add_argument("--encoder-layers", metavar="1,4", help="encoder-decoder teachers: encoder blocks to keep "
                                                              "(default --layers)")
    init.add_argument("--decoder-layers", metavar="2,4", help="encoder-decoder teachers: decoder blocks to keep "
                                                              "(default --layers)")
    init.add_argument("--out", required=True, metavar="S", help="folder for the new student")
    init.set_defaults(func=run_init_student)


def run(args: argparse.Namespace) -> int:
    """Build and validate the options, train, and print the summary on rank 0. Returns 0."""
    options = from_args(TrainOptions, args, section="train")
    from kdcache.stages.train.loop import run_training

    with quiet(options.run.quiet):  # also when the YAML, not the flag, asks for it
        print_summary(run_training(options), getattr(args, "json", False), format_summary)
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    """A few readable lines about a finished run."""
    first, last = summary.get("first_loss"), summary.get("last_loss")
    losses = f"loss {first:.4f} -> {last:.4f}" if first is not None and last is not None else "no loss logged"
    resumed = f" (resumed at step {summary['resumed_from']})" if summary.get("resumed_from") is not None else ""
    lines = [f"trained {summary['steps']} steps{resumed} on {summary['world_size']} process(es), "
             f"ZeRO-{summary['zero_stage']}, {summary['steps_per_s']:.2f} steps/s; {losses}",
             f"run dir     {summary['run_dir']} (metrics.jsonl, checkpoints/)"]
    if summary.get("student_dir"):
        lines.append(f"student     {summary['student_dir']} (loads with {_loader(summary['student_dir'])})")
    return "\n".join(lines)


def _loader(student_dir: str) -> str:
    """The class the exported student loads with, from its config (``BartForConditionalGeneration``...)."""
    from kdcache.storage.files import read_json_object

    archs = read_json_object(Path(student_dir) / "config.json").get("architectures") or []
    return f"{archs[0]}.from_pretrained" if archs else "transformers' from_pretrained"


def run_init_student(args: argparse.Namespace) -> int:
    """Parse ``--layers`` and copy the blocks; problems exit 2 through ConfigError / StudentError."""
    layers, encoder, decoder = (_block_list(args, name) for name in ("layers", "encoder_layers", "decoder_layers"))
    if not (layers or (encoder and decoder)):
        raise ConfigError(["--layers is required (or both --encoder-layers and --decoder-layers)"])
    if not os.path.isdir(args.teacher):
        raise ConfigError([f"--teacher {args.teacher!r} is not a model folder"])
    from kdcache.stages.train.init_student import init_student_from_teacher

    out = init_student_from_teacher(args.teacher, layers or [], args.out, encoder_layers=encoder,
                                    decoder_layers=decoder)
    print(f"student with teacher blocks {layers} written to {out}")
    return 0


def _block_list(args: argparse.Namespace, name: str) -> list[int] | None:
    """A comma-separated block list flag as ints (None when the flag is absent)."""
    value = getattr(args, name, None)
    if value is None:
        return None
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        flag = flag_name(name)
        raise ConfigError([f"{flag} {value!r}: expected comma-separated block numbers, e.g. 1,4,6"]) from None
