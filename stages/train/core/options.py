"""Options of stage two (``kdcache train``).

The field names are the YAML keys of the ``train:`` section and, with dashes, the CLI flags; the flags named in
issue 4 (``--cache --student --out --deepspeed --zero-stage --offload --layer-map --hidden-loss --alpha --beta
--gamma --delta --temperature --topk-kl --epochs --max-steps --lr --batch-size --grad-accum --seed --resume
--config``) are a contract. This module imports neither torch nor zarr/pyarrow (only the layer-map syntax and
the error types), so ``kdcache --help`` and config validation stay fast.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kdcache.stages.common.engine_options import TRAIN, EngineOptions
from kdcache.stages.common.option_groups import assemble, flatten, option_group
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.attention.flags import AttentionLossFlags
from kdcache.stages.targets.hidden.hidden_losses import CriticFlags, HiddenLossFlags
from kdcache.stages.targets.logits.loss_flags import DEFAULT_TEMPERATURE, LogitLossFlags
from kdcache.stages.train.core.layer_maps import LayerMap, StreamMaps

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec


def _opt(help_text: str, **extra: object) -> dict[str, object]:
    return {"help": help_text, **extra}


def below(group: object, least: int, names: tuple[str, ...]) -> list[str]:
    """``NAME must be >= least, got V`` for each option of ``names`` in ``group`` set below ``least`` (None: unset)."""
    return [f"{name} must be >= {least}, got {value}" for name in names
            if (value := getattr(group, name)) is not None and not value >= least]  # not >=: NaN is refused too


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": None}  # tracker -> the package it needs


def tracker_problems(report_to: tuple[str, ...]) -> list[str]:
    """Unknown tracker names, and trackers whose package is not installed (naming the extra to install)."""
    problems = []
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            problems.append(f"report_to {name!r} is not a tracker; expected any of {sorted(TRACKERS)} or none")
        elif (package := TRACKERS[name]) and importlib.util.find_spec(package) is None:
            problems.append(f"report_to {name}: the {package} package is not installed; "
                            f"pip install \"kdcache[{name}]\"")
    return problems


@dataclass(frozen=True)
class DataOptions:
    """What stage two reads from the cache, and in which order."""

    cache: str = field(metadata=_opt("the cache directory written by `kdcache precompute`"))
    allow_partial: bool = field(default=False, metadata=_opt("train on a partial cache (missing shards)"))
    batch_size: int = field(default=8, metadata=_opt("sequences per micro-batch per rank"))
    grad_accum: int = field(default=1, metadata=_opt("micro-batches accumulated per optimizer step"))
    seed: int = field(default=0, metadata=_opt("seed of the data order, init and dropout"))
    shuffle_block: int = field(default=256, metadata=_opt(
        "sequences shuffled together after the shard shuffle; every shard a block touches stays decoded in host "
        "memory until the block is done, so lower it for long sequences or wide caches"))
    num_workers: int = field(default=0, metadata=_opt("DataLoader worker processes (decoding already runs "
                                                      "in threads; 0 is usually right)"))
    prefetch: int = field(default=4, metadata=_opt("micro-batches decoded ahead of the step"))
    prefetch_mib: int = field(default=512, metadata=_opt(  # feed.ahead.PREFETCH_MIB (the feed imports torch)
        "MiB of host memory the micro-batches waiting for the step may hold together; a bigger batch (dense "
        "--logits full targets) waits alone. --prefetch still caps their number"))
    decode_threads: int = field(default=0, metadata=_opt(
        "threads decoding cached arrays (arrays of a shard decode in parallel); 0 = one per core of the host"))

    def validate(self) -> list[str]:
        at_least_one = ("batch_size", "grad_accum", "prefetch", "prefetch_mib", "shuffle_block")
        return below(self, 1, at_least_one) + below(self, 0, ("num_workers", "decode_threads"))


@dataclass(frozen=True)
class LossOptions:
    """The compound loss: the weight of each term, the hidden-state loss, the KD temperature. A family's flags
    are its own group (``hidden``: ``--hidden-loss``; ``logit``: the KL's temperature and top-k variant;
    ``critic``: wgan's; ``attention``: the attention term), in the place their flags are listed."""

    hidden: HiddenLossFlags = option_group(HiddenLossFlags)
    alpha: float | None = field(default=None, metadata=_opt(
        "weight of the CE term (causal shift; default 1, 0 for a student without an LM head or an encoder's, whose "
        "CE on unmasked cached tokens is near-trivial)"))
    beta: float | None = field(default=None, metadata=_opt(
        "weight of the logit KL term (default 1, 0 when the cache holds no logits)"))
    gamma: float = field(default=1.0, metadata=_opt("weight of the hidden-state term"))
    delta: float = field(default=0.0, metadata=_opt("weight of the attention KL term"))
    logit: LogitLossFlags = option_group(LogitLossFlags)
    critic: CriticFlags = option_group(CriticFlags)
    attention: AttentionLossFlags = option_group(AttentionLossFlags)
    cross_tokenizer: str | None = field(default=None, metadata=_opt(
        "train a student whose tokenizer differs from the teacher's, from a cache written with --record-text: "
        "tokens aligned by the text they cover; the vocabulary term is gold (exact KL on shared tokens, ULD on the "
        "rest) or uld; --cross-tokenizer alone means gold", choices=["gold", "uld"], nargs="?", const="gold"))

    @property
    def ce_weight(self) -> float:
        """--alpha as resolved (``TrainOptions.with_student_defaults``); 1 where nothing has resolved it."""
        return 1.0 if self.alpha is None else self.alpha

    @property
    def kl_weight(self) -> float:
        """--beta as resolved (``TrainOptions.with_cache_defaults``); 1 where nothing has resolved it."""
        return 1.0 if self.beta is None else self.beta

    def validate(self) -> list[str]:
        problems = below(self, 0, ("alpha", "beta", "gamma", "delta")) + self.attention.problems()
        return problems + self.logit.problems() + self.critic.problems()


@dataclass(frozen=True)
class MapOptions:
    """Which student layer meets which teacher layer, per token stream, parsed from the config's text once.

    Each option holds a map per stream (``StreamMaps``): the unprefixed one for every stream, ``encoder:`` /
    ``decoder:`` for one stack, and for ``attention_layers`` also ``cross:`` (the cross-attention KL, whose
    default is the decoder map restricted to the cached cross-attention blocks; ``cross:none`` drops the term).
    The empty map (``LayerMap("")``) of a stream means "follow the unprefixed one"."""

    layer_map: StreamMaps = field(default=StreamMaps.parse("uniform"), metadata=_opt(
        "student-to-teacher hidden layer map: uniform|last (alias last-k)|reverse|all-to-one|random|none|"
        "explicit:1-2,2-4; an encoder-decoder's stacks apart as encoder:MAP decoder:MAP (an unprefixed map covers "
        "both)", nargs="+", metavar="[STREAM:]MAP"))
    attention_layers: StreamMaps | None = field(default=None, metadata=_opt(
        "student-to-teacher attention map for the delta term, same syntax as --layer-map, and cross:MAP for the "
        "cross-attention blocks (cross:none: no cross-attention term) (default: the hidden map restricted to the "
        "cache's attention layers)", nargs="+", metavar="[STREAM:]MAP"))

    def __post_init__(self) -> None:
        if "" not in self.layer_map.streams:  # only stacks given: the rest follow the default, uniform
            object.__setattr__(self, "layer_map", self.layer_map.with_stream("", LayerMap()))

    def for_stream(self, stream: str) -> LayerMap:
        """The hidden map of token stream ``stream``: its own (``encoder``, ``decoder``), else the unprefixed."""
        own = self.layer_map.get(stream) if stream else None
        return own if own and own.given else self.layer_map.get("")

    def attention_map(self, stream: str) -> LayerMap | None:
        """The attention map given for ``stream`` (``cross``: the cross-attention term): its own, else (but for
        ``cross``) the unprefixed one; None when none is given (the hidden map, restricted, stands in)."""
        given = self.attention_layers
        own = given.get(stream) if given else None
        if not (own and own.given) and stream != "cross":
            own = given.get("") if given else None
        return own if own and own.given else None

    def validate(self) -> list[str]:
        """The empty map means "follow the unprefixed map", which the unprefixed maps cannot; no cross hidden map."""
        problems = [f"{name}: got '', expected a map such as uniform or explicit:1-2,2-4"
                    for name, value in (("layer_map", self.layer_map), ("attention_layers", self.attention_layers))
                    if value is not None and "" in value.streams and not value.get("").given]
        if "cross" in self.layer_map.streams:
            problems.append(f"layer_map: got {str(self.layer_map)!r}; the cross-attention map is --attention-layers "
                            f"cross:MAP")
        return problems


@dataclass(frozen=True)
class RunOptions:
    """The student, where the run goes, how long it lasts, and what it logs."""

    student: str = field(metadata=_opt(
        "a student: a HF model folder (pretrained weights) or a config.json / folder holding only a config "
        "(random init)"))
    out: str = field(metadata=_opt("the run directory: checkpoints, metrics.jsonl, the exported student"))
    epochs: int | None = field(default=None, metadata=_opt("passes over the cache (default 1 if no --max-steps)"))
    max_steps: int | None = field(default=None, metadata=_opt("optimizer steps to run (wins over --epochs)"))
    resume: bool = field(default=False, metadata=_opt(
        "continue from the latest checkpoint in --out, with the run's own options: only --max-steps, --epochs, "
        "logging, --save-every and reading options may change (another loss, map or data option is refused)"))
    init_from: str | None = field(default=None, metadata=_opt(
        "start a new run from the student (and projectors) an earlier run exported, e.g. to go on with another "
        "loss; --student may then be left out, and plan.json names the run it started from", metavar="RUN"))
    config: str | None = field(default=None, metadata=_opt(
        "YAML file of flag names giving defaults: flat, or under a `train:` section; an unknown key is refused"))
    log_every: int = field(default=10, metadata=_opt(
        "write metrics.jsonl (and trackers, and a progress line when the output is not a terminal) every N "
        "optimizer steps"))
    report_to: tuple[str, ...] = field(default=(), metadata=_opt(
        "trackers beside metrics.jsonl, through DeepSpeed's monitor: tensorboard, wandb, csv (comma-separated; "
        "none by default); they write under RUN/ (wandb: its own project 'kdcache')"))
    quiet: bool = field(default=False, metadata=_opt(
        "on success print only kdcache's notes about the run: no progress, summary or library lines"))
    save_every: int = field(default=0, metadata=_opt("checkpoint every N optimizer steps (0: only at the end)"))
    trace_samples: bool = field(default=False, metadata=_opt(
        "record the sequence ids and loss of every micro-step in RUN/samples-rank{r}.jsonl (reads the loss on the "
        "host each micro-step: a GPU sync that costs speed)"))
    export: bool = field(default=True, metadata=_opt("save the student with save_pretrained at the end"))
    eval_cache: str | None = field(default=None, metadata=_opt(
        "a held-out cache the same teacher wrote with the same settings: every loss term, and the agreement with "
        "the teacher (top-1, KL) where it holds logits, scored on it every --eval-every steps and at the end, "
        "written to RUN/eval.jsonl (and the trackers, as eval/...)"))
    eval_every: int = field(default=0, metadata=_opt(
        "score --eval-cache every N optimizer steps (0: at the end only)"))

    def validate(self) -> list[str]:
        problems = below(self, 1, ("epochs", "max_steps", "log_every")) + below(self, 0, ("save_every", "eval_every"))
        if self.eval_every and not self.eval_cache:
            problems.append(f"eval_every {self.eval_every} needs eval_cache (the held-out cache to score)")
        problems += tracker_problems(self.report_to)
        if not Path(self.student).exists():
            problems.append(f"student {self.student!r} does not exist (a model folder or a config.json)")
        return problems + init_from_problems(self.init_from, self.student) + out_problems(self.out)


# What a run folder may hold before training writes options.json: a baseline evaluated first, a sweep's logs, a
# report. Anything else means --out names someone else's folder.
RUN_ENTRIES = frozenset({"options.json", "plan.json", "metrics.jsonl", "checkpoints", "student", "projectors.pt",
                         "evals", "report", "tensorboard", "wandb", "csv", "train.log", "eval.log", "sweep-run.json",
                         "eval.jsonl"})


def init_from_problems(init_from: str | None, student: str) -> list[str]:
    """``--init-from RUN`` needs a run that exported its student, and starts from that student: a ``--student``
    naming another folder would leave the record unclear."""
    if not init_from:
        return []
    exported = Path(init_from) / "student"
    if not (exported / "config.json").is_file():
        return [f"init_from: {init_from!r} holds no exported student ({exported}/config.json); a run exports it "
                "when it finishes, and --init-from starts from it"]
    if Path(student).resolve() != exported.resolve():
        return [f"init_from: a new run from {init_from!r} starts from its student {str(exported)!r}, but student "
                f"names {student!r}; leave --student out (or give that folder)"]
    return []


def out_problems(out: str) -> list[str]:
    """``--out`` must be new, empty, or a run's folder, as precompute's ``--out`` must be new, empty or a cache."""
    root = Path(out)
    if root.exists() and not root.is_dir():
        return [f"out: {out!r} is a file; expected a new or empty folder, or a run's folder to continue"]
    if not root.is_dir() or (root / "options.json").is_file():
        return []
    foreign = sorted(p.name for p in root.iterdir() if p.name not in RUN_ENTRIES and not p.name.startswith("."))
    return [f"out: {out!r} is not empty and holds no kdcache run (found {', '.join(foreign[:5])}); choose a new "
            "or empty folder"] if foreign else []


@dataclass(frozen=True)
class TrainOptions:
    """Everything ``run_training`` needs, in groups; validated before any model or cache is opened.

    Flags, YAML keys and ``RUN/options.json`` stay flat (``--gamma``, not ``--loss.gamma``): leaf names are unique
    across the groups (``stages.common.option_groups``).
    """

    data: DataOptions
    run: RunOptions
    loss: LossOptions = field(default_factory=LossOptions)
    maps: MapOptions = field(default_factory=MapOptions)
    engine: EngineOptions = field(default_factory=EngineOptions, metadata={"stage": TRAIN})  # DeepSpeed's fields

    def validate(self) -> list[str]:
        """Checks across fields and against the disk; returns every problem found."""
        return [p for group in (self.data, self.loss, self.maps, self.engine, self.run) for p in group.validate()]

    def to_dict(self) -> dict[str, object]:
        """Flat ``{option: value}`` (maps as their text), written to RUN/options.json."""
        return {k: str(v) if isinstance(v, (LayerMap, StreamMaps)) else v for k, v in flatten(self).items()}

    def with_cache_defaults(self, spec: CacheSpec) -> tuple[TrainOptions, str | None]:
        """These options with what the cache decides when the user gave nothing, and a line saying so.

        A sampled cache's KL estimate exists only at its sampling temperature, so that is the default there (its
        logit kind's ``default_temperature``); a cache without logits has no KL term (``--beta`` 0).
        """
        said: list[str] = []
        loss = self.loss
        if loss.beta is None:
            loss = dataclasses.replace(loss, beta=1.0 if getattr(spec, "logits", None) else 0.0)
            if not loss.beta:
                said.append("--beta 0: the cache holds no logits (--beta not given)")
        if loss.logit.temperature is None:
            kind = logit_kinds.of(getattr(spec, "logit_layout", None))
            fixed = kind.default_temperature(spec) if kind else None
            logit = dataclasses.replace(loss.logit, temperature=DEFAULT_TEMPERATURE if fixed is None else fixed)
            loss = dataclasses.replace(loss, logit=logit)
            if fixed is not None:
                said.append(f"training at temperature {fixed:g}, the cache's sampling temperature (--temperature "
                            f"not given)")
        return dataclasses.replace(self, loss=loss), "; ".join(said) or None

    def with_student_defaults(self, lm_head: bool, encoder: bool) -> tuple[TrainOptions, str | None]:
        """``--alpha`` when not given: 1, or 0 for a student without an LM head (no CE to take) or an encoder
        (its CE on the cache's unmasked tokens predicts each token from itself); and a line saying why."""
        if self.loss.alpha is not None:
            return self, None
        alpha = 1.0 if lm_head and not encoder else 0.0
        resolved = dataclasses.replace(self, loss=dataclasses.replace(self.loss, alpha=alpha))
        why = ("the student has no LM head" if not lm_head
               else "an encoder's CE on unmasked cached tokens is near-trivial")
        return resolved, None if alpha else f"--alpha 0: {why} (--alpha not given)"

    @classmethod
    def of(cls, **flat: object) -> TrainOptions:
        """Build from flat keyword arguments as the flags name them (tests, benchmarks); maps may be text. No
        checks: ``pipeline.config.build`` is the checked way in."""
        return assemble(cls, flat)
