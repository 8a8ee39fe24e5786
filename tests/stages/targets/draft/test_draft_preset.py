"""``--layers draft``: the three layers an EAGLE-3 draft fuses, resolved against the target's depth."""

import pytest

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.targets import parse_layers
from kdcache.stages.targets.draft.draft_layers import draft_layers, is_draft_preset


def test_draft_preset_is_eagle3s_low_middle_high_layers():
    # EAGLE-3's trainers capture block outputs 1, N//2 - 1, N - 4 (0-based), hidden states 2, N//2, N - 3.
    assert draft_layers(32) == (2, 16, 29)
    assert parse_layers(("draft",), 32, minimum=0, name="layers") == (2, 16, 29)
    assert parse_layers(("DRAFT",), 8, minimum=0, name="layers") == (2, 4, 5)


def test_draft_preset_on_a_shallow_target_names_its_depth():
    with pytest.raises(PrecomputeError, match="at least 5 blocks; this target has 4"):
        parse_layers(("draft",), 4, minimum=0, name="layers")


def test_draft_preset_is_recognised_only_alone():
    assert is_draft_preset((" draft",)) and not is_draft_preset(("draft", "2"))
