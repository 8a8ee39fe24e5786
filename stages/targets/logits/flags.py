"""``LogitFlags``: stage one's logit flags, their checks and the ``LogitSettings`` they make, declared once in the
family and held whole by stage one's options (``TargetOptions.logit``, an ``option_group``: flags and YAML keys stay
flat). A new flag is a field here, its check in ``problems`` and its use in a kind's ``spec_fields`` (through
``base.LogitOptions``). ``LogitLossFlags``: stage two's logit KL flags, held the same way by ``LossOptions.logit``
and read by a kind's ``loss_problems`` (through ``base.LossSettings``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kdcache.stages.common.option_groups import option
from kdcache.stages.targets.logits.base import LogitKind, LogitKindError, LogitSettings, get, names, parse
from kdcache.stages.targets.logits.topk import TOPK_VARIANTS
from kdcache.storage import ArrayKind

DEFAULT_LOGITS = "topk"  # the --logits mode when none is given (a name of stages.targets.logits)
FULL_LOGITS = "full"  # the mode the older flag --full-logits asks for
DEFAULT_TEMPERATURE = 2.0  # stage two's --temperature when none is given and the cache does not fix one


@dataclass(frozen=True)
class LogitFlags:
    """The logit mode and its fields as the flags give them (``settings`` turns them into the targets' record)."""

    top_k: int = option(64, "logits kept per token (top-k with logsumexp)")
    full_logits: bool = option(False, "cache the full [tokens, vocab] logits instead of top-k (same as --logits full)")
    logits_mode: str = option(DEFAULT_LOGITS, "what feature 'logits' stores: topk (--top-k values, ids and the "
                                      "logsumexp), full, sampled:N (N draws per token from the teacher's softmax at "
                                      "--sample-temperature, kept as distinct ids, counts and log-probs), or head "
                                      "(nothing per token: the last hidden layer plus a copy of the teacher's LM "
                                      "head, from which stage two computes exact logits)", aliases=["--logits"],
                              metavar="MODE")
    topk_values: str = option("fp16", "how --logits topk stores its values: fp16 (the logits, with their logsumexp) "
                                      "or logprob (log-probabilities quantised to steps of twice --logprob-tolerance, "
                                      "each shard recording its largest error; a quarter fewer bytes at top-128)",
                              choices=["fp16", "logprob"])
    logprob_tolerance: float = option(0.01, "--topk-values logprob: the largest error of a stored log-probability, "
                                            "0.001..1 (log-probs below 65,535 steps, -1,304 nats at 0.01, are "
                                            "clipped and counted)")
    sample_temperature: float = option(1.0, "temperature of the teacher's softmax that --logits sampled:N draws "
                                            "from (stage two's KL then runs at this temperature)")

    @property
    def mode(self) -> str:
        """The ``--logits`` value the flags ask for (``sampled:12``; ``full`` with ``--full-logits``)."""
        return FULL_LOGITS if self.full_logits else self.logits_mode

    def kind(self) -> LogitKind | None:
        """The kind of the mode the flags ask for (None: no kind has that name, which ``problems`` reports)."""
        name = self.mode.partition(":")[0]
        return get(name) if name in names() else None

    def settings(self, features: Collection[str]) -> LogitSettings:
        """The mode and its fields as the one record the targets carry into the spec (no mode without feature
        ``logits`` among ``features``), from flags that passed ``problems`` (else a ``LogitKindError``)."""
        if ArrayKind.LOGITS not in features:
            return LogitSettings(None, sample_temperature=self.sample_temperature)
        kind, argument = parse(self.mode)
        return LogitSettings(kind, sample_temperature=self.sample_temperature, **kind.spec_fields(self, argument))

    def problems(self, features: Collection[str]) -> list[str]:
        """Every problem of the flags with the run's ``features`` (none given: logits by default)."""
        problems = []
        try:
            kind = parse(self.logits_mode)[0]
        except LogitKindError as exc:
            problems.append(str(exc))
        else:  # the mode's own options (top-k's k), when it is the one cached
            problems += kind.option_problems(self) if ArrayKind.LOGITS in features and self.kind() is kind else []
        if self.full_logits and self.logits_mode != DEFAULT_LOGITS:
            problems.append(f"full_logits: --full-logits and --logits {self.logits_mode} ask for two logit modes; "
                            f"keep one (--logits full is the same as --full-logits)")
        if not 1e-3 <= self.logprob_tolerance <= 1:  # 65,535 steps must reach far below any top-k's tail
            problems.append(f"logprob_tolerance: got {self.logprob_tolerance}, expected a value in [0.001, 1] (the "
                            f"stored range is 65,535 steps: 130 nats at 0.001)")
        return problems + self._value_problems(not features or ArrayKind.LOGITS in features)

    def _value_problems(self, cached: bool) -> list[str]:
        """``--topk-values`` against the mode cached (``cached``: logits are), and the temperature."""
        problems = []
        stored = self.kind() if cached else None
        if self.topk_values == "logprob" and not (stored is not None and stored.logprob_values):
            problems.append(f"topk_values: logprob stores top-k logits, and this run caches "
                            f"{self.mode.partition(':')[0] if cached else 'no'} logits; drop --topk-values, or "
                            f"cache top-k logits")
        if not self.sample_temperature > 0:
            problems.append(f"sample_temperature: got {self.sample_temperature}, must be > 0")
        return problems


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
        bad = self.temperature is not None and self.temperature <= 0
        return [f"temperature must be > 0, got {self.temperature}"] if bad else []
