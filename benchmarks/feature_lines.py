"""Issue 57's line count, not a speed: the lines of pipeline/, stages/, storage/ and kdcache/, and of them the
features that existed when the issue was filed (its 27,919 lines: 193 files at ``FILED``).

* ``lines``: every line of every ``.py`` file of the four folders, the generation and draft modules apart
  (``APART``, the files whose names say so, as the issue asks).
* ``later issues' lines``: what issues 58-63 (this round's other issues) added inside the shared files, counted two
  ways. ``blame``: lines whose last change (``git blame -w -M``) is a commit of those issues' own branches (the
  second-parent side of their merges on main), and the whole of each file such a branch created; it undercounts
  them, since a line of theirs that a later cut touched counts as the cut's. ``merged``: the net lines their
  merges added when they landed (``git diff --numstat`` of each merge against its first parent).
* today's features = lines - later issues' lines, by either count.

Usage: ``python benchmarks/feature_lines.py [REV]`` in a clone with its history (REV: default HEAD).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

FILED = "9761c4c"  # the tree issue 57 counted (193 files, 27,919 lines)
FOLDERS = ("pipeline", "stages", "storage", "kdcache")
APART = ("stages/draft/", "stages/targets/draft/", "stages/precompute/generation/", "stages/precompute/generate.py",
         "pipeline/cli/commands/generate.py", "pipeline/cli/commands/draft.py")
LATER = re.compile(r"issue (58|59|60|61|62|63)\b|Merge i(58|59|63)|Merge branch 'itime'")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def later_merges(rev: str) -> Iterator[tuple[str, str, str]]:
    """(merge, first parent, second parent) of each merge on main since FILED that lands one of issues 58-63."""
    for line in git("log", "--first-parent", "--merges", "--format=%H %P|%s", f"{FILED}..{rev}").splitlines():
        commits, subject = line.split("|", 1)
        if LATER.search(subject):
            merge, first, second = commits.split()[:3]
            yield merge, first, second


def counted(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] in FOLDERS and not path.startswith(APART)


def by_blame(rev: str, files: list[str]) -> int:
    """Lines of ``files`` last changed on a later issue's branch, or in a file such a branch created."""
    commits = {c for _, first, second in later_merges(rev) for c in git("rev-list", f"{first}..{second}").split()}
    total = 0
    for path in files:
        created = git("log", "--diff-filter=A", "--follow", "--format=%H", rev, "--", path).split()
        origins = re.findall(r"^([0-9a-f]{40}) \d+ \d+", git("blame", "-w", "-M", "--porcelain", rev, "--", path),
                             re.M)
        total += len(origins) if created and created[-1] in commits else sum(c in commits for c in origins)
    return total


def by_merges(rev: str) -> int:
    """Net lines the later issues' merges added to the counted files when they landed."""
    total = 0
    for merge, first, _ in later_merges(rev):
        for line in git("diff", "--numstat", "-M", first, merge).splitlines():
            added, removed, path = line.split("\t", 2)
            path = re.sub(r"\{[^}]*=> ([^}]*)\}", r"\1", path).replace("//", "/")
            if added != "-" and counted(path.split(" => ")[-1]):
                total += int(added) - int(removed)
    return total


def main(rev: str = "HEAD") -> None:
    tree = git("ls-tree", "-r", "--name-only", rev, "--", *FOLDERS).split()
    files = [p for p in tree if counted(p)]
    apart = [p for p in tree if p.endswith(".py") and p.startswith(APART)]
    lines = sum(len(git("show", f"{rev}:{p}").splitlines()) for p in files)
    kept = sum(len(git("show", f"{rev}:{p}").splitlines()) for p in apart)
    blame, merged = by_blame(rev, files), by_merges(rev)
    print(f"lines {lines} ({len(files)} files; generation and the draft apart: {kept})")
    print(f"later issues' lines: blame {blame}, merged {merged}")
    print(f"today's features: {lines - blame} (blame) to {lines - merged} (merged); the issue's target 26,500")


if __name__ == "__main__":
    main(*sys.argv[1:2])
