"""``DistillationArguments``: ``TrainingArguments`` that also carry ``kdcache train``'s loss and map options, typed,
the way TRL's ``GKDConfig`` extends ``SFTConfig``: ``HfArgumentParser`` makes flags of them, and a YAML or JSON
config holds them beside ``learning_rate`` and ``output_dir``. ``CacheTrainer`` reads them from its ``args``.

``beta`` is the weight of the logit KL term here (``kdcache train --beta``); in TRL's GKD it is the interpolation
coefficient of the generalised Jensen-Shannon divergence, a different thing under the same name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from kdcache.stages.train.api import ApiError
from kdcache.stages.train.core import LossOptions, MapOptions


def _help(name: str) -> dict[str, Any]:
    """The ``help`` of ``kdcache train``'s option ``name``, for ``HfArgumentParser``'s flag."""
    known = {f.name: f for group in (LossOptions, MapOptions) for f in dataclasses.fields(group)}
    text = str(known[name].metadata.get("help", "")) if name in known else ""
    return {"help": f"kdcache: {text} (None: kdcache train's default)"}


@dataclass
class DistillationArguments(TrainingArguments):
    """``TrainingArguments`` plus the loss and map options of ``kdcache train``, by the names ``DistillationLoss``
    takes; None leaves an option to ``kdcache train``'s default (or the cache's). Maps are text
    (``"explicit:1-2,2-4"``). ``eval_cache`` names a held-out cache for ``evaluate()`` and ``eval_strategy``.

    Note: ``beta`` weighs the logit KL term; TRL's GKD uses ``beta`` for its JSD interpolation instead.
    """

    alpha: float | None = field(default=None, metadata=_help("alpha"))
    beta: float | None = field(default=None, metadata=_help("beta"))
    gamma: float | None = field(default=None, metadata=_help("gamma"))
    delta: float | None = field(default=None, metadata=_help("delta"))
    temperature: float | None = field(default=None, metadata=_help("temperature"))
    hidden_loss: str | None = field(default=None, metadata=_help("hidden_loss"))
    topk_kl: str | None = field(default=None, metadata=_help("topk_kl"))
    attention_loss: str | None = field(default=None, metadata=_help("attention_loss"))
    relation_heads: int | None = field(default=None, metadata=_help("relation_heads"))
    critic_steps: int | None = field(default=None, metadata=_help("critic_steps"))
    critic_lr: float | None = field(default=None, metadata=_help("critic_lr"))
    layer_map: str | None = field(default=None, metadata=_help("layer_map"))
    attention_layers: str | None = field(default=None, metadata=_help("attention_layers"))
    eval_cache: str | None = field(default=None, metadata={
        "help": "kdcache: a held-out cache the same teacher wrote with the same settings, scored by evaluate()"})

    def loss_options(self) -> dict[str, object]:
        """The loss and map options that are set, as ``DistillationLoss``'s keyword options."""
        names = [f.name for f in dataclasses.fields(DistillationArguments) if f.name in LOSS_FIELDS]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def options_of(args: TrainingArguments, given: dict[str, Any] | None) -> dict[str, Any]:
    """The loss options of a run: those ``args`` carries (``DistillationArguments``) and ``given`` (``CacheTrainer``'s
    ``loss_options``), the seed defaulting to ``args.seed`` (the projectors' init follows the run's seed).

    Raises:
        ApiError: an option set differently in both places.
    """
    from_args = args.loss_options() if isinstance(args, DistillationArguments) else {}
    given = given or {}
    clash = sorted(name for name in set(from_args) & set(given) if from_args[name] != given[name])
    if clash:
        raise ApiError("set twice, differently: " + "; ".join(f"{name}={from_args[name]!r} in the arguments and "
                       f"{given[name]!r} in loss_options" for name in clash) + "; expected one place for each")
    return {"seed": args.seed, **from_args, **given}


LOSS_FIELDS = frozenset(f.name for group in (LossOptions, MapOptions) for f in dataclasses.fields(group))
