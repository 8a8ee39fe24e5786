"""Layer maps: the formulas of DESIGN.md for several depths, parsing, and validation messages."""

from __future__ import annotations

import math

import pytest

from kdcache.stages.train.core.layer_maps import (
    LAYER_MAP_KINDS,
    LayerMap,
    LayerMapError,
    LayerMapKind,
    pair_key,
    parse_layer_map,
    validate_layer_map,
)
from kdcache.storage.core.errors import KdcacheError

DEPTHS = [(4, 12), (6, 12), (3, 4), (5, 7), (1, 6), (6, 6), (1, 1)]


def map_pairs(text: str, m: int, n: int, *, seed: int = 0) -> list[tuple[int, int]]:
    """The pairs of the map ``text`` as ``--layer-map`` reads it, for a student of m blocks and a teacher of n."""
    return LayerMap.parse(text).build(m, n, seed=seed)


@pytest.mark.parametrize("m,n", DEPTHS)
def test_uniform_is_one_based_and_reaches_the_last_block(m, n):
    pairs = map_pairs("uniform", m, n)
    assert pairs == [(j, math.floor(j * n / m)) for j in range(1, m + 1)]
    assert pairs[-1] == (m, n)  # seed 004's int(i*N/M) over i = 0..M-1 never gets here
    assert all(1 <= t <= n for _, t in pairs)


def test_known_values():
    assert map_pairs("uniform", 4, 12) == [(1, 3), (2, 6), (3, 9), (4, 12)]
    assert map_pairs("uniform", 3, 4) == [(1, 1), (2, 2), (3, 4)]
    assert map_pairs("last", 4, 12) == [(1, 9), (2, 10), (3, 11), (4, 12)]
    assert map_pairs("reverse", 4, 12) == [(1, 12), (2, 9), (3, 6), (4, 3)]
    assert map_pairs("all-to-one", 3, 7) == [(1, 4), (2, 4), (3, 4)]
    assert map_pairs("all-to-one", 2, 12) == [(1, 6), (2, 6)]


@pytest.mark.parametrize("m,n", DEPTHS)
def test_last_reverse_all_to_one(m, n):
    assert map_pairs("last", m, n) == [(j, n - m + j) for j in range(1, m + 1)]
    uniform = [t for _, t in map_pairs("uniform", m, n)]
    assert map_pairs("reverse", m, n) == list(zip(range(1, m + 1), reversed(uniform)))
    assert map_pairs("all-to-one", m, n) == [(j, math.ceil(n / 2)) for j in range(1, m + 1)]


def test_equal_depths_map_identity():
    for kind in ("uniform", "last"):
        assert map_pairs(kind, 6, 6) == [(j, j) for j in range(1, 7)]


def test_random_is_seeded_permutation_of_uniform():
    uniform = [t for _, t in map_pairs("uniform", 6, 24)]
    maps = {seed: map_pairs("random", 6, 24, seed=seed) for seed in range(6)}
    for pairs in maps.values():
        assert [s for s, _ in pairs] == list(range(1, 7))
        assert sorted(t for _, t in pairs) == sorted(uniform)
    assert maps[3] == map_pairs("random", 6, 24, seed=3)
    assert len({tuple(p) for p in maps.values()}) > 1  # the seed matters


def test_explicit_none_and_embeddings():
    assert map_pairs("explicit: 1-2, 2-4", 2, 4) == [(1, 2), (2, 4)]
    assert map_pairs("explicit:1-2,2-4", 2, 4) == [(1, 2), (2, 4)]
    assert LayerMap(LayerMapKind.EXPLICIT, ((2, 4), (1, 1))).build(2, 4) == [(2, 4), (1, 1)]
    assert map_pairs("none", 2, 4) == []
    assert map_pairs("explicit:0-0,1-2", 2, 4) == [(0, 0), (1, 2)]  # the embeddings, as an explicit pair
    assert parse_layer_map("0-0,3-12") == [(0, 0), (3, 12)]
    assert pair_key((2, 4)) == "s2_t4"


@pytest.mark.parametrize("spec", ["1-2,x-4", "1:2", "1-2-3", "", " , ", "-1-2"])
def test_bad_explicit_specs_are_clear_errors(spec):
    with pytest.raises(LayerMapError, match="pair|no pairs"):
        map_pairs(f"explicit:{spec}", 2, 4)


def test_unknown_kind_and_impossible_depths():
    with pytest.raises(LayerMapError) as info:
        map_pairs("skipping", 2, 4)
    assert all(kind in str(info.value) for kind in LAYER_MAP_KINDS)
    with pytest.raises(LayerMapError, match="M=5, N=4"):
        map_pairs("uniform", 5, 4)
    with pytest.raises(LayerMapError, match="explicit:S-T"):
        map_pairs("explicit", 2, 4)
    with pytest.raises(LayerMapError, match="non-negative"):
        LayerMap(LayerMapKind.EXPLICIT, ((1, -2),)).build(2, 4)


def test_validate_names_missing_teacher_layers():
    with pytest.raises(LayerMapError) as info:
        validate_layer_map([(1, 3), (2, 4), (3, 5)], 3, [2, 4, 6])
    message = str(info.value)
    assert isinstance(info.value, KdcacheError)
    assert "teacher hidden layers 3, 5" in message and "holds 2, 4, 6" in message and "--layers" in message


def test_validate_names_bad_student_layers_and_accepts_good_maps():
    with pytest.raises(LayerMapError, match="student layer\\(s\\) 5, 7 .*0..4"):
        validate_layer_map([(5, 2), (7, 2), (1, 2)], 4, [2])
    validate_layer_map([(0, 0), *map_pairs("uniform", 4, 12)], 4, [0, 3, 6, 9, 12])
    validate_layer_map([], 4, [])
    with pytest.raises(LayerMapError, match="attention layers 6 .*holds none"):
        validate_layer_map([(1, 6)], 4, [], what="attention")


def test_maps_are_parsed_once_where_the_config_is_read(tmp_path) -> None:
    from kdcache.pipeline.config import ConfigError, build
    from kdcache.stages.train.core.options import TrainOptions

    for text in ("uniform", "last", "none", "explicit:0-0,1-2", ""):
        assert str(LayerMap.parse(text)) == text and LayerMap.parse(str(LayerMap.parse(text))) == LayerMap.parse(text)
    assert LayerMap.parse("last-k") == LayerMap("last") and LayerMap.parse(" explicit:1-2, 2-4").pairs == ((1, 2), (2, 4))
    base = {"cache": "c", "student": str(tmp_path), "out": "o"}
    options = build(TrainOptions, {**base, "layer_map": "last-k", "decoder_layer_map": "explicit:1-2"})
    assert options.maps.layer_map.get("") == LayerMap("last") and options.maps.for_stream("decoder").pairs == ((1, 2),)
    # options.json holds the per-stream map as its canonical text (the unprefixed map first)
    assert options.maps.for_stream("encoder") == LayerMap("last")
    assert options.to_dict()["layer_map"] == "last decoder:explicit:1-2"
    with pytest.raises(ConfigError) as err:
        build(TrainOptions, {**base, "layer_map": "sideways", "decoder_layer_map": "explicit:1-2,2-x"})
    bad, unknown = sorted(err.value.problems)
    assert bad.startswith("decoder_layer_map: got 'explicit:1-2,2-x', cannot read layer pair '2-x'")
    assert unknown.startswith("layer_map: got 'sideways', unknown map 'sideways'") and "all-to-one" in unknown
    with pytest.raises(ConfigError, match="layer_map: got '', expected a map"):  # only per-stream maps may be empty
        build(TrainOptions, {**base, "layer_map": ""})
    with pytest.raises(LayerMapError, match="2-x"):
        map_pairs("explicit:1-2,2-x", 2, 4)
