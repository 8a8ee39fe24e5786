"""The one registry helper: entries in the order added, an unknown name refused naming every registered one."""

from __future__ import annotations

import pytest

from kdcache.storage import KdcacheError, Registry, SpecError, backend_names, hidden_codecs


class PlantedError(KdcacheError):
    """An error of the registry's own kind."""


def test_a_lookup_finds_an_entry_and_an_unknown_name_names_the_registered_ones() -> None:
    colours: Registry[int] = Registry("colour", PlantedError)
    assert colours.add("red", 1) == 1 and colours.add("blue", 2) == 2
    assert colours.lookup("blue") == 2 and colours.names() == ["red", "blue"]
    with pytest.raises(PlantedError, match=r"unknown colour 'green'; expected one of red, blue"):
        colours.lookup("green")
    with pytest.raises(PlantedError, match=r"unknown colour 3;"):
        colours.lookup(3)  # a name that is not a string (an edited manifest's) is refused, not hashed in


def test_every_registry_of_storage_is_one() -> None:
    from kdcache.storage.core.attention_source import ATTENTION_LAYOUTS
    from kdcache.storage.core.backend_registry import _IMPLEMENTATIONS
    from kdcache.storage.core.logit_layouts import LAYOUTS

    for registry in (ATTENTION_LAYOUTS, _IMPLEMENTATIONS, LAYOUTS, hidden_codecs.HIDDEN_CODECS):
        assert isinstance(registry, Registry)
    assert backend_names() == ["zarr", "arrow"]
    with pytest.raises(SpecError, match="unknown hidden codec 'int3'; expected one of .*fp16.*int8"):
        hidden_codecs.get("int3")
