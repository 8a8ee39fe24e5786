"""The YAML + CLI config machinery: every problem reported at once, CLI over YAML, types enforced."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from kdcache.pipeline.config import ConfigError, build, flags, from_args
from kdcache.stages.common.option_groups import assemble, flatten, option_group


@dataclasses.dataclass
class Opts:
    data: str = dataclasses.field(metadata={"help": "a file"})
    layers: tuple[int, ...] = (2, 4)
    top_k: int | None = dataclasses.field(default=None, metadata={"aliases": ["-k"]})
    lr: float = 1e-3
    fmt: str = dataclasses.field(default="zarr", metadata={"choices": ["zarr", "arrow"]})
    offload: bool = False

    def validate(self) -> list[str]:
        return [] if Path(self.data).exists() else [f"data: file {self.data!r} does not exist"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(parents=[flags(Opts)])
    parser.add_argument("--config")
    return parser.parse_args(argv)


def test_cli_overrides_yaml_and_types_are_coerced(tmp_path: Path) -> None:
    data = tmp_path / "d.txt"
    data.write_text("x")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"section:\n  data: {data}\n  layers: [1, 3]\n  lr: 0.5\n  top-k: 8\n")
    opts = from_args(Opts, parse(["--config", str(cfg), "--lr", "0.25", "--offload"]), section="section")
    assert opts.layers == (1, 3) and opts.lr == 0.25 and opts.top_k == 8 and opts.offload is True


def test_comma_separated_tuples_and_null() -> None:
    opts = build(Opts, {"data": __file__, "layers": "2,4,6", "top_k": "none"})
    assert opts.layers == (2, 4, 6) and opts.top_k is None


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build(Opts, {"data": str(tmp_path / "missing"), "lr": "fast", "colour": 1, "fmt": "csv", "top_k": 1.5})
    message = str(err.value)
    assert len(err.value.problems) == 5, message
    for needle in ("'colour'", "lr: got 'fast', expected a valid number", "fmt: got 'csv'", "does not exist", "top_k"):
        assert needle in message


def test_missing_required_field_names_its_flag() -> None:
    with pytest.raises(ConfigError, match="data is required \\(flag --data\\)"):
        build(Opts, {})


def test_bad_yaml_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        from_args(Opts, parse(["--config", str(bad)]))
    with pytest.raises(ConfigError, match="does not exist"):
        from_args(Opts, parse(["--config", str(tmp_path / "nope.yaml")]))


def test_every_bad_flag_is_reported_at_once_and_the_class_is_untouched(tmp_path: Path) -> None:
    args = parse(["--data", str(tmp_path / "missing"), "--lr", "fast", "--layers", "2,x", "--top-k", "none",
                  "--offload", "maybe"])
    with pytest.raises(ConfigError) as err:
        from_args(Opts, args)
    message = str(err.value)
    assert len(err.value.problems) == 4, message  # lr, layers[1], offload, and validate()'s missing file
    for needle in ("lr: got 'fast'", "layers[1]: got 'x'", "offload: got 'maybe'", "does not exist"):
        assert needle in message
    # HfArgumentParser strips `| None` from the fields it is given; ours keeps its types, so null still builds.
    assert {f.name: f.type for f in dataclasses.fields(Opts)}["top_k"] == "int | None"
    assert build(Opts, {"data": __file__, "top_k": None}).top_k is None


def test_flags_hold_help_choices_and_defaults() -> None:
    help_text = " ".join(argparse.ArgumentParser(parents=[flags(Opts)]).format_help().split())
    assert "--fmt {zarr,arrow} one of: zarr, arrow (default: zarr)" in help_text
    assert "--layers LAYERS (default: 2,4)" in help_text and "--top_k" not in help_text
    assert "-k TOP_K, --top-k TOP_K" in help_text or "--top-k TOP_K, -k TOP_K" in help_text
    assert "--no-offload turn --offload off" in help_text  # every boolean can be turned off, as a YAML true
    assert from_args(Opts, parse(["--data", __file__, "--offload", "--no-offload"])).offload is False


@dataclasses.dataclass(frozen=True)
class Loss:
    gamma: float = 1.0
    kind: str = dataclasses.field(default="mse", metadata={"choices": ["mse", "cka"]})


@dataclasses.dataclass(frozen=True)
class Run:
    out: str
    steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Grouped:
    run: Run
    loss: Loss = dataclasses.field(default_factory=Loss)


def test_grouped_options_keep_flat_names_and_take_nested_yaml() -> None:
    opts = build(Grouped, {"out": "o", "loss": {"gamma": "0.5"}, "steps": "none"})
    assert opts == Grouped(Run("o", None), Loss(0.5, "mse"))
    assert build(Grouped, {"out": 2024}).run.out == "2024"  # a YAML number where text is expected
    parser = argparse.ArgumentParser(parents=[flags(Grouped)])
    assert "run options:\n  --out OUT" in parser.format_help() and "loss options:\n  --gamma GAMMA" in parser.format_help()
    args = parser.parse_args(["--out", "x", "--gamma", "2"])
    assert from_args(Grouped, args) == Grouped(Run("x"), Loss(2.0))
    with pytest.raises(ConfigError) as err:
        build(Grouped, {"gamma": "big", "kind": "l1", "colour": 1})
    problems = err.value.problems
    assert len(problems) == 3, problems  # colour, gamma, and the missing --out (kind is not reached without it)
    assert any("unknown key 'colour'" in p for p in problems) and any("gamma: got 'big'" in p for p in problems)
    assert "out is required (flag --out)" in problems
    with pytest.raises(ConfigError, match="kind: got 'l1', expected one of mse, cka"):
        build(Grouped, {"out": "o", "kind": "l1"})


@dataclasses.dataclass(frozen=True)
class Toy:
    """A toy family's flag group, held whole by a group as ``TargetOptions.logit`` is."""

    toy_k: int = 4
    toy_mode: str = dataclasses.field(default="a", metadata={"choices": ["a", "b"]})


@dataclasses.dataclass(frozen=True)
class Held:
    repeats: int = 1
    toy: Toy = option_group(Toy)


@dataclasses.dataclass(frozen=True)
class Nested:
    run: Run
    held: Held = dataclasses.field(default_factory=Held)


def test_a_group_inside_a_group_keeps_flat_names_and_its_errors_name_its_options() -> None:
    opts = build(Nested, {"out": "o", "toy_k": "8", "held": {"toy_mode": "b"}})
    assert opts == Nested(Run("o"), Held(toy=Toy(8, "b"))) == assemble(Nested, {"out": "o", "toy_k": 8, "toy_mode": "b"})
    assert list(flatten(opts).items()) == [("out", "o"), ("steps", None), ("repeats", 1), ("toy_k", 8), ("toy_mode", "b")]
    help_text = argparse.ArgumentParser(parents=[flags(Nested)]).format_help()
    assert "held options:\n  --repeats REPEATS" in help_text and "--toy-k TOY_K" in help_text
    with pytest.raises(ConfigError) as err:
        build(Nested, {"out": "o", "toy_k": "x", "toy_mode": "c"})
    assert err.value.problems == ["toy_k: got 'x', expected a valid integer, unable to parse string as an integer",
                                  "toy_mode: got 'c', expected one of a, b"]


def test_a_flat_file_is_read_for_the_command_and_its_typos_are_named(tmp_path: Path) -> None:
    cfg = tmp_path / "flat.yaml"
    cfg.write_text(f"data: {__file__}\nlayers: [1, 3]\nlr: 0.5\n")
    assert from_args(Opts, parse(["--config", str(cfg)]), section="section") == Opts(__file__, (1, 3), lr=0.5)
    cfg.write_text(f"data: {__file__}\ntop_kk: 8\nfmt: csv\nwidth: 3\n")
    with pytest.raises(ConfigError) as err:
        from_args(Opts, parse(["--config", str(cfg), "--lr", "fast"]), section="section")
    problems = err.value.problems
    assert f"{cfg}: unknown key 'top_kk'; did you mean top_k?" in problems, problems
    assert any(p.startswith(f"{cfg}: unknown key 'width'; known keys: data, fmt") for p in problems), problems
    assert any("lr: got 'fast'" in p for p in problems) and any("fmt: got 'csv'" in p for p in problems)
    assert len(problems) == 4, problems  # the file's two keys and the two bad values, at once


def test_a_sectioned_file_names_its_unknown_keys_and_stray_top_level_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "sections.yaml"
    cfg.write_text(f"section:\n  data: {__file__}\n  top-kk: 8\ntrain:\n  student: s\nlr: 0.5\n")
    with pytest.raises(ConfigError) as err:
        from_args(Opts, parse(["--config", str(cfg)]), section="section")
    assert err.value.problems == [
        f"{cfg}: top-level key 'lr' beside the sections generate, precompute, section, train; a file with sections keeps "
        "each key in one", f"{cfg} (section: section): unknown key 'top-kk'; did you mean top_k?"]


def test_a_flat_file_with_the_other_commands_keys_says_whose_they_are(tmp_path: Path) -> None:
    from kdcache.stages.precompute.core.options import PrecomputeOptions

    cfg = tmp_path / "both.yaml"
    cfg.write_text("teacher: t\ndata: d.jsonl\nout: cache\nlayers: 2,4\nstudent: s\nmax_steps: 5\ntop_kk: 4\n")
    with pytest.raises(ConfigError) as err:
        from_args(PrecomputeOptions, argparse.Namespace(config=str(cfg)), section="precompute")
    problems = "\n".join(err.value.problems)
    assert "teacher is required" not in problems and "out is required" not in problems  # the flat keys were read
    assert f"{cfg}: key 'student' is an option of `kdcache train`, not of `kdcache precompute`" in problems
    assert f"{cfg}: key 'max_steps' is an option of `kdcache train`" in problems
    assert f"{cfg}: unknown key 'top_kk'; did you mean top_k?" in problems
