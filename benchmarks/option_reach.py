"""Issue 21's count, not a speed: how many files each stage's options pass through.

A file counts when one of its functions takes the whole options object or one of its groups: a parameter
annotated with the class (``PrecomputeOptions``, ``TargetOptions``...), or, inside the stage's own folder, a
parameter named ``options`` without a more precise type. Tests and benchmarks are left out.

Usage: ``python benchmarks/option_reach.py [ROOT]`` (ROOT: a source tree, default this one). Prints each stage's
count and its files.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

STAGES = {  # stage -> (its folder, the classes that are its options or their groups)
    "PrecomputeOptions": ("stages/precompute", {"PrecomputeOptions", "EngineOptions", "DatasetOptions",
                                                "StorageOptions", "TargetOptions"}),
    "TrainOptions": ("stages/train", {"TrainOptions", "EngineOptions", "DataOptions", "RunOptions", "LossOptions",
                                      "MapOptions"}),
}


def _names(annotation: ast.expr | None) -> set[str]:
    """The bare names an annotation mentions (``X | None`` -> {"X", "None"})."""
    if annotation is None:
        return set()
    text = ast.unparse(annotation)
    for sep in "|[],.'\"":
        text = text.replace(sep, " ")
    return set(text.split())


def _takes_options(path: Path, folder: str, classes: set[str]) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if _names(arg.annotation) & classes:
                    return True
                if folder in path.as_posix() and arg.arg == "options" and _names(arg.annotation) <= {"Any"}:
                    return True
    return False


def reach(root: Path, folder: str, classes: set[str]) -> list[str]:
    """The files under ``root`` (pipeline/ and stages/) whose functions take the options."""
    files = sorted(p for top in ("pipeline", "stages") for p in (root / top).rglob("*.py"))
    return [p.relative_to(root).as_posix() for p in files if _takes_options(p, folder, classes)]


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    for stage, (folder, classes) in STAGES.items():
        files = reach(root, folder, classes)
        print(f"{stage}: {len(files)} files")
        print("".join(f"    {f}\n" for f in files), end="")


if __name__ == "__main__":
    main()
