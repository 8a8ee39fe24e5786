"""CLI subcommands: each module exposes register(subparsers)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, Protocol


class Subcommands(Protocol):
    """What ``register`` is handed (``pipeline.cli``'s command collector): ``add_parser`` builds a command's
    parser, its flags from the option class ``options`` (every field but ``skip``) when that command runs."""

    def add_parser(self, name: str, *, options: type | None = None, skip: tuple[str, ...] = (),
                   **kwargs: Any) -> argparse.ArgumentParser: ...


def print_summary(summary: dict[str, Any], as_json: bool, formatter: Callable[[dict[str, Any]], str]) -> None:
    """Print a stage's summary once, from rank 0 (every rank of a launched run computes one)."""
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2) if as_json else formatter(summary))
