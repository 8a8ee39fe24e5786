"""``kdcache run --config pipeline.yaml``: stage one, then stage two, from one YAML file.

The file has a ``precompute:`` section (``PrecomputeOptions``) and a ``train:`` section (``TrainOptions``);
``train.cache`` defaults to ``precompute.out``. Both sections are validated — every problem listed at once —
before any model loads. A complete cache whose fingerprints match the precompute section is reused, never
recomputed (stage one finds every shard committed and does not load the teacher).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.cli.commands.train import format_summary as format_train
from kdcache.pipeline.config import SECTIONS, ConfigError, build, flat_values, load_yaml
from kdcache.stages import precompute, train as stage_two
from kdcache.stages.precompute import PrecomputeOptions
from kdcache.stages.train import TrainOptions


def register(subparsers: Subcommands) -> None:
    """Add ``run`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "run", help="run both stages from one YAML file (reusing a matching complete cache)",
        description="Run stage one (precompute) and stage two (train) as configured in a YAML file with "
                    "'precompute:' and 'train:' sections; their keys are the flags of `kdcache precompute` and "
                    "`kdcache train` (dashes or underscores). train.cache defaults to precompute.out. A complete "
                    "cache with matching fingerprints is reused.")
    parser.add_argument("--config", required=True, metavar="FILE", help="the pipeline YAML file")
    parser.set_defaults(func=run)


def load_pipeline(path: str) -> tuple[PrecomputeOptions, TrainOptions]:
    """Both stages' options from one file, with every problem of both sections in one ConfigError."""
    data = load_yaml(path)
    if data and not any(key in SECTIONS for key in data):  # a flat file: whose is `out`, the cache or the run?
        raise ConfigError([f"{path} has no sections: `kdcache run` reads a 'precompute:' and a 'train:' section "
                           f"(out is the cache in one and the run folder in the other); its top-level keys "
                           f"{', '.join(map(str, data))} suit `kdcache precompute --config` or `kdcache train "
                           f"--config`, which read a flat file"])
    problems = [f"unknown section {key!r}; expected {', '.join(SECTIONS)}" for key in data if key not in SECTIONS]
    sections = {}
    for name in SECTIONS:
        section = data.get(name)
        if not isinstance(section, dict):
            problems.append(f"section {name!r} is missing or not a mapping")
            section = {}
        sections[name] = section
    built: dict[str, Any] = {}
    train_values = {"cache": flat_values(PrecomputeOptions, sections["precompute"]).get("out"), **sections["train"]}
    for name, cls, values in (("precompute", PrecomputeOptions, sections["precompute"]),
                              ("train", TrainOptions, train_values)):
        try:
            built[name] = build(cls, values, where=f"{name}.")
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return built["precompute"], built["train"]


def run(args: argparse.Namespace) -> int:
    """Validate both sections, precompute (or reuse), release the teacher, then train. Returns 0."""
    pre, train = load_pipeline(args.config)
    summary = precompute.run_precompute(pre)
    if precompute.reused_cache(summary):
        print(f"reusing the complete cache at {pre.storage.out}: its fingerprints match, nothing was recomputed")
    else:
        print(precompute.format_summary(summary))
    gc.collect()  # the teacher's last references go with stage one's frames; free them before the student
    _empty_device_cache()
    print(format_train(stage_two.run_training(train)))
    return 0


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
