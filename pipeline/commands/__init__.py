"""CLI subcommands: each module exposes register(subparsers)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def print_summary(summary: dict[str, Any], as_json: bool, formatter: Callable[[dict[str, Any]], str]) -> None:
    """Print a stage's summary once, from rank 0 (every rank of a launched run computes one)."""
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2) if as_json else formatter(summary))
