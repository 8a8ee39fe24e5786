"""The ``kdcache`` command line.

Every module in ``pipeline.commands`` that defines ``register(subparsers)`` contributes its subcommands, so a
new command is one new file. Heavy imports (torch, transformers, deepspeed) happen inside the commands' ``run``
functions, which keeps ``kdcache --help`` instant.

Any ``KdcacheError`` (bad config, bad cache, bad input) and any ``OSError`` (a full disk, storage that cannot be
reached) ends the run with a one-paragraph message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import pipeline.commands
from storage.errors import KdcacheError

DESCRIPTION = (
    "kdcache: run a Hugging Face teacher once, cache its hidden states, attention maps and logits as compressed "
    "shards, then distil students from the cache under DeepSpeed ZeRO without ever loading the teacher again."
)


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="kdcache", description=DESCRIPTION)
    # The deepspeed launcher runs `python -m pipeline --local_rank=N COMMAND ...`; ranks come from the
    # environment (LOCAL_RANK, RANK, WORLD_SIZE), so the flag is accepted and otherwise ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(pipeline.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"pipeline.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 check failed, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
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
    except KeyboardInterrupt:
        print(f"kdcache {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
