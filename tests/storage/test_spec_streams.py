"""CacheSpec's layer mapping ``{stream: {kind: layers}}`` (issue 21) and the manifest keys it translates to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdcache.storage import CacheSpec
from kdcache.storage.core.canonical import canonical_json
from kdcache.storage.core.errors import SpecError

# Each case's "to_dict" is what the code before the layer mapping (commit 88158b7) wrote for "given": the specs of
# the format 1 and 2 fixtures, and format-4 specs of both kinds (tests/data/README.md).
CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "spec-translation" / "specs.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_manifests_written_before_the_mapping_read_the_same_and_round_trip_byte_identically(case) -> None:
    spec = CacheSpec.from_dict(case["given"])
    assert canonical_json(spec.to_dict()) == canonical_json(case["to_dict"])
    again = CacheSpec.from_dict(json.loads(canonical_json(spec.to_dict())))
    assert again == spec and again.layers == spec.layers


def test_the_mapping_is_what_the_old_keys_meant() -> None:
    old = {"num_sequences": 3, "layout": "seq2seq", "encoder_hidden_layers": [2, 0], "encoder_attention_layers": [1],
           "decoder_hidden_layers": [], "decoder_attention_layers": [2], "cross_attention_layers": [1, 2]}
    spec = CacheSpec.from_dict(old)
    assert spec.layers == {"encoder": {"hidden": (0, 2), "attention": (1,)},
                           "decoder": {"hidden": (), "attention": (2,), "cross_attention": (1, 2)}}
    assert spec == CacheSpec(num_sequences=3, layers={"encoder": {"hidden": [2, 0], "attention": [1]},
                                                      "decoder": {"attention": [2], "cross_attention": [1, 2]}})
    assert spec.is_encoder_decoder and spec.streams == ("encoder", "decoder")
    assert spec.stream_layers() == [("encoder", (0, 2), (1,)), ("decoder", (), (2,))]
    assert spec.layers_of("cross_attention", "decoder") == (1, 2) and spec.layers_of("hidden") == ()
    assert spec.hidden_layers == () and spec.attention_layers == ()  # the one-stream mirrors stay empty
    one = CacheSpec(num_sequences=3, hidden_layers=(4, 2), attention_layers=(4,))
    assert one.layers == {"": {"hidden": (2, 4), "attention": (4,)}} and not one.is_encoder_decoder
    assert one == CacheSpec(num_sequences=3, layers={"": {"hidden": (2, 4), "attention": [4]}})
    assert one.hidden_layers == (2, 4) and one.streams == ("",)


@pytest.mark.parametrize(("layers", "message"), [
    ({"encoder": {"hidden": [1]}}, r"streams \['encoder'\]; expected \[''\] .* or \['encoder', 'decoder'\]"),
    ({"": {"cross_attention": [1]}}, r"layers\[''\] has kinds \['cross_attention'\]"),
    ({"encoder": {"hidden": [1], "cross_attention": [1]}, "decoder": {}}, r"layers\['encoder'\] has kinds"),
    ({"": {"attention": [0]}}, r"attention layers \[0\] has a layer below 1"),
])
def test_bad_mappings_are_refused_naming_what_is_wrong(layers, message) -> None:
    with pytest.raises(SpecError, match=message):
        CacheSpec(num_sequences=1, layers=layers)


def test_one_stream_conveniences_cannot_contradict_the_mapping() -> None:
    with pytest.raises(SpecError, match="per stream"):
        CacheSpec(num_sequences=1, hidden_layers=(1,), layers={"encoder": {}, "decoder": {}})
    with pytest.raises(SpecError, match="give the layers once"):
        CacheSpec(num_sequences=1, hidden_layers=(1,), layers={"": {"hidden": [2]}})
    same = CacheSpec(num_sequences=1, hidden_layers=(1,), layers={"": {"hidden": [1]}})
    assert same.layers[""]["hidden"] == (1,)
    with pytest.raises(SpecError, match="unknown layout 'triple'"):
        CacheSpec.from_dict({"num_sequences": 1, "layout": "triple"})
    with pytest.raises(SpecError, match=r"unknown spec field\(s\) \['layers'\]"):  # not a manifest key
        CacheSpec.from_dict({"num_sequences": 1, "layers": {"": {}}})
