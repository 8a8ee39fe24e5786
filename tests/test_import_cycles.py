"""No import cycle among the project's modules, nor among its folders (docs/architecture.md, "Folders are floors").

Every import counts, inside functions too: a deferred import still ties the two modules together. In the folder
graph a module stands for its folder's package and an import of a package's door (its ``__init__``) for that
package, so a sub-package importing its parent's door while the parent imports the sub-package is a cycle even
where no two files import each other. A door importing its own sub-modules is how it re-exports them, not a
cycle. ``graphlib`` finds the cycles; each checker is also run on a planted one.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages", "storage")

Graph = dict[str, set[str]]


def modules_under(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted name (without the ``kdcache.`` prefix) -> file, for every module of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of ours that a dotted name starts with (``kdcache.`` dropped), or None."""
    parts = name.removeprefix("kdcache.").split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its file (relative imports resolved)."""
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets |= {_known(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from ..y import z
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets |= {_known(f"{base}.{alias.name}", modules) or _known(base, modules) for alias in node.names}
    door = path.name == "__init__.py"
    return {t for t in targets if t and t != module and not (door and t.startswith(module + "."))}


def module_graph(modules: dict[str, Path]) -> Graph:
    return {m: imported(m, p, modules) for m, p in modules.items()}


def package_graph(graph: Graph, modules: dict[str, Path]) -> Graph:
    """The module graph between packages: a module is its folder's package, a door is its own package."""
    def package(m: str) -> str:
        return m if modules[m].name == "__init__.py" else m.rpartition(".")[0]

    out: Graph = {}
    for a, targets in graph.items():
        for b in targets:
            if package(a) != package(b):
                out.setdefault(package(a), set()).add(package(b))
    return out


def a_cycle(graph: Graph) -> list[str]:
    """One import cycle of ``graph`` (the modules in order, the first repeated at the end), or []."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return []


def test_the_checkers_find_planted_cycles(tmp_path: Path) -> None:
    for name, text in {"__init__.py": "", "a.py": "from pkg import b\nfrom pkg.sub import c\n",
                       "b.py": "def f():\n    from . import a\n", "sub/__init__.py": "",
                       "sub/c.py": "import pkg\n"}.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg.sub import c\n")
    modules = modules_under(tmp_path, ("pkg",))
    graph = module_graph(modules)
    assert set(a_cycle(graph)) == {"pkg.a", "pkg.b"}  # an import inside a function counts
    del graph["pkg.b"]
    assert a_cycle(graph) == []  # the door's import of pkg.sub.c is its own re-export
    # pkg.a imports pkg.sub.c, which imports its parent's door: no two files import each other, yet the folders do
    assert set(a_cycle(package_graph(graph, modules))) == {"pkg", "pkg.sub"}


@pytest.mark.parametrize("by_package", [False, True], ids=["modules", "packages"])
def test_no_import_cycle(by_package: bool) -> None:
    modules = modules_under(ROOT)
    graph = module_graph(modules)
    assert len(modules) > 150
    assert a_cycle(package_graph(graph, modules) if by_package else graph) == []


def test_the_architecture_notes_name_only_files_in_the_repository() -> None:
    """Issue 61: docs/architecture.md pointed at a checker outside the repository, which a clone does not have."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    outside = [word for word in text.replace("`", " ").split() if word.startswith(("/work", "/home", "../"))]
    assert outside == []
    assert "tests/test_import_cycles.py" in text and Path(__file__).name == "test_import_cycles.py"
