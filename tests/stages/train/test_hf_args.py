"""``DistillationArguments`` carries ``kdcache train``'s loss and map options with fields made from the options
records themselves (``hf_args.carried_fields``): the same names, help and order, default None, so that the two
cannot drift."""

from __future__ import annotations

import dataclasses
import typing

from transformers import HfArgumentParser, TrainingArguments

from kdcache.stages.common.option_groups import leaves
from kdcache.stages.train.core.options import LossOptions, MapOptions
from kdcache.stages.train.hf_args import NOT_CARRIED, DistillationArguments


def test_every_loss_and_map_option_is_an_argument_with_its_help_and_default_none() -> None:
    options = [f for group in (LossOptions, MapOptions) for _, _, f in leaves(group) if f.name not in NOT_CARRIED]
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = [f for f in dataclasses.fields(DistillationArguments) if f.name not in own]
    assert [f.name for f in added] == [f.name for f in options] + ["eval_cache"]
    hints = typing.get_type_hints(DistillationArguments)
    for option, argument in zip(options, added):
        assert argument.default is None and hints[argument.name] in (float | None, int | None, str | None)
        assert argument.metadata["help"] == f"kdcache: {option.metadata['help']} (None: kdcache train's default)"
    assert NOT_CARRIED == {"cross_tokenizer"}  # kdcache train --cross-tokenizer only (api.loss_options refuses it)


def test_flags_parse_to_the_options_types_and_only_set_ones_are_loss_options() -> None:
    (args,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--gamma", "0.5", "--relation_heads", "2", "--hidden_loss", "cka",
         "--attention_layers", "explicit:1-2"])
    assert args.loss_options() == {"hidden_loss": "cka", "gamma": 0.5, "relation_heads": 2,
                                   "attention_layers": "explicit:1-2"}
    assert isinstance(args.relation_heads, int) and args.alpha is None and args.eval_cache is None
