"""The environment of child ``kdcache`` processes: the demo's steps and a sweep's runs.

A training run without a launcher makes itself a world of one by setting ``RANK``, ``WORLD_SIZE``,
``MASTER_PORT`` and friends in its own environment (DeepSpeed reads them from there), and its process group keeps
listening on that port. A child started afterwards from the same process — a test, ``kdcache run``, a notebook —
would inherit those variables, believe a launcher had made it rank 0, and fail to bind the parent's port. So the
launcher's variables are dropped: a child is a world of its own, or gets fresh ones from the launcher it is
started with.
"""

from __future__ import annotations

import os

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "CROSS_RANK", "CROSS_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without a launcher's rank variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env
