"""Stage two's loss flags are declared by their families (issue 57, slice K) and held by ``LossOptions`` as option
groups, each in the place its flags were: the flags, YAML keys, ``RUN/options.json`` and messages stay flat and in
their order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kdcache.pipeline.config import ConfigError, build
from kdcache.stages.common.option_groups import leaves
from kdcache.stages.targets.attention.flags import AttentionLossFlags
from kdcache.stages.targets.hidden.hidden_losses import HIDDEN_LOSSES, CriticFlags, HiddenLossFlags
from kdcache.stages.targets.logits.loss_flags import DEFAULT_TEMPERATURE, LogitLossFlags
from kdcache.stages.train.core.options import LossOptions, TrainOptions

LOSS_KEYS = ["hidden_loss", "alpha", "beta", "gamma", "delta", "temperature", "topk_kl", "critic_steps", "critic_lr",
             "attention_loss", "relation_heads", "cross_tokenizer"]  # the order of --help and options.json


def _build(tmp_path: Path, **values: object) -> TrainOptions:
    (tmp_path / "config.json").write_text("{}")
    return build(TrainOptions, {"cache": "c", "student": str(tmp_path / "config.json"), "out": str(tmp_path / "run"),
                                **values})


def test_each_family_declares_its_flags_in_their_old_place() -> None:
    owners = [(f.name, owner) for _, owner, f in leaves(LossOptions)]
    assert [name for name, _ in owners] == LOSS_KEYS
    family = {HiddenLossFlags: {"hidden_loss"}, LogitLossFlags: {"temperature", "topk_kl"},
              CriticFlags: {"critic_steps", "critic_lr"}, AttentionLossFlags: {"attention_loss", "relation_heads"}}
    assert {owner: {n for n, o in owners if o is owner} for owner in family} == family
    assert {n for n, o in owners if o is LossOptions} == {"alpha", "beta", "gamma", "delta", "cross_tokenizer"}


def test_flat_keys_reach_the_groups_and_options_json_stays_flat(tmp_path: Path) -> None:
    options = _build(tmp_path, hidden_loss="wgan", temperature="1.5", topk_kl="other", critic_steps="3",
                     attention_loss="relation", relation_heads="2")
    loss = options.loss
    assert loss.hidden.loss() is HIDDEN_LOSSES["wgan"] and loss.critic == CriticFlags(3, 1e-4)
    assert (loss.logit, loss.attention) == (LogitLossFlags(1.5, "other"), AttentionLossFlags("relation", 2))
    written = options.to_dict()
    assert [key for key in written if key in LOSS_KEYS] == LOSS_KEYS
    assert [written[k] for k in LOSS_KEYS[5:11]] == [1.5, "other", 3, 1e-4, "relation", 2]
    no_logits = SimpleNamespace(logits=None, logit_layout=None)  # the cache's defaults land in the logit group
    resolved, said = _build(tmp_path).with_cache_defaults(no_logits)  # type: ignore[arg-type]
    assert resolved.loss.logit.temperature == DEFAULT_TEMPERATURE and resolved.loss.beta == 0.0 and said


def test_each_familys_problems_keep_the_old_order(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _build(tmp_path, alpha=-1, critic_steps=0, temperature=0, relation_heads=-2, gamma=-1)
    assert err.value.problems == ["alpha must be >= 0, got -1.0", "gamma must be >= 0, got -1.0",
                                  "relation_heads must be >= 0, got -2", "temperature must be > 0, got 0.0",
                                  "critic_steps must be >= 1, got 0"]
