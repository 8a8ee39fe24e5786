"""What a second ``kdcache demo`` into the same folder keeps from the first, so that it reruns in a fraction of the
time and prints the same figures.

* The caches: the precompute steps always run, and stage one itself reuses a complete cache whose fingerprints
  match without loading the teacher (the check ``kdcache run`` relies on, ``stages.precompute.reused_cache``,
  read from the child's JSON summary).
* The student-init: kept when its ``kdcache_init.json`` names the same teacher folder and blocks. The step is
  skipped rather than run again, since ``init-student`` refuses a folder that already holds a student.
* The trained run: kept when the same ``kdcache train`` arguments finished in ``run/`` (its student exported) from
  a reused cache and student-init; anything else in ``run/`` (a run with other settings, or one stopped) is moved
  beside it as ``run-earlier-N`` (``set_aside``), never deleted, and the run is trained again; so is a
  student-init built otherwise, and a data file of other sentences with the cache made from it.
* The evaluations: kept when both what they score and the cache they score on were kept.

Paths are no part of what a step is: the steps' record writes the demo folder as ``OUT`` and an evaluation is
found by its cache's label, so a copied or moved demo folder reruns as quickly as in place.

The measured figures (seconds, peak memory) of a kept step are those of the step that did the work: each step's
measurements are written to ``OUT/logs/steps.json`` beside the arguments it ran with, as it finishes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdcache import stages
from kdcache.storage import read_json_object

STEPS_FILE = "steps.json"


@dataclass
class StepLog:
    """Each demo step's arguments and measurements, kept across demos in one folder (``LOGS/steps.json``)."""

    path: Path
    steps: dict[str, Any]

    @classmethod
    def open(cls, logs: Path) -> StepLog:
        """The record in ``logs``; an empty one where there is none or it cannot be read (a demo cut off)."""
        path = Path(logs) / STEPS_FILE
        return cls(path, read_json_object(path))

    def inside(self, args: list[str]) -> list[str]:
        """``args`` with the demo folder's path written ``OUT``: a copied or moved demo folder records the same
        steps (the folder is where ``logs/`` lies)."""
        out = str(self.path.parent.parent)
        return [arg.replace(out, "OUT") for arg in args]

    def measured(self, name: str, args: list[str]) -> tuple[float, int] | None:
        """(seconds, peak RSS bytes) of step ``name`` run with exactly ``args``; None if it never was."""
        record = self.steps.get(name)
        # A record written before the folder was written OUT holds the paths themselves.
        if not isinstance(record, dict) or record.get("args") not in (self.inside(args), args):
            return None
        try:
            return float(record["seconds"]), int(record["peak_rss"])
        except (KeyError, TypeError, ValueError):
            return None

    def forget(self, name: str) -> None:
        """Drop step ``name``'s record before the step runs again: a run stopped half-way must not be taken for
        the one the record describes."""
        if self.steps.pop(name, None) is not None:
            self.path.write_text(json.dumps(self.steps, indent=2) + "\n")

    def record(self, name: str, args: list[str], seconds: float, peak_rss: int) -> None:
        """Keep step ``name``'s measurements, written at once so that a demo stopped later still has them."""
        self.steps[name] = {"args": self.inside(args), "seconds": seconds, "peak_rss": peak_rss}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.steps, indent=2) + "\n")


def matching_student(folder: Path, teacher: Path, blocks: list[int]) -> bool:
    """Whether ``folder`` holds a whole student that ``init-student`` built from ``teacher``'s ``blocks``: its
    record, written after the weights and the tokenizer, names both."""
    record = read_json_object(Path(folder) / "kdcache_init.json")
    return (record.get("teacher") == str(teacher)
            and record.get("teacher_blocks") == list(blocks) and (Path(folder) / "config.json").is_file()
            and any(Path(folder).glob("*.safetensors")))


def finished_run(run_dir: Path) -> bool:
    """Whether a training run got to its end: its export writes the student's config, then its weights, then the
    projectors beside it (``projectors.pt``, last)."""
    run = Path(run_dir)
    return ((run / "student" / "config.json").is_file() and any((run / "student").glob("*.safetensors"))
            and (run / "projectors.pt").is_file())


def set_aside(folder: Path, what: str | None = None) -> Path:
    """Rename ``folder`` (or a file) to the first free ``NAME-earlier-N`` beside it (N from 1; a file keeps its
    suffix: ``train-earlier-1.jsonl``), so that a demo with other settings keeps what an earlier one made; returns
    the new path, and says where it went when told ``what`` it is. A rename: nothing is copied or lost."""
    folder = Path(folder)
    n = 1
    while (kept := folder.with_name(f"{folder.stem}-earlier-{n}{folder.suffix}")).exists():
        n += 1
    folder.rename(kept)
    if what:
        print(f"      {what}: the earlier one (other settings, or stopped) is kept as {kept}; remove it when no "
              "longer needed", flush=True)
    return kept


def cache_id(cache: Path) -> str:
    """The cache's label with its fingerprints' hash (``heldout-1a2b3c4d``); "" without a readable manifest. A
    reused step is tied to it, so that a cache rebuilt with other settings in the same folder is not taken for
    the one an earlier step read."""
    fingerprints = read_json_object(Path(cache) / "manifest.json").get("fingerprints")
    return "" if fingerprints is None else stages.cache_label(str(cache), fingerprints)


def has_eval(run_dir: Path, role: str, cache: Path) -> bool:
    """Whether ``run_dir`` holds an evaluation of ``role`` against this very cache: its folder's name and its
    fingerprints (the label), wherever the demo folder now lies."""
    label = cache_id(cache)
    return label != "" and any(r.get("role") == role and r.get("cache", {}).get("label") == label
                               for r in stages.read_evals(run_dir))


def json_summary(path: Path) -> dict[str, Any]:
    """The summary a ``--json`` child printed to ``path``: the last ``{``-line to the end (a library may have
    printed a line of its own before it)."""
    lines = Path(path).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    if not starts:
        return {}
    try:
        summary = json.loads("\n".join(lines[starts[-1]:]))
    except ValueError:
        return {}
    return summary if isinstance(summary, dict) else {}
