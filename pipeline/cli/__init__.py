"""The ``kdcache`` command line.

Every module in ``pipeline.cli.commands`` that defines ``register(subparsers)`` contributes its subcommands, so a
new command is one new file. Heavy imports (torch, deepspeed, the models) happen inside the commands' ``run``
functions, and a command's option-class flags (``add_parser(name, options=Cls)``, built by
``pipeline.config.add_flags``) only for the command being run.

The command line is ``pipeline``'s top floor, a package so that the folders show it: this door and its
``commands`` import the rest of ``pipeline`` (config, demo, sweep, report...), which never imports them back.

``--quiet`` (every command) runs the command inside ``pipeline.quiet.quiet``; Ctrl-C says how to continue.

Any ``KdcacheError`` (bad config, bad cache, bad input) and any ``OSError`` (a full disk, storage that cannot be
reached) ends the run with a one-paragraph message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import os
import pkgutil
import re
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

import kdcache.pipeline.cli.commands
from kdcache import stages, storage
from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.quiet import is_quiet, libraries_on_terminal, quiet
from kdcache.stages.train.interrupt import TrainingInterrupted
from kdcache.storage import KdcacheError

_STORAGE_CLIENTS = {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "azure", "google", "fsspec"}
# What rerunning does after Ctrl-C, for the commands that keep their progress.
_RESUME = {
    "precompute": "rerun the same command to continue after the last committed shard",
    "run": "rerun the same command to continue the cache after its last committed shard (and `resume: true` "
           "under train: to continue training from its last checkpoint)",
    "sweep": "rerun the same command to continue: finished runs are reused, interrupted ones resume",
    "train": "rerun the same command with --resume to continue from the last checkpoint (written every "
             "--save-every steps, at the end, and after the step a first Ctrl-C lets finish)",
}
# Stage one, its upkeep, stage two, its measures, the draft from the same cache and its judge, then the commands
# that chain them.
COMMAND_ORDER = ("precompute", "merge", "inspect", "verify", "init-student", "train", "eval", "report", "draft",
                 "draft-eval", "sweep", "run", "demo")
DESCRIPTION = (
    "kdcache: run a Hugging Face teacher once, cache its hidden states, attention maps and logits as compressed "
    "shards, then distil students from the cache under DeepSpeed ZeRO without ever loading the teacher again."
)


class _Parser(argparse.ArgumentParser):
    """argparse with short errors: the problem first, a did-you-mean where one is close, and where to get
    help, instead of the whole usage block (exit 2, as argparse).

    ``needed`` holds the flags an option class requires: argparse itself must not require them, since
    ``--config`` may give them instead, yet the usage shows them without brackets, as required flags.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--max-step` taken for `--max-steps` would silently mean what was not typed, and a
        # flag added later could turn a working abbreviation into another flag.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.needed: list[argparse.Action] = []

    def format_usage(self) -> str:
        with _required(self.needed):
            return super().format_usage()

    def format_help(self) -> str:
        with _required(self.needed):
            return super().format_help()

    def error(self, message: str) -> NoReturn:
        hint = _did_you_mean(self, message)
        self.exit(2, f"{self.prog}: error: {message}{hint}\n(`{self.prog} --help` lists every flag)\n")


@contextlib.contextmanager
def _required(actions: list[argparse.Action]) -> Iterator[None]:
    """``actions`` marked required while a usage line is written (parsing never sees the mark)."""
    for action in actions:
        action.required = True
    try:
        yield
    finally:
        for action in actions:
            action.required = False


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """``; did you mean --max-steps?`` for an unknown flag, or a bad choice, close to a known one."""
    if message.startswith("unrecognized arguments: "):
        words = message.split(": ", 1)[1].split()
        known = sorted(set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", parser.format_help())))
    else:  # argparse's own message lists the choices: "invalid choice: 'zar' (choose from 'zarr', 'arrow')"
        match = re.search(r"invalid choice: '?([^' ]+)'? \(choose from (.*)\)", message)
        if not match:
            return ""
        words, known = [match[1]], [c.strip(" '") for c in match[2].split(",")]
    for word in words:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand (``COMMAND_ORDER`` first, then the rest by name),
    each marking the flags its option class requires in its usage.

    Args:
        argv: the command line about to be parsed: only its command gets its full flags (all do when None).
    """
    parser = _Parser(prog="kdcache", description=DESCRIPTION)
    # The deepspeed launcher runs `python -m kdcache --local_rank=N COMMAND ...`; ranks come from the
    # environment (LOCAL_RANK, RANK, WORLD_SIZE), so the flag is accepted and otherwise ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    # The command is the first word that is not a flag nor --local_rank's number.
    registry = Subcommands(None if argv is None else next((a for a in argv if a[:1] != "-" and not a.isdigit()), ""))
    for info in sorted(pkgutil.iter_modules(kdcache.pipeline.cli.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"kdcache.pipeline.cli.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(registry)
    rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
    for name in sorted(registry.made, key=lambda n: (rank.get(n, len(rank)), n)):
        needed, kwargs = registry.made[name]
        command = subparsers.add_parser(name, **kwargs)
        command.needed = needed
        # every command may read or write a cache in object storage
        command.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                             help="an fsspec option for s3://, gs://... caches, e.g. endpoint_url=http://host:9000 "
                                  "(repeatable; credentials also come from the usual AWS_* / GOOGLE_* variables)")
        with contextlib.suppress(argparse.ArgumentError):  # train's --quiet is an option (YAML too), the same switch
            command.add_argument("--quiet", action="store_true",
                                 help="on success print only kdcache's notes about the run: no summary, progress or "
                                      "library lines (errors still show)")
    parser.set_defaults(commands=subparsers.choices)  # main() names the command whose flag was misspelled
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 check failed, 2 bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the command whose flags were misspelled, not the top level
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.storage_option:  # handed to every store this process, and each process it starts, opens
            options = {**storage.default_storage_options(), **storage.parse_storage_options(args.storage_option)}
            os.environ[storage.OPTIONS_ENV] = json.dumps(options)
        with libraries_on_terminal(), quiet(is_quiet(getattr(args, "quiet", False))):  # errors: printed below
            return int(args.func(args) or 0)
    except TrainingInterrupted as exc:  # a checkpoint was saved first: say where, and how to go on
        print(f"kdcache {args.command}: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    except KdcacheError as exc:
        print(f"kdcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kdcache inspect CACHE | head`: the reader left, which is not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as exc:  # the environment's fault (disk full, storage unreachable, permissions): no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"kdcache {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except Exception as exc:  # an object-store client's error that is no OSError (botocore's connection errors)
        if type(exc).__module__.split(".")[0] not in _STORAGE_CLIENTS:
            raise
        print(f"kdcache {args.command}: error: the store failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = _interrupted_hint(args)
        print(f"kdcache {args.command}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130


def _interrupted_hint(args: argparse.Namespace) -> str | None:
    """How to go on after a Ctrl-C that stopped at once: for train, --resume only where a checkpoint exists (one
    before the first checkpoint has nothing to resume)."""
    if args.command == "train" and getattr(args, "out", None):
        if not stages.has_checkpoint(args.out):
            return (f"no checkpoint was written in {args.out} yet, so there is nothing to resume: rerun the same "
                    f"command (without --resume) to start again")
    return _RESUME.get(args.command)


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())

