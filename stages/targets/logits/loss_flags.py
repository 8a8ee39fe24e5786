"""Stage two's logit KL flags, ``LogitLossFlags`` (``--temperature``, ``--topk-kl``), held whole by
``LossOptions.logit`` and read by a kind's ``loss_problems`` (``base.LogitKind``), with their defaults."""

from __future__ import annotations

from dataclasses import dataclass

from kdcache.stages.common.option_groups import option

DEFAULT_TEMPERATURE = 2.0  # stage two's --temperature when none is given and the cache does not fix one
TOPK_VARIANTS = ("renorm", "other")  # --topk-kl's choices


@dataclass(frozen=True)
class LogitLossFlags:
    """Stage two's logit KL as the flags give it: the KD temperature (None until the cache's default fills it in,
    ``TrainOptions.with_cache_defaults``) and the top-k variant."""

    temperature: float | None = option(None, f"KD temperature T of the logit KL (default: a sampled cache's "
                                             f"sampling temperature, else {DEFAULT_TEMPERATURE:g})")
    topk_kl: str = option("renorm", "top-k KL variant for top-k caches", choices=list(TOPK_VARIANTS))

    def resolved_temperature(self) -> float:
        """``--temperature``, or the default where nothing decided it (``TrainOptions.with_cache_defaults`` fills
        in a sampled cache's own before training)."""
        return DEFAULT_TEMPERATURE if self.temperature is None else self.temperature

    def problems(self) -> list[str]:
        """Every problem of these flags alone (against the cache: the kind's ``loss_problems``)."""
        bad = self.temperature is not None and not self.temperature > 0  # not >: NaN is refused too
        return [f"temperature must be > 0, got {self.temperature}"] if bad else []
