"""Per-stream option values (issue 21): one syntax for flags and YAML, the old per-stack flags as aliases."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import yaml

from kdcache.pipeline.config import ConfigError, build, flags, from_args
from kdcache.pipeline.quiet import NOTE_PREFIX
from kdcache.stages.common.stream_options import ALIASES, StreamLayers, StreamValueError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.train.core.layer_maps import LayerMap, StreamMaps
from kdcache.stages.train.core.options import TrainOptions


@pytest.fixture
def places(tmp_path: Path) -> dict[str, dict[str, str]]:
    """The required options of each command, naming things that exist (validate() checks them)."""
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{}")
    (tmp_path / "data.txt").write_text("a line\n")
    return {"precompute": {"teacher": str(tmp_path / "teacher"), "data": str(tmp_path / "data.txt"),
                           "out": str(tmp_path / "cache")},
            "train": {"cache": "c", "student": str(tmp_path / "teacher"), "out": str(tmp_path / "run")}}


def parse(cls: type, argv: list[str], required: dict[str, str], config: Path | None = None,
          section: str | None = None) -> object:
    """Options of ``cls`` as the CLI reads them: the flags (and YAML ``config``), merged and built."""
    args = vars(flags(cls).parse_args(argv))
    namespace = argparse.Namespace(**{**required, **args, "config": str(config) if config else None})
    return from_args(cls, namespace, section=section)


PRECOMPUTE_CASES = [
    (["--layers", "decoder:2,4", "encoder:1,3"], ["--decoder-layers", "2,4", "--encoder-layers", "1,3"]),
    (["--layers", "1", "decoder:none"], ["--layers", "1", "--decoder-layers", "none"]),
    (["--attention-layers", "encoder:1", "decoder:2", "cross:1,2"],
     ["--encoder-attention-layers", "1", "--decoder-attention-layers", "2", "--cross-attention-layers", "1,2"]),
    (["--layers", "all decoder:-1", "--attention-layers", "2", "cross:1"],
     ["--attention-layers", "2", "--decoder-layers", "-1", "--cross-attention-layers", "1"]),
]


@pytest.mark.parametrize(("new", "old"), PRECOMPUTE_CASES)
def test_precompute_per_stream_flags_equal_the_old_flags(places, new, old) -> None:
    required = places["precompute"]
    assert parse(PrecomputeOptions, new, required) == parse(PrecomputeOptions, old, required)


def test_precompute_yaml_mappings_equal_the_old_keys(places, tmp_path, capsys) -> None:
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"precompute": {
        "layers": {"encoder": [1, 3], "decoder": "2,4"}, "attention_layers": {"cross": [2], "": "1"}}}))
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"precompute": {
        "encoder_layers": [1, 3], "decoder_layers": "2,4", "cross_attention_layers": [2], "attention_layers": "1"}}))
    required = places["precompute"]
    got = parse(PrecomputeOptions, [], required, new, "precompute")
    assert "deprecated" not in capsys.readouterr().err  # the new spelling says nothing
    assert got == parse(PrecomputeOptions, [], required, old, "precompute")
    assert capsys.readouterr().err.count("deprecated") == 3  # one note per old key
    targets = got.targets  # type: ignore[attr-defined]
    assert targets.layers == StreamLayers.of([("", "all"), ("encoder", "1,3"), ("decoder", "2,4")])
    assert targets.attention_layers.get("cross") == ("2",) and targets.attention_layers.get("") == ("1",)
    # plain single-stream values work as before, from YAML and from the flags
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"precompute": {"layers": [2, 4]}}))
    assert parse(PrecomputeOptions, [], required, plain, "precompute").targets.layers.get("") == ("2", "4")
    assert parse(PrecomputeOptions, ["--layers", "2,4"], required).targets.layers == StreamLayers.parse("2,4")


TRAIN_CASES = [
    (["--layer-map", "last", "decoder:explicit:1-2"], ["--layer-map", "last", "--decoder-layer-map", "explicit:1-2"]),
    (["--layer-map", "encoder:reverse", "decoder:none"],
     ["--encoder-layer-map", "reverse", "--decoder-layer-map", "none"]),
    (["--attention-layers", "cross:none"], ["--cross-attention-map", "none"]),
    (["--attention-layers", "explicit:1-2", "cross:explicit:1-1"],
     ["--attention-layers", "explicit:1-2", "--cross-attention-map", "explicit:1-1"]),
]


@pytest.mark.parametrize(("new", "old"), TRAIN_CASES)
def test_train_per_stream_maps_equal_the_old_flags(places, new, old) -> None:
    required = places["train"]
    got = parse(TrainOptions, new, required)
    assert got == parse(TrainOptions, old, required)
    assert got.to_dict() == parse(TrainOptions, old, required).to_dict()  # type: ignore[attr-defined]


def test_train_yaml_mapping_of_maps(places, tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"train": {"layer_map": {"encoder": "last", "decoder": "explicit:1-2, 2-4"},
                                                "attention_layers": {"cross": "none"}}}))
    maps = parse(TrainOptions, [], places["train"], config, "train").maps  # type: ignore[attr-defined]
    assert maps.for_stream("") == LayerMap("uniform") and maps.for_stream("encoder") == LayerMap("last")
    assert maps.for_stream("decoder").pairs == ((1, 2), (2, 4))
    assert maps.attention_map("cross") == LayerMap("none") and maps.attention_map("decoder") is None
    assert str(maps.layer_map) == "uniform encoder:last decoder:explicit:1-2,2-4"
    assert StreamMaps.parse(str(maps.layer_map)) == maps.layer_map  # the text options.json keeps reads back


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_each_alias_prints_one_deprecation_note_naming_the_new_spelling(places, alias, capsys) -> None:
    option, stream = ALIASES[alias]
    cls = TrainOptions if alias.endswith("map") else PrecomputeOptions
    value = "explicit:1-2" if cls is TrainOptions else "1"
    got = parse(cls, ["--" + alias.replace("_", "-"), value], places["train" if cls is TrainOptions else "precompute"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert len(notes) == 1 and notes[0].startswith(NOTE_PREFIX)  # so --quiet lets it through
    assert f"--{option.replace('_', '-')} {stream}:{value}" in notes[0] and f"--{alias.replace('_', '-')}" in notes[0]
    group = got.maps if cls is TrainOptions else got.targets  # type: ignore[attr-defined]
    held = getattr(group, option).get(stream)
    assert held == (LayerMap.parse(value) if cls is TrainOptions else (value,))


def test_bad_per_stream_values_are_named(places) -> None:
    required = places["precompute"]
    with pytest.raises(ConfigError) as err:
        build(PrecomputeOptions, {**required, "layers": "cross:1", "decoder_attention_layers": "x"})
    problems = "\n".join(err.value.problems)
    assert "stream 'cross' has no layers" in problems
    assert "decoder_attention_layers: got ['x'], expected 'all' or a list of layer numbers" in problems
    with pytest.raises(ConfigError, match="attention_layers: got 'encoder:1 encoder:2', stream 'encoder' is given "
                                          "twice"):
        build(PrecomputeOptions, {**required, "attention_layers": "encoder:1 encoder:2", "cross_attention_layers": 1})
    with pytest.raises(ConfigError, match="attention_layers: got 'encoder:1 encoder:2', stream 'encoder' is given "
                                          "twice"):  # the same message without an alias to merge
        build(PrecomputeOptions, {**required, "attention_layers": "encoder:1 encoder:2"})
    with pytest.raises(ConfigError, match="layer_map: got 'last cross:none'; the cross-attention map is "
                                          "--attention-layers cross:MAP"):
        build(TrainOptions, {**places["train"], "layer_map": "last cross:none"})
    with pytest.raises(ConfigError, match="unknown stream 'middle'"):
        build(TrainOptions, {**places["train"], "layer_map": {"middle": "last"}})
    with pytest.raises(StreamValueError, match="given twice"):
        StreamLayers.of([("decoder", "1"), ("decoder", "2")])


def test_an_alias_of_another_command_is_an_unknown_key(places) -> None:
    with pytest.raises(ConfigError, match="unknown key 'decoder_layers'"):
        build(TrainOptions, {**places["train"], "decoder_layers": "1"})


def test_the_note_passes_quiet(places, capsys) -> None:
    """Under --quiet only lines beginning ``kdcache `` reach stderr: the deprecation note is one of them."""
    from kdcache.pipeline.quiet import quiet

    with quiet():
        print("a library line", file=sys.stderr)
        build(TrainOptions, {**places["train"], "decoder_layer_map": "last"})
    err = capsys.readouterr().err
    assert "a library line" not in err
    assert "--decoder-layer-map (YAML decoder_layer_map) is deprecated; write --layer-map decoder:last" in err


def test_init_student_takes_per_stack_blocks_and_the_old_flags(tmp_path, capsys) -> None:
    from kdcache.pipeline.cli import main
    from tests.helpers.tiny_models import make_tiny_bart

    teacher = str(make_tiny_bart(tmp_path / "bart"))
    assert main(["init-student", "--teacher", teacher, "--layers", "encoder:2", "decoder:1,2", "--out",
                 str(tmp_path / "new")]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main(["init-student", "--teacher", teacher, "--encoder-layers", "2", "--decoder-layers", "1,2", "--out",
                 str(tmp_path / "old")]) == 0
    assert capsys.readouterr().err.count("deprecated") == 2
    new, old = ((tmp_path / name / "kdcache_init.json").read_text() for name in ("new", "old"))
    assert new == old and '"teacher_encoder_blocks": [\n    2\n  ]' in new
    assert main(["init-student", "--teacher", teacher, "--layers", "decoder:x", "--out", str(tmp_path / "x")]) == 2
    assert "--layers decoder:'x': expected comma-separated block numbers" in capsys.readouterr().err


def test_a_stack_value_for_a_one_stream_teacher_is_refused(tmp_path, capsys) -> None:
    from kdcache.pipeline.cli import main
    from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts, write_text_dataset

    gpt2, data = make_tiny_gpt2(tmp_path / "gpt2"), write_text_dataset(tmp_path / "t.jsonl", sample_texts(4))
    assert main(["precompute", "--teacher", str(gpt2), "--data", str(data), "--out", str(tmp_path / "c"),
                 "--layers", "1", "decoder:2", "--attention-layers", "cross:1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "layers decoder:2, attention_layers cross:1: only for encoder-decoder teachers" in err
    assert not (tmp_path / "c" / "manifest.json").exists()
