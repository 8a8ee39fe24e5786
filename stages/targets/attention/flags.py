"""``AttentionFlags``: stage one's attention flag, declared in the family and held whole by stage one's options
(``TargetOptions.attention``, an ``option_group``: the flag and YAML key stay flat)."""

from __future__ import annotations

from dataclasses import dataclass

from kdcache.stages.common.option_groups import option
from kdcache.stages.targets.attention.base import AttentionSettings, choices, get, usage
from kdcache.storage import DEFAULT_ATTENTION_SOURCE


@dataclass(frozen=True)
class AttentionFlags:
    """The attention source as the flag names it. Its help lists the sources registered when this module loads
    (every built-in one: the package imports it after them); its choices follow any registered later."""

    attention_source: str = option(DEFAULT_ATTENTION_SOURCE, usage(), choices=choices())

    def settings(self) -> AttentionSettings:
        """The source as the one record the targets carry into the spec (``AttentionSourceError`` for a name no
        source has)."""
        return AttentionSettings(get(self.attention_source))
