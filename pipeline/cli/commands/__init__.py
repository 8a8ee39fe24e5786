"""CLI subcommands: each module exposes register(subparsers)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from kdcache.pipeline.config import add_flags


class Subcommands:
    """What each command module's ``register`` adds its subcommands to: ``add_parser(name, options=Cls)`` as
    argparse's, the option class's flags (every field but ``skip``) built only for the command being run
    (``only``; every command's when None). The commands are parsers of their own, with the flags their option
    class requires (``needed``), until ``pipeline.cli`` adds them to the real subcommands in the order one uses
    them."""

    def __init__(self, only: str | None) -> None:
        self.only = only
        self.made: dict[str, tuple[list[argparse.Action], dict[str, Any]]] = {}  # {name: (needed, add_parser keywords)}

    def add_parser(self, name: str, *, options: type | None = None, skip: tuple[str, ...] = (),
                   **kwargs: Any) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        needed = add_flags(parser, options, skip=skip) if options is not None and self.only in (None, name) else []
        self.made[name] = (needed, {**kwargs, "parents": [*kwargs.get("parents", []), parser]})
        return parser


def print_summary(summary: dict[str, Any], as_json: bool, formatter: Callable[[dict[str, Any]], str]) -> None:
    """Print a stage's summary once, from rank 0 (every rank of a launched run computes one)."""
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2) if as_json else formatter(summary))
