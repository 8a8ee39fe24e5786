"""The attention family's flags, declared here and held whole by each stage's options through an ``option_group``
(flags and YAML keys stay flat): ``AttentionFlags``, stage one's source (``TargetOptions.attention``), and
``AttentionLossFlags``, stage two's attention term (``LossOptions.attention``)."""

from __future__ import annotations

from dataclasses import dataclass

from kdcache.stages.common.option_groups import option
from kdcache.stages.targets.attention.base import AttentionSettings, choices, get, usage
from kdcache.storage import DEFAULT_ATTENTION_SOURCE


@dataclass(frozen=True)
class AttentionFlags:
    """The attention source as the flag names it. Its help lists the sources registered when this module loads
    (every built-in one: importing this module loads the package, and with it the sources, first); its choices
    follow any registered later."""

    attention_source: str = option(DEFAULT_ATTENTION_SOURCE, usage(), choices=choices())

    def settings(self) -> AttentionSettings:
        """The source as the one record the targets carry into the spec (``AttentionSourceError`` for a name no
        source has)."""
        return AttentionSettings(get(self.attention_source))


ATTENTION_LOSSES = ("kl", "relation")  # relation: MiniLMv2's q-q / k-k / v-v relations (a q/k or q/k/v cache)


@dataclass(frozen=True)
class AttentionLossFlags:
    """Stage two's attention term (``--delta`` weighs it): which loss, and the relation loss's head count."""

    attention_loss: str = option("kl", "the attention term (--delta): kl (attention maps, or rebuilt block by block "
                                       "from a q/k cache) or relation (MiniLMv2: query-query, key-key and "
                                       "value-value relations of a q/k or q/k/v cache)", choices=list(ATTENTION_LOSSES))
    relation_heads: int = option(0, "--attention-loss relation: relation heads R, dividing both sides' widths (0: the "
                                    "student's heads)")

    def problems(self) -> list[str]:
        """Every problem of these flags (whether R divides the widths needs the cache and student: the plan's)."""
        return [f"relation_heads must be >= 0, got {self.relation_heads}"] if self.relation_heads < 0 else []
