"""``DistillationArguments``: ``TrainingArguments`` that also carry ``kdcache train``'s loss and map options, typed,
the way TRL's ``GKDConfig`` extends ``SFTConfig``: ``HfArgumentParser`` makes flags of them, and a YAML or JSON
config holds them beside ``learning_rate`` and ``output_dir``. ``CacheTrainer`` reads them from its ``args``.

``beta`` is the weight of the logit KL term here (``kdcache train --beta``); in TRL's GKD it is the interpolation
coefficient of the generalised Jensen-Shannon divergence, a different thing under the same name.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transformers import TrainingArguments

from kdcache.stages.common.option_groups import leaves
from kdcache.stages.train.api import ApiError
from kdcache.stages.train.core.options import LossOptions, MapOptions

# The options the Python API refuses (``api.loss_options``: a student with another tokenizer trains through
# ``kdcache train --cross-tokenizer`` only), so the arguments do not carry them.
NOT_CARRIED = frozenset({"cross_tokenizer"})
SCALARS = (bool, int, float, str)  # the option types an argument keeps; any other (a map) is given as text
T = TypeVar("T")


def carried_fields() -> list[dataclasses.Field[Any]]:
    """The fields of ``kdcache train``'s loss and map options that ``DistillationArguments`` carries, in order (a
    family's group's in its place)."""
    return [f for group in (LossOptions, MapOptions) for _, _, f in leaves(group) if f.name not in NOT_CARRIED]


def _argument_type(option_type: object) -> object:
    """An option's type as an argument: ``T | None`` for an option of a scalar type ``T`` (None: the option's own
    default), ``str | None`` for any other (a map, ``StreamMaps``, is text parsed where the options are built)."""
    [inner] = [t for t in typing.get_args(option_type) or (option_type,) if t is not type(None)]
    kept = typing.cast(type, inner) if inner in SCALARS else str
    return kept | None


def _carry_options(cls: type[T]) -> type[T]:
    """Add to ``cls``, ahead of its own, one field per carried option (``carried_fields``): its type as an
    argument, default None, the option's help. The one definition of each stays the option's (no copy to drift)."""
    hints = {f.name: typing.get_type_hints(owner)[f.name] for group in (LossOptions, MapOptions)
             for _, owner, f in leaves(group)}
    added: dict[str, object] = {}
    for option in carried_fields():
        added[option.name] = _argument_type(hints[option.name])
        help_text = f"kdcache: {option.metadata.get('help', '')} (None: kdcache train's default)"
        setattr(cls, option.name, field(default=None, metadata={"help": help_text}))
    cls.__annotations__ = {**added, **cls.__annotations__}  # read next by @dataclass
    return cls


@dataclass
@_carry_options
class DistillationArguments(TrainingArguments):
    """``TrainingArguments`` plus the loss and map options of ``kdcache train``, by the names ``DistillationLoss``
    takes; None leaves an option to ``kdcache train``'s default (or the cache's). Maps are text
    (``"explicit:1-2,2-4"``). ``eval_cache`` names a held-out cache for ``evaluate()`` and ``eval_strategy``.

    The option fields are made from ``LossOptions`` and ``MapOptions`` (``carried_fields``), so a new option is
    carried here too (``beta``: see the module docstring).
    """

    eval_cache: str | None = field(default=None, metadata={
        "help": "kdcache: a held-out cache the same teacher wrote with the same settings, scored by evaluate()"})

    def loss_options(self) -> dict[str, object]:
        """The loss and map options that are set, as ``DistillationLoss``'s keyword options."""
        names = [f.name for f in carried_fields()]
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

