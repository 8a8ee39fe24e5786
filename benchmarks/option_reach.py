"""Issues 21 and 52's counts, not a speed: how many files each stage's options pass through.

Two counts per stage:

* ``declared`` (issue 21): a file counts when one of its functions takes the whole options object or one of its
  groups: a parameter annotated with the class (``PrecomputeOptions``, ``TargetOptions``...), or, inside the
  stage's own folder, a parameter named ``options`` without a more precise type.
* ``followed`` (issue 52, stage one only): the options followed call by call from the stage's entry
  (``run_precompute(options)``). A value is the options when it is the entry's parameter, a group of one
  (``options.targets``), a field named ``options`` of anything (``ready.options``), ``replace(...)`` of one, a
  local assigned one (tuples unpacked), or the result of a function annotated to return one. Each call that
  hands such a value to a function is followed into the parameter it lands in. A callee is found by name: a
  function of the caller's own file first, else one of the stage's folder, ``stages/common`` or ``storage``
  (``functools.partial(f, ...)`` counts as a call of ``f``; a method call reaches every method of that name in
  the stage's folder, a class's (``Grid.of``) that class's alone). A function that reads a field named
  ``options`` of what it is handed (``ready.options``) receives them too. A file is reached when one of its
  functions receives the options (the entry's file included); each function that receives them counts once for
  its file ("comes back"). Calls inside nested functions count as their enclosing function's.

Tests and benchmarks are left out. Usage: ``python benchmarks/option_reach.py [ROOT]`` (ROOT: a source tree,
default this one). Prints each count and its files.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
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


ENTRIES = {"PrecomputeOptions": ("stages/precompute/runner.py", "run_precompute", "options",
                                  ("engine", "dataset", "storage", "targets"))}
SHARED = ("stages/common/", "storage/")  # where a stage's calls may land besides its own folder
Function = ast.FunctionDef | ast.AsyncFunctionDef


OWNER = "_kdcache_class"  # the attribute the index sets on a method's node: the name of its class


def _functions(root: Path) -> dict[str, list[tuple[str, Function]]]:
    """Every function and method of pipeline/ and stages/ by its name: (file, definition)."""
    index: dict[str, list[tuple[str, Function]]] = {}
    for path in sorted(p for top in ("pipeline", "stages") for p in (root / top).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for method in cls.body:
                setattr(method, OWNER, cls.name)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                index.setdefault(node.name, []).append((path.relative_to(root).as_posix(), node))
    return index


class _Follow:
    """The walk of ``followed`` (module docstring): which parameters of which functions receive the options."""

    def __init__(self, index: dict[str, list[tuple[str, Function]]], classes: set[str], groups: tuple[str, ...],
                 folder: str):
        self.index, self.classes, self.groups, self.folder = index, classes, groups, folder
        self.seen: set[tuple[str, int, str]] = set()
        self.receptions: Counter[str] = Counter()
        self.file = ""  # the file of the function being walked

    def resolve(self, name: str | None, method: bool = False) -> list[tuple[str, Function]]:
        """The definitions a call of ``name`` from ``self.file`` may reach (module docstring); a method only in
        the stage's folder (``adapter.capture`` is not ``kind.capture``)."""
        defs = self.index.get(name or "", [])
        own = [d for d in defs if d[0] == self.file]
        return own or [d for d in defs if d[0].startswith((self.folder + "/", *(() if method else SHARED)))]

    def is_options(self, node: ast.expr, held: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in held
        if isinstance(node, ast.Attribute):
            return node.attr == "options" or (node.attr in self.groups and self.is_options(node.value, held))
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None  # a function's, not ``Grid.of``
            returns = any(_names(d.returns) & self.classes for _, d in self.resolve(name))
            return returns or (name == "replace" and bool(node.args) and self.is_options(node.args[0],
                                                                                                       held))
        return False

    def walk(self, file: str, func: Function, params: set[str]) -> None:
        """Follow the options through ``func``, where ``params`` hold them."""
        self.receptions[file] += 1
        caller, self.file = self.file, file
        held = set(params)
        for node in ast.walk(func):  # locals first: ``t = options.targets``, ``o, x = ready.options, y``
            if isinstance(node, ast.Assign):
                held |= {t.id for t, v in _pairs(node) if isinstance(t, ast.Name) and self.is_options(v, held)}
        for node in ast.walk(func):
            if isinstance(node, ast.Call):
                self.call(node, held)
        self.file = caller

    def call(self, node: ast.Call, held: set[str]) -> None:
        func, args = node.func, list(node.args)
        if _callee(func) == "partial" and args:
            func, args = args[0], args[1:]
        name = _callee(func)
        given = [i for i, a in enumerate(args) if self.is_options(a, held)]
        keywords = {k.arg for k in node.keywords if k.arg and self.is_options(k.value, held)}
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        for file, target in self.resolve(name, isinstance(func, ast.Attribute)) if name else []:
            if owner[:1].isupper() and getattr(target, OWNER, owner) != owner:
                continue  # ``Grid.of(...)`` is Grid's ``of``, no other class's
            if not (given or keywords):  # a carrier: the callee reads ``x.options`` of what it is handed
                if _reads_options(target) and (file, target.lineno, "") not in self.seen and node.args:
                    self.seen.add((file, target.lineno, ""))
                    self.walk(file, target, set())
                continue
            params = target.args.posonlyargs + target.args.args
            shift = 1 if isinstance(func, ast.Attribute) and params and params[0].arg in ("self", "cls") else 0
            names = {params[i + shift].arg for i in given if i + shift < len(params)}
            names |= keywords & {a.arg for a in params + target.args.kwonlyargs}
            for param in names - {"self", "cls"}:
                if (file, target.lineno, param) not in self.seen:
                    self.seen.add((file, target.lineno, param))
                    self.walk(file, target, {param})


def _reads_options(func: Function) -> bool:
    """Whether ``func`` reads a field named ``options`` (``ready.options``): it is handed the options inside."""
    return any(isinstance(n, ast.Attribute) and n.attr == "options" and isinstance(n.ctx, ast.Load)
               for n in ast.walk(func))


def _pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of an assignment, a tuple unpacked element by element."""
    out = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            out += list(zip(target.elts, node.value.elts))
        else:
            out.append((target, node.value))
    return out


def _callee(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def followed(root: Path, stage: str) -> Counter[str]:
    """The files the options reach from the stage's entry, with the functions of each that receive them (module
    docstring)."""
    entry_file, entry, param, groups = ENTRIES[stage]
    walk = _Follow(_functions(root), STAGES[stage][1], groups, STAGES[stage][0])
    for file, func in walk.index[entry]:
        if file == entry_file:
            walk.walk(file, func, {param})
    return walk.receptions


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    for stage, (folder, classes) in STAGES.items():
        files = reach(root, folder, classes)
        print(f"{stage}: {len(files)} files declare a parameter of the options")
        print("".join(f"    {f}\n" for f in files), end="")
        if stage in ENTRIES:
            reached = followed(root, stage)
            print(f"{stage} followed from {ENTRIES[stage][1]}: {len(reached)} files, received by "
                  f"{sum(reached.values())} functions")
            print("".join(f"    {f} ({reached[f]})\n" for f in sorted(reached)), end="")


if __name__ == "__main__":
    main()
