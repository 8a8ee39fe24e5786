"""The logit kind interface and its registry: one ``LogitKind`` per ``--logits`` mode, looked up by name.

A kind owns a mode's whole life in both stages: parsing its ``--logits`` value, the ``CacheSpec`` fields stage one
writes, its capture of the teacher's ``[N, V]`` logits on the device, its checks against the student and the loss
options, its stage-two loss term, its eval metric and its ``kdcache inspect`` line. Its storage side (arrays,
dtypes, codecs) is the ``LogitLayout`` object it holds (``layout``, from ``storage.core.logit_layouts``), whose
name is the mode's: registering the kind registers the layout, so a mode is registered once. A name is looked up
where it enters (``parse``, ``get``); past that edge a cache's kind is ``of(spec.logit_layout)``, by the object.
Callers never compare mode names.

Each mode is two modules of this folder. ``<mode>.py``, torch-free, is its ``LogitKind``: name, option
checks, spec fields and ``inspect`` line, what the registry, the option classes and ``kdcache inspect`` read.
``<mode>_torch.py`` is its torch half: the capture of the teacher's logits, the decode of the teacher's top-1 and
the student's loss term, a term of stage two's vocabulary pass (``stages.targets.logits.vocab``). The kind finds its
torch half by that name (``torch_half``) and imports it on the first capture or loss, so a mode is registered
once and the light paths never load torch.

The family's flags are declared once, beside the kinds that read them: here ``LogitFlags``, stage one's logit
flags, their checks and the ``LogitSettings`` they make, held whole by stage one's options (``TargetOptions.logit``,
an ``option_group``: flags and YAML keys stay flat); in ``loss_flags`` ``LogitLossFlags``, stage two's logit KL
flags, held the same way by ``LossOptions.logit``. A new flag is a field there, its check in ``problems`` and its
use in a kind's ``spec_fields`` or ``loss_problems``.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kdcache.stages.common.option_groups import option
from kdcache.stages.targets.logits.loss_flags import LogitLossFlags
from kdcache.storage import (
    ArrayKind,
    KdcacheError,
    LogitFields as CacheLogits,  # the spec's logit fields, as storage reads them
    LogitLayout,
    Registry,
    register_layout,
)

if TYPE_CHECKING:
    import torch

    from kdcache.stages.targets.logits.teacher_head import TeacherHead
    from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
    from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm

TORCH_HALF = "_torch"  # a mode's torch half is the module of its kind's name plus this, beside it


class LogitKindError(KdcacheError, ValueError):
    """An unknown logit mode, or a ``--logits`` value a mode cannot parse."""


@dataclass(frozen=True)
class KlSetup:
    """How stage two forms a logit term: the KD temperature, the top-k variant, the teacher's head (``head``)."""

    temperature: float = 1.0
    topk_variant: str = "renorm"
    head: TeacherHead | None = None


@dataclass(frozen=True)
class LogitSettings:
    """Stage one's logit mode as one record, built where the flags enter (``LogitFlags.settings``) and carried whole
    by the run's targets into its ``CacheSpec``, its settings fingerprint and every capture (``LogitKind.capture``).

    The family alone names these fields: a mode's new field is a field here, the value its kind's ``spec_fields``
    returns, and its line in ``spec_fields`` / ``fingerprint`` below; nothing between the flags and the spec copies
    them one by one. Equality is the fields' and the mode's name (a pickled copy's kind is another object).

    Attributes:
        kind: the mode (None: no feature ``logits``).
        top_k: logits kept per token (``topk``; 0 for the other modes).
        samples: draws per token (``sampled:N``; 0 for the other modes).
        sample_temperature: the softmax temperature the draws are made at (``--sample-temperature``, recorded
            whatever the mode, as caches always have).
        logprob_step: > 0: top-k values stored as log-probs quantised to this step (``--topk-values logprob``).
        name: the mode's name (``CacheSpec.logits``), None without logits.
    """

    kind: LogitKind | None = field(compare=False, repr=False)
    top_k: int = 0
    samples: int = 0
    sample_temperature: float = 1.0
    logprob_step: float = 0.0
    name: str | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.kind.name if self.kind else None)

    @property
    def logit_layout(self) -> LogitLayout | None:
        """The mode's storage layout (storage's ``LayoutFields``: which arrays a capture hands over)."""
        return self.kind.layout if self.kind else None

    def spec_fields(self) -> dict[str, Any]:
        """The ``CacheSpec`` keyword arguments of the mode (its vocabulary size is the teacher's, not the mode's)."""
        return {"logits": self.name, "top_k": self.top_k, "samples": self.samples,
                "sample_temperature": self.sample_temperature, "logprob_step": self.logprob_step,
                "topk_values": "logprob" if self.logprob_step else "fp16"}

    def fingerprint(self) -> dict[str, Any]:
        """The mode's part of stage one's settings fingerprint, keyed as caches have always recorded it
        (``logprob_step`` only when set, so that earlier caches' fingerprints stay the same)."""
        return {"top_k": self.top_k, "logits": self.name, "samples": self.samples,
                "sample_temperature": self.sample_temperature,
                **({"logprob_step": self.logprob_step} if self.logprob_step else {})}


# The one pass over the LM head, stage two's (``term_value`` is the same for every kind, a plugin's included): named
# here, imported on a loss's first call like a torch half, so that the registry loads no torch.
VOCAB_PASS = "kdcache.stages.targets.logits.vocab.vocab_pass"


class LogitKind:
    """One logit mode. Subclasses set the class attributes and override what differs from these defaults.

    Attributes:
        layout: its storage side, the arrays it stores; a subclass sets it, and takes its ``name`` from it.
        name: the ``--logits`` value and ``CacheSpec.logits``: its layout's name.
        argument: what follows ``name:`` in ``--logits`` (``"N"`` for ``sampled:N``); empty: nothing may.
        term: the name stage two logs its loss term under.
        kl_form: eval's label of the KL it reports.
        exact_vocab: the student's head must have exactly the cache's V outputs (else at least V).
        teacher_head: stage two rebuilds the teacher's logits from its last layer and ``teacher_head/``.
        draws: the capture draws at random (it is handed a seeded generator).
        logprob_values: takes ``--topk-values logprob`` (values stored as quantised log-probabilities).
        key_array: the batch array whose presence marks this kind's targets (None: marked by the head).
        ranked: stores the teacher's k largest logits with their ids and the logsumexp, per token: top-ks of
            vocabulary shards merge into it exactly, and another vocabulary can read it by token string.
        torch_module: its torch half, ``<the kind's module>_torch`` for a kind of this folder (a subclass defined
            elsewhere keeps its parent's, or sets its own, or overrides the methods that use it).
    """

    layout: ClassVar[LogitLayout]
    name: ClassVar[str] = ""
    argument: ClassVar[str] = ""
    term: ClassVar[str] = "kl"
    kl_form: ClassVar[str] = "exact"
    exact_vocab: ClassVar[bool] = False
    teacher_head: ClassVar[bool] = False
    draws: ClassVar[bool] = False
    logprob_values: ClassVar[bool] = False
    key_array: ClassVar[str | None] = None
    ranked: ClassVar[bool] = False
    torch_module: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The name is the layout's, written once (a subclass that keeps its parent's layout keeps its name); the
        torch half of a kind of this folder is its module's namesake."""
        super().__init_subclass__(**kwargs)
        if "layout" in cls.__dict__:
            cls.name = cls.layout.name
        if cls.__module__.startswith(f"{__package__}."):
            cls.torch_module = cls.__module__ + TORCH_HALF

    def torch_half(self) -> ModuleType:
        """The module that computes this mode with torch, imported on first use (then a ``sys.modules`` lookup): it
        defines ``capture``, ``chunk_term`` and ``teacher_top1`` with this class's signatures, which call them."""
        if not self.torch_module:
            raise LogitKindError(f"logit mode {self.name!r} has no torch half: its class, defined outside "
                                 f"{__package__}, sets no torch_module; expected the module of its capture, "
                                 f"chunk_term and teacher_top1, or overrides of them")
        return importlib.import_module(self.torch_module)

    # ---- stage one -------------------------------------------------------------------------------------------
    def parse_argument(self, text: str) -> int:
        """The integer after ``name:`` (0 when the mode takes none). Raises ``LogitKindError`` on a bad one."""
        if text:
            raise LogitKindError(f"logits: {self.name} takes no argument, got {self.name}:{text}")
        return 0

    def option_problems(self, options: LogitFlags) -> list[str]:
        """Problems of stage one's options for this mode."""
        return []

    def teacher_problems(self, teacher: str, one_stream: bool, causal: bool, vocab: int, top_k: int) -> list[str]:
        """Problems of this mode with a teacher: of one token stream or two, causal or not, of ``vocab`` outputs."""
        return []

    def spec_fields(self, options: LogitFlags, argument: int) -> dict[str, Any]:
        """The mode's ``LogitSettings`` fields from stage one's logit flags: ``top_k``, ``samples``,
        ``logprob_step`` (``LogitFlags.settings`` adds the kind and the temperature)."""
        return {"top_k": 0, "samples": 0, "logprob_step": 0.0}

    def capture_chunk(self, chunk_tokens: int) -> int:
        """Valid tokens per chunk of the LM head (``precompute.logit_head.ChunkedHead``); 0: the model's forward."""
        return 0

    def capture(self, logits: torch.Tensor, settings: LogitSettings,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """What the cache keeps of ``[..., V]`` teacher logits, on their device: array name -> ``[..., w]``."""
        return self.torch_half().capture(logits, settings, generator)

    # ---- stage two -------------------------------------------------------------------------------------------
    def vocab_problems(self, spec: CacheLogits, student_vocab: int) -> list[str]:
        """The student head's size against the cache's vocabulary."""
        if self.exact_vocab and student_vocab != spec.vocab_size:
            return [f"vocab size mismatch: the cache's {self.name} logits have {spec.vocab_size} entries per token, "
                    f"the student's head {student_vocab}; the KL needs the same vocabulary"]
        if student_vocab < spec.vocab_size:
            return [f"vocab size mismatch: the cache's {self.name} logits index a vocabulary of {spec.vocab_size} "
                    f"ids, the student's head has {student_vocab}; the KL needs them all"]
        return []

    def loss_problems(self, spec: CacheLogits, loss: LogitLossFlags) -> list[str]:
        """The loss options against this cache (the top-k variant is for top-k caches only)."""
        if loss.topk_kl == "other":
            return [f"--topk-kl other is a KL for caches written with --logits topk, and this cache holds "
                    f"{self.name} logits, whose KL needs no variant; drop --topk-kl"]
        return []

    def default_temperature(self, spec: CacheLogits) -> float | None:
        """The training temperature this cache fixes when none is given (None: the general default)."""
        return None

    def loss(self, logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
             setup: KlSetup) -> torch.Tensor:
        """Stage two's term ``term``: a scalar, from student ``logits [B, L, V]`` and the batch's cached arrays."""
        return importlib.import_module(VOCAB_PASS).term_value(logits, self.chunk_term(logits, targets, mask, setup))

    def chunk_term(self, logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                   setup: KlSetup) -> ChunkTerm:
        """``loss`` as a term of the step's one pass over the LM head (``vocab_pass``, beside the CE)."""
        return self.torch_half().chunk_term(logits, targets, mask, setup)

    def eval_kl(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                setup: KlSetup) -> torch.Tensor:
        """The KL eval reports, per valid token, at T=1 (or the cache's own temperature, ``setup.temperature``)."""
        return self.loss(logits, targets, mask, KlSetup(1.0, "other", setup.head))

    def teacher_top1(self, targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                     head: TeacherHead | None) -> torch.Tensor:
        """``[N_v]`` the teacher's likeliest token at each position of ``valid [B, L]``."""
        return self.torch_half().teacher_top1(targets, valid, head)

    def kl_label(self, spec_temperature: float) -> str:
        """Eval's name of its KL."""
        return self.kl_form

    def describe(self, info: Mapping[str, Any]) -> str:
        """The ``logits`` line of ``kdcache inspect`` from the manifest's spec fields."""
        return f"{self.name}, V={info['vocab_size']}"


_KINDS: Registry[LogitKind] = Registry("logit mode", LogitKindError)
K = TypeVar("K", bound=type[LogitKind])


def register(cls: K) -> K:
    """Class decorator: register one instance of a ``LogitKind`` subclass under its ``name``, and its layout in
    storage's table (a built-in layout is there already; a new mode's arrives with its kind)."""
    register_layout(cls.layout)
    _KINDS.add(cls.name, cls())
    return cls


names = _KINDS.names  # every registered mode, in registration order


kinds = _KINDS.values  # every registered kind, in registration order (a live view: a kind registered later too)


get = _KINDS.lookup  # the kind registered as a name; a LogitKindError naming it and the registered modes otherwise


def of(layout: LogitLayout | None) -> LogitKind | None:
    """The kind that holds ``layout`` (a cache's ``spec.logit_layout``, resolved from its name at the edge); None
    for a cache without logits.

    Raises:
        LogitKindError: no registered kind holds it (a layout registered without its kind).
    """
    if layout is None:
        return None
    kind = next((k for k in _KINDS.values() if k.layout == layout), None)  # equal: a spec that was pickled
    if kind is None:
        raise LogitKindError(f"no logit kind holds the layout {layout.name!r}; expected one of {', '.join(_KINDS)}")
    return kind


def parse(value: str) -> tuple[LogitKind, int]:
    """``name:N`` -> (the kind registered as ``name``, N); a bare ``name`` -> (that kind, 0).

    Raises:
        LogitKindError: an unknown mode, or an argument it does not take.
    """
    name, _, argument = value.partition(":")
    try:
        kind = get(name)
    except LogitKindError:
        raise LogitKindError(f"logits: got {value!r}, expected {usage()}") from None
    return kind, kind.parse_argument(argument)


def usage() -> str:
    """The accepted ``--logits`` values, e.g. ``topk, full, head or sampled:N``."""
    forms = [f"{k.name}:{k.argument}" if k.argument else k.name for k in _KINDS.values()]
    return ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else "".join(forms)


def uses_head(name: str | None) -> bool:
    """Whether a cache of mode ``name`` (None: no logits) has stage two rebuild its logits with the teacher's head."""
    return bool(name) and get(str(name)).teacher_head


def from_targets(arrays: Iterable[str], head: bool) -> LogitKind | None:
    """The kind whose targets a batch holds (its ``key_array``), or the head's when stage two has one."""
    held = set(arrays)
    if head:
        return next(k for k in _KINDS.values() if k.teacher_head)
    return next((k for k in _KINDS.values() if k.key_array in held), None)


DEFAULT_LOGITS = "topk"  # the --logits mode when none is given (a name of stages.targets.logits)
FULL_LOGITS = "full"  # the mode the older flag --full-logits asks for


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

