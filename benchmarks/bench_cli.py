"""Issue 25's benchmark: how long `kdcache --help` keeps a user waiting, with and without lazy option flags.

Side by side in one run, alternating, best of several: a fresh interpreter that

* ``lazy``: runs ``kdcache --help`` as the CLI does now (only the command being run builds its option flags;
  until issue 21 that kept transformers, which HfArgumentParser needed, out of the top-level help);
* ``eager``: builds every command's flags first (``build_parser()`` with no command line, the parser before
  issue 25), then prints the same help.

Usage: ``python benchmarks/bench_cli.py [--repeats 5]`` (under a minute). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SIDES = {
    "lazy": "import sys; from kdcache.pipeline.cli import main; sys.argv = ['kdcache', '--help']; main()",
    "eager": "import sys; from kdcache.pipeline.cli import build_parser; build_parser().parse_args(['--help'])",
}


def time_side(code: str) -> float:
    """Wall seconds of one fresh interpreter running ``code`` (exit 0 from --help)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):  # alternate, so a load spike hits both sides alike
        for side, code in SIDES.items():
            times[side].append(time_side(code))
    best = {side: min(values) for side, values in times.items()}
    print(f"| `kdcache --help` | best of {args.repeats} (s) | median (s) |")
    print("| --- | --- | --- |")
    for side, values in times.items():
        print(f"| {side} | {best[side]:.2f} | {sorted(values)[len(values) // 2]:.2f} |")
    print(f"\neager / lazy (best): {best['eager'] / best['lazy']:.1f}x")


if __name__ == "__main__":
    main()
