"""The flags built from option dataclasses with argparse's public API: help features, values left raw, laziness."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kdcache.pipeline.cli as cli
import kdcache.pipeline.config as config
from kdcache.pipeline.cli import build_parser, main
from kdcache.pipeline.config import ConfigError, add_flags, build, flags, from_args


@dataclasses.dataclass(frozen=True)
class Engine:
    stage: int = dataclasses.field(default=0, metadata={"help": "ZeRO stage", "choices": [0, 1, 2, 3]})
    offload: bool = False
    resume: bool = True


@dataclasses.dataclass(frozen=True)
class Paths:
    out: str = dataclasses.field(metadata={"help": "where it goes"})
    limit: int | None = None


@dataclasses.dataclass(frozen=True)
class Both:
    paths: Paths
    engine: Engine = dataclasses.field(default_factory=Engine)


def _private_names(module: types.ModuleType) -> set[str]:
    """Attribute names starting with one underscore read off anything in ``module``'s source."""
    tree = ast.parse(Path(str(module.__file__)).read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")}


def test_config_and_cli_read_no_private_attribute() -> None:
    assert _private_names(config) == set() and _private_names(cli) == set()
    for module in (config, cli):
        assert "HfArgumentParser" not in Path(str(module.__file__)).read_text()


def test_fields_keep_their_types_and_values_stay_raw_until_pydantic() -> None:
    hints_before = {f.name: f.type for f in dataclasses.fields(Paths)}
    parser = argparse.ArgumentParser(parents=[flags(Both)])
    assert {f.name: f.type for f in dataclasses.fields(Paths)} == hints_before  # nothing rewrites the class
    args = parser.parse_args(["--out", "o", "--limit", "none", "--stage", "2", "--offload"])
    assert vars(args) == {"out": "o", "limit": "none", "stage": 2, "offload": True}  # absent flags stay absent
    assert from_args(Both, args) == Both(Paths("o", None), Engine(2, True, True))
    with pytest.raises(ConfigError, match="limit: got 'many'"):
        from_args(Both, parser.parse_args(["--out", "o", "--limit", "many"]))


def test_booleans_take_a_value_and_a_negation_right_after_them() -> None:
    parser = argparse.ArgumentParser(parents=[flags(Both)])
    usage = " ".join(parser.format_usage().split())
    assert "[--offload [true|false]] [--no-offload] [--resume [true|false]] [--no-resume]" in usage
    text = " ".join(parser.format_help().split())
    assert "--resume [true|false] (default: true) --no-resume turn --resume off" in text
    assert from_args(Both, parser.parse_args(["--out", "o", "--no-resume", "--offload", "false"])).engine == \
        Engine(0, False, False)


def test_groups_choices_and_required_flags_in_the_help() -> None:
    parser = cli._Parser(prog="demo")
    parser.needed = add_flags(parser, Both)
    assert [a.dest for a in parser.needed] == ["out"]
    usage = parser.format_usage()
    assert " --out OUT " in usage and "[--out OUT]" not in usage  # marked required in the usage ...
    assert parser.parse_args([]) == argparse.Namespace()  # ... which argparse does not demand (--config may)
    text = " ".join(parser.format_help().split())
    assert "paths options: --out OUT where it goes (required: the flag or its --config key)" in text
    assert "engine options: --stage {0,1,2,3} ZeRO stage; one of: 0, 1, 2, 3 (default: 0)" in text
    assert "(default: None)" not in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--stage", "4"])
    with pytest.raises(ConfigError, match="out is required \\(flag --out\\)"):
        build(Both, {})


def test_only_the_command_run_gets_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(["inspect", "somewhere"])
    subcommands = next(a for a in parser.parse_args(["inspect", "x"]).commands.items())
    assert subcommands[0] == "precompute" and "--top-k" not in subcommands[1].format_help()
    assert "--top-k" in build_parser(["precompute"]).parse_args(["precompute"]).commands["precompute"].format_help()
    with pytest.raises(SystemExit) as caught:
        main(["train", "--gama", "1"])
    assert caught.value.code == 2 and "did you mean --gamma?" in capsys.readouterr().err


def test_top_level_help_imports_no_model_library() -> None:
    code = ("import sys; from kdcache.pipeline.cli import build_parser; build_parser(['--help']); "
            "print(sorted(m for m in ('transformers', 'torch', 'pydantic', 'array_api_compat.numpy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
