"""``stages/targets/`` is a floor below the stages (docs/architecture.md, "Folders are floors"): no module of a target
family imports ``stages.precompute``, ``stages.train`` or ``stages.draft``, at its top or inside a function, and
each family's registry (and the draft family's preset) loads without torch."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.test_source_rules import _files

STAGES = ("kdcache.stages.precompute", "kdcache.stages.train", "kdcache.stages.draft")


def stage_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import in ``source`` of a stage's module (``STAGES`` or below)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m in STAGES or m.startswith(tuple(s + "." for s in STAGES))]
    return found


def test_the_checker_finds_planted_stage_imports() -> None:
    planted = ("from kdcache.stages.common import documents\nfrom kdcache.stages.train.core import plan\n"
               "def f():\n    import kdcache.stages.precompute\n    from kdcache.stages.trainer import x\n"
               "    from kdcache.stages.draft import model\n")
    assert stage_imports(planted) == [(2, "kdcache.stages.train.core"), (4, "kdcache.stages.precompute"),
                                      (6, "kdcache.stages.draft")]


def test_no_family_module_imports_a_stage() -> None:
    found = [f"{path}:{line}: imports {module}" for path, text in _files("stages/targets")
             for line, module in stage_imports(text)]
    assert not found, "a target family sits below the stages:\n" + "\n".join(found)


def test_the_three_registries_and_the_draft_preset_load_without_torch_or_transformers() -> None:
    # The draft family's preset is read by stage one's options, on the light path; its draft_inputs is torch.
    code = ("import sys; from kdcache.stages.targets import attention, logits; "
            "from kdcache.stages.targets.hidden import hidden_losses as hidden; "
            "from kdcache.stages.targets.draft.draft_layers import draft_layers; "
            "print(len(logits.names()), len(attention.names()), len(hidden.HIDDEN_LOSSES), draft_layers(8), "
            "'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "3", "5", "(2,", "4,", "5)", "False", "False"]
