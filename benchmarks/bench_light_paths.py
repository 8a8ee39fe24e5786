"""Issue 57's benchmark: the light paths' start-up, two source trees side by side.

Each side is a fresh interpreter that imports kdcache from one tree (``--base``: a checkout before the change;
``--tree``: this one, default), laid out as the installed package (kdcache/ with pipeline, stages and storage
linked in, the layout ``make lint`` builds) and put first on ``PYTHONPATH``. Per side, alternating, best of
``--repeats``:

* ``help``: ``kdcache --help``;
* ``kinds``: ``import kdcache.stages.targets.logits`` (the registry the option classes read), which must load
  neither torch nor transformers on either side;
* ``precompute help``: ``kdcache precompute --help`` (stage one's flags, built from its options' groups).

Usage: ``python benchmarks/bench_light_paths.py --base DIR [--repeats 7]`` (a minute). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = {
    "help": "import sys; from kdcache.pipeline.cli import main; sys.argv = ['kdcache', '--help']; main()",
    "kinds": "import sys, kdcache.stages.targets.logits; "
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules",
    "precompute help": "import sys; from kdcache.pipeline.cli import main; "
                       "sys.argv = ['kdcache', 'precompute', '--help']; main()",
}


def layout(tree: Path, into: Path) -> Path:
    """``into/kdcache``: ``tree``'s kdcache/*.py with its three folders linked in; returns ``into``."""
    package = into / "kdcache"
    package.mkdir(parents=True)
    for file in (tree / "kdcache").glob("*.py"):
        (package / file.name).write_text(file.read_text())
    for folder in ("pipeline", "stages", "storage"):
        (package / folder).symlink_to(tree / folder)
    return into


def time_once(code: str, root: Path, cache: Path) -> float:
    """Wall seconds of one fresh interpreter running ``code`` with ``root`` first on the import path. It runs in
    ``root``: ``python -c`` puts its working folder before ``PYTHONPATH``, and run from a checkout's root both
    sides would import that checkout's ``kdcache/``."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONPYCACHEPREFIX": str(cache)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env, cwd=root)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree before the change")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        roots = {side: layout(tree.resolve(), Path(tmp) / side) for side, tree in (("base", args.base),
                                                                                   ("tree", args.tree))}
        cache = Path(tmp) / "pycache"  # compiled once per side by the first (warm-up) run
        times: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats + 1):
            for what, code in CODE.items():
                for side, root in roots.items():  # alternate, so a load spike hits both sides alike
                    seconds = time_once(code, root, cache)
                    if repeat:
                        times.setdefault((what, side), []).append(seconds)
    print(f"| path | base: best of {args.repeats} (s) | tree: best (s) | tree / base |")
    print("| --- | --- | --- | --- |")
    for what in CODE:
        base, tree = min(times[what, "base"]), min(times[what, "tree"])
        print(f"| {what} | {base:.2f} | {tree:.2f} | {tree / base:.2f} |")


if __name__ == "__main__":
    main()
