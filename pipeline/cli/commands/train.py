"""``kdcache train`` and ``kdcache init-student``: stage two, and building a student from teacher blocks.

Flags of ``train`` come from ``stages.train.core.options.TrainOptions``, and from ``--config`` as ``pipeline.config``
reads it. torch, transformers and deepspeed are imported inside ``run`` so ``kdcache --help`` stays fast.

``train`` runs as one process, or one per rank under ``torchrun`` / the ``deepspeed`` launcher.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kdcache import stages, storage
from kdcache.pipeline.cli.commands import Subcommands, print_summary
from kdcache.pipeline.config import ConfigError, from_args
from kdcache.pipeline.quiet import quiet
from kdcache.stages.common.stream_options import StreamLayers, alias_flags, fold_aliases
from kdcache.stages.train.core.options import TrainOptions


def register(subparsers: Subcommands) -> None:
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
    init.add_argument("--layers", nargs="+", metavar="[STREAM:]1,4,6",
                      help="teacher blocks to keep, comma separated (both stacks of an encoder-decoder, or each "
                           "apart: encoder:1,4 decoder:2,4)")
    alias_flags(init, ["layers"])  # --encoder-layers / --decoder-layers, with a note naming --layers STACK:...
    init.add_argument("--out", required=True, metavar="S", help="folder for the new student")
    init.set_defaults(func=run_init_student)


def run(args: argparse.Namespace) -> int:
    """Build and validate the options, train, and print the summary on rank 0. Returns 0."""
    if getattr(args, "init_from", None) and not getattr(args, "student", None):
        args.student = str(Path(args.init_from) / "student")  # --init-from RUN starts from RUN's exported student
    options = from_args(TrainOptions, args, section="train")
    with quiet(options.run.quiet):  # also when the YAML, not the flag, asks for it
        print_summary(stages.run_training(options), getattr(args, "json", False), format_summary)
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    """A few readable lines about a finished run."""
    first, last = summary.get("first_loss"), summary.get("last_loss")
    losses = f"loss {first:.4f} -> {last:.4f}" if first is not None and last is not None else "no loss logged"
    resumed = f" (resumed at step {summary['resumed_from']})" if summary.get("resumed_from") is not None else ""
    lines = [f"trained {summary['steps']} steps{resumed} on {summary['world_size']} process(es), "
             f"ZeRO-{summary['zero_stage']}, {summary['steps_per_s']:.2f} steps/s; {losses}",
             f"run dir     {summary['run_dir']} (metrics.jsonl, checkpoints/)"]
    if summary.get("student_dir"):  # the class it loads with, from its config (``BartForConditionalGeneration``)
        archs = storage.read_json_object(Path(summary["student_dir"]) / "config.json").get("architectures") or []
        loader = f"{archs[0]}.from_pretrained" if archs else "transformers' from_pretrained"
        lines.append(f"student     {summary['student_dir']} (loads with {loader})")
    return "\n".join(lines)


def run_init_student(args: argparse.Namespace) -> int:
    """Parse ``--layers`` and copy the blocks; problems exit 2 through ConfigError / StudentError."""
    given = {k: v for k, v in vars(args).items() if k in ("layers", "encoder_layers", "decoder_layers")}
    values, problems = fold_aliases(given, {"layers": StreamLayers})
    try:
        stacks = StreamLayers.parse(values["layers"]) if "layers" in values else StreamLayers()
    except ValueError as exc:
        problems.append(f"--layers {values['layers']!r}: {exc}")
    if problems:
        raise ConfigError(problems)
    layers, encoder, decoder = (_block_list(stacks, name) for name in ("", "encoder", "decoder"))
    if not (layers or (encoder and decoder)):
        raise ConfigError(["--layers is required (or both stacks: --layers encoder:BLOCKS decoder:BLOCKS)"])
    if not os.path.isdir(args.teacher):
        raise ConfigError([f"--teacher {args.teacher!r} is not a model folder"])
    out = stages.init_student_from_teacher(args.teacher, layers or [], args.out, encoder_layers=encoder,
                                           decoder_layers=decoder)
    print(f"student with teacher blocks {layers} written to {out}")
    return 0


def _block_list(stacks: StreamLayers, stream: str) -> list[int] | None:
    """One stack's blocks of ``--layers`` as ints (None when not given)."""
    value = stacks.get(stream)
    if value is None:
        return None
    try:
        return [int(v) for v in value]
    except ValueError:
        flag = f"--layers {stream}:" if stream else "--layers "
        raise ConfigError([f"{flag}{stacks.text_of(stream)!r}: expected comma-separated block numbers, e.g. "
                           f"1,4,6"]) from None
