"""``kdcache run --config pipeline.yaml``: stage one, then stage two, from one YAML file.

The file has a ``precompute:`` section (``PrecomputeOptions``), or a ``generate:`` section (``GenerateOptions``:
the teacher's own responses, cached as it writes them), and a ``train:`` section (``TrainOptions``);
``train.cache`` defaults to stage one's ``out``. Both sections are validated — every problem listed at once —
before any model loads. A complete cache whose fingerprints match the precompute section is reused, never
recomputed (stage one finds every shard committed and does not load the teacher).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from kdcache import stages
from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.cli.commands.train import format_summary as format_train
from kdcache.pipeline.config import SECTIONS, ConfigError, build, flat_values, load_yaml
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.generation.options import GenerateOptions
from kdcache.stages.train.core.options import TrainOptions


def register(subparsers: Subcommands) -> None:
    """Add ``run`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "run", help="run both stages from one YAML file (reusing a matching complete cache)",
        description="Run stage one (precompute, or generate) and stage two (train) as configured in a YAML file "
                    "with 'precompute:' (or 'generate:') and 'train:' sections; their keys are the flags of "
                    "`kdcache precompute` (`kdcache generate`) and `kdcache train` (dashes or underscores). "
                    "train.cache defaults to stage one's out. A complete cache with matching fingerprints is "
                    "reused.")
    parser.add_argument("--config", required=True, metavar="FILE", help="the pipeline YAML file")
    parser.set_defaults(func=run)


def load_pipeline(path: str) -> tuple[PrecomputeOptions | GenerateOptions, TrainOptions]:
    """Both stages' options from one file (stage one from its ``precompute:`` or ``generate:`` section), with every
    problem of both sections in one ConfigError."""
    data = load_yaml(path)
    if data and not any(key in SECTIONS for key in data):  # a flat file: whose is `out`, the cache or the run?
        raise ConfigError([f"{path} has no sections: `kdcache run` reads a 'precompute:' and a 'train:' section "
                           f"(or 'generate:' for 'precompute:'; out is the cache in one and the run folder in the "
                           f"other); its top-level keys {', '.join(map(str, data))} suit `kdcache precompute "
                           f"--config` or `kdcache train --config`, which read a flat file"])
    problems = [f"unknown section {key!r}; expected {', '.join(SECTIONS)}" for key in data if key not in SECTIONS]
    # The sections of stage one, of which a pipeline file holds one: the user's text, or the teacher's own responses.
    given = [name for name in ("precompute", "generate") if name in data]
    if len(given) > 1:
        problems.append("sections 'precompute' and 'generate' are both given; keep one: stage one caches either "
                        "the data's text or the teacher's own responses")
    first = given[0] if given else "precompute"
    sections = {}
    for name in (first, "train"):
        section = data.get(name)
        if not isinstance(section, dict):
            problems.append(f"section {name!r} is missing or not a mapping" + (
                " (or a 'generate:' section)" if name == "precompute" else ""))
            section = {}
        sections[name] = section
    sections["train"] = {"cache": flat_values(SECTIONS[first], sections[first]).get("out"), **sections["train"]}
    built: dict[str, Any] = {}
    for name, values in sections.items():
        try:
            built[name] = build(SECTIONS[name], values, where=f"{name}.")
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return built[first], built["train"]


def run(args: argparse.Namespace) -> int:
    """Validate both sections, precompute or generate (or reuse), release the teacher, then train. Returns 0."""
    first, train = load_pipeline(args.config)
    if isinstance(first, GenerateOptions):
        summary = stages.run_generate(first)
    else:
        summary = stages.run_precompute(first)
    if stages.reused_cache(summary):
        print(f"reusing the complete cache at {first.storage.out}: its fingerprints match, nothing was recomputed")
    else:
        print(stages.format_summary(summary))
    gc.collect()  # the teacher's last references go with stage one's frames; free them before the student
    import torch  # heavy, off `kdcache --help` (which imports every command); loaded by stage one by now

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(format_train(stages.run_training(train)))
    return 0
