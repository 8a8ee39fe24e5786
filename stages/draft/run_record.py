"""A draft run's folder: what it may already hold, its record, and what ``--resume`` may change.

``kdcache draft --out RUN`` keeps, beside the export (``config.json``, ``model.safetensors``, ``draft_run.json``),
stage two's checkpoints (``RUN/checkpoints``, written by ``stages.train.checkpoint``) and a record of what trains the
draft: ``RUN/options.json`` (the draft's options) and ``RUN/plan.json`` (the hash of the cache's fingerprints, as
``kdcache train`` keeps it, so a moved or copied cache resumes). The rules are train's: a folder holding a
checkpoint is continued only with ``--resume``, and a resumed run trains on under its record, refusing any option
that would change what the draft learns (each one named) or another cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdcache.stages.common.stream_options import flag_name
from kdcache.stages.draft.vocab import DraftInputError
from kdcache.stages.train.checkpoint import (
    CACHE_HASH,
    CHECKPOINT_DIR,
    cache_change,
    cache_hash,
    has_checkpoint,
    refuse_changes,
    write_plan,
)
from kdcache.storage import read_json_object

OPTIONS_FILE = "options.json"
# Options that cannot change the weights at a given step: how long the run goes, how often it saves, the export's
# layout, and where the folder and the cache are (the cache is compared by its fingerprints' hash instead).
FREE_ON_RESUME = frozenset({"resume", "out", "cache", "max_steps", "save_every", "layout"})


def check_out(out: str, resume: bool) -> None:
    """Refuse an ``--out`` that holds a draft or a checkpoint unless ``--resume`` asks to continue it, and a
    ``--resume`` with nothing to continue. Reads the folder, writes nothing.

    Raises:
        DraftInputError: with train's wording for a checkpoint, and the draft's for an export.
    """
    if resume and not has_checkpoint(out):
        raise DraftInputError(f"--resume: no checkpoint in {Path(out) / CHECKPOINT_DIR}")
    if resume:
        return
    if has_checkpoint(out):
        raise DraftInputError(f"{out} already holds a checkpoint; pass --resume to continue it, or choose another "
                              "--out")
    if (Path(out) / "config.json").exists():
        raise DraftInputError(f"--out: {out!r} already holds a draft (config.json); choose another folder or remove "
                              "it")


def check_resume(options: dict[str, Any], fingerprints: dict[str, Any]) -> None:
    """Refuse to resume ``options["out"]`` with options (``DraftOptions`` as a dict), other than
    ``FREE_ON_RESUME``, that differ from its record, or with a cache whose fingerprints differ from the one it
    trained on.

    Raises:
        RunChangedError: naming each change, its recorded and its new value.
    """
    out, cache = str(options["out"]), str(options["cache"])
    recorded = read_json_object(Path(out) / OPTIONS_FILE)
    if not recorded:
        return  # a checkpoint without a record (written by hand or by the API): nothing to hold it to, as in train
    now = json.loads(json.dumps(options))
    changes = [f"{flag_name(name)}: {json.dumps(recorded.get(name))} in the run, {json.dumps(value)} now"
               for name, value in sorted(now.items()) if name not in FREE_ON_RESUME and recorded.get(name) != value]
    changes += cache_change(Path(out), recorded, cache, fingerprints)  # by the fingerprints' hash, as train's
    refuse_changes(out, changes, FREE_ON_RESUME - {"resume", "out", "cache"},
                   "To train with the new options, choose another --out")


def write_record(options: dict[str, Any], fingerprints: dict[str, Any], world_size: int) -> None:
    """Write ``RUN/options.json`` (``DraftOptions`` as a dict) and ``RUN/plan.json`` (the cache's hash, the steps,
    batch and world size); rank 0 only."""
    root = Path(str(options["out"]))
    root.mkdir(parents=True, exist_ok=True)
    (root / OPTIONS_FILE).write_text(json.dumps(options, indent=2) + "\n")
    write_plan(root, {CACHE_HASH: cache_hash(fingerprints), "total_steps": options["max_steps"],
                      "batch_size": options["batch_size"], "world_size": world_size})
