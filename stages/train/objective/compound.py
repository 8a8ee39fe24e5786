"""The compound distillation loss: α·CE + β·KL + γ·Σ_pairs hidden + δ·Σ_pairs attention.

``CompoundLoss`` holds the projectors (``Projectors``) and, for the ``wgan`` hidden loss, a ``CriticTrainer`` that
is deliberately *not* a submodule (the critics have their own optimizer; they step inside ``forward`` in training
mode with grad enabled, so a loop that only calls the wrapped model needs nothing else). Terms whose weight is 0
are never computed.

Inputs (``B`` batch, ``L`` padded length):

* ``student_out``: an HF ``ModelOutput``-like object with ``.logits [B, L, V]`` (absent for encoders) or the
  ``HeadLogits`` behind them (the last hidden state and the LM head, applied chunk by chunk in the losses),
  ``.hidden_states`` (tuple, 0 = embeddings; needs ``output_hidden_states=True``) and ``.attentions``
  (tuple, block j at index j−1; needs ``output_attentions=True`` and ``attention_maps.MAPS_ATTENTION``, eager
  attention returning its probabilities before dropout).
* ``targets``: the collated cache arrays as float32 tensors on the device: ``input_ids [B, L]``,
  ``hidden/{j} [B, L, d_t]``, ``attention/{j} [B, H', L, L]``, ``logits/full [B, L, V]`` or
  ``logits/topk_values``/``logits/topk_ids [B, L, k]`` and ``logits/lse [B, L]``.
* ``mask [B, L]``: 1 for a real token. ``targets`` may also hold ``loss_mask`` and ``position_ids`` ``[B, L]``;
  which positions each term counts follows from the three (``masks.token_masks``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.attention.qk_loss import cached_qk_loss
from kdcache.stages.targets.hidden.wgan import CriticTrainer
from kdcache.stages.targets.logits import KlSetup, LogitKind
from kdcache.stages.targets.logits.loss_flags import TOPK_VARIANTS
from kdcache.stages.targets.logits.vocab import vocab_pass
from kdcache.stages.targets.logits.vocab.loss_rows import tied_zero
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm
from kdcache.stages.train.core.layer_maps import Pair, pair_key
from kdcache.stages.train.core.masks import TokenMasks, token_masks
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.losses.logits import causal_ce_term, token_ce_term

if TYPE_CHECKING:
    from kdcache.stages.targets.attention.qk_attention import Captured
    from kdcache.stages.targets.logits.teacher_head import TeacherHead
    from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits

CE_KINDS = ("causal", "token")


class StudentOutput(Protocol):
    """What the losses read of a student's forward outputs: a transformers ``ModelOutput`` or one stream's view of it
    (``distill.student_view``). ``logits [B, L, V]`` is None for an encoder without an LM head; the optional
    fields (``hidden_states``, ``attentions``, ``attention_qkv``) are looked up by name, so a missing one is
    reported with the flag that asks for it (``_student_field``). ``attentions`` are the maps (``[B, H, L, L]`` per
    block, eager attention); under a q/k recorder (``distill.recorded``) ``attention_qkv`` holds the queries and
    keys instead."""

    @property
    def logits(self) -> torch.Tensor | HeadLogits | None: ...

    @property
    def hidden_states(self) -> Sequence[torch.Tensor]: ...  # [B, L, d_s] each, 0 = embeddings (when asked for)

    attentions: tuple[torch.Tensor, ...]
    attention_qkv: dict[int, Captured]


class RunLoss(Protocol):
    """The run's loss (``train.loss.DistillationLoss``) as a step's counts (``step_norm``) and the cross-tokenizer
    model read it: its streams (the main one last), each stream's ``CompoundLoss``, the cross-attention pairs, its
    forward of the student (with its decision on the student's LM head) and the loss itself."""

    streams: list[str]
    cross_pairs: list[Pair]
    announce_head: bool

    def part(self, stream: str) -> CompoundLoss: ...

    def student_outputs(self, student: object, batch: Mapping[str, Any]) -> Any: ...

    def __call__(self, student_outputs: StudentOutput, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ...


class Projectors(nn.Module):
    """One ``nn.Linear(d_s, d_t)`` per (student, teacher) pair, keyed ``"s{j}_t{i}"``, learnable, from the student's
    hidden size to the teacher's.

    They live inside ``CompoundLoss``, itself inside the module handed to DeepSpeed, so the engine optimizes (and
    under ZeRO-3 partitions) them with the student. Call them through ``Projectors.project`` (module calls, never
    ``F.linear`` on their weights) so ZeRO-3's hooks gather their parameters first. They are saved apart from
    the student, whose export stays a plain HF model.

    None are created for an empty map (``CompoundLoss`` gives one to a loss without a projector, CKA);
    ``project`` is then the identity.

    Init (bias zero):
      * d_s == d_t: the exact identity. A student initialised from teacher layers (``init-student``) already
        lives in the teacher's space, and for any other student it is the neutral starting point.
      * d_s != d_t: a random semi-orthogonal matrix. When d_t >= d_s its columns are orthonormal, an exact
        isometry (‖Wx‖ = ‖x‖); when d_t < d_s its rows are, scaled by sqrt(d_s/d_t) so ‖Wx‖ ≈ ‖x‖ on average.
        Either way the projected states start at the student's own scale, not near zero, and no direction is
        favoured — unlike ``eye(d_t, d_s) + 1e-6``, which copies an arbitrary slice of coordinates.

    ``seed`` seeds the semi-orthogonal inits (the same on every rank).
    """

    def __init__(self, pairs: Sequence[Pair], student_dim: int, teacher_dim: int, *, seed: int = 0):
        super().__init__()
        self.student_dim = student_dim
        self.teacher_dim = teacher_dim
        keys = [pair_key(p) for p in pairs]
        generator = torch.Generator().manual_seed(seed)
        # dict.fromkeys: a pair listed twice shares one projector.
        self.layers = nn.ModuleDict({k: self._make(generator) for k in dict.fromkeys(keys)})

    def project(self, pair: Pair, h_s: torch.Tensor) -> torch.Tensor:
        """Map ``[..., d_s]`` student states of ``pair`` to ``[..., d_t]`` (identity when there is no projector)."""
        key = pair_key(pair)
        if key not in self.layers:
            return h_s
        return self.layers[key](h_s)

    def _make(self, generator: torch.Generator) -> nn.Linear:
        layer = nn.Linear(self.student_dim, self.teacher_dim)
        with torch.no_grad():
            if self.student_dim == self.teacher_dim:
                layer.weight.copy_(torch.eye(self.teacher_dim))
            else:
                gain = math.sqrt(max(1.0, self.student_dim / self.teacher_dim))
                nn.init.orthogonal_(layer.weight, gain=gain, generator=generator)
            layer.bias.zero_()
        return layer


class CompoundLoss(nn.Module):
    """α·CE + β·KL (full or top-k) + γ·Σ hidden + δ·Σ attention, each term also returned on its own.

    Args:
        loss: the run's loss options (``LossOptions``; default: the flags' defaults), with this stream's weights
            α, β, γ, δ of CE, KL, hidden and attention (a 0 weight skips the term); its hidden loss, the wgan
            critic's steps and learning rate, the KL's temperature and top-k variant (``other`` requires T = 1 and
            raises on the first batch otherwise; it is not refused here because with a full-logit cache the variant
            is unused: a check that knows the cache's logit kind belongs in the pre-training checks) and, for a q/k
            cache, the attention loss (``"kl"`` rebuilt block by block or MiniLMv2's ``"relation"`` over R relation
            heads, from ``student_out.attention_qkv``: block -> ``qk_attention.Captured``).
        layer_map: (student, teacher) pairs for the hidden term (``LayerMap.build``).
        student_dim: d_s; needed when projectors are (γ > 0 with a hidden loss that has them: mse, cosine, wgan).
        teacher_dim: d_t; likewise.
        ce: ``"causal"`` (shifted, decoders, on ``input_ids``) or ``"token"`` (unshifted, masked-LM heads, on
            ``targets["labels"]`` when present, else ``input_ids``).
        attention_map: pairs for the attention term; default: ``layer_map`` without embedding pairs.
        seed: seeds the projector and critic inits.
        teacher_head: for a ``--logits head`` cache, the teacher's LM head (``teacher_head.TeacherHead``): the KL
            then rebuilds exact teacher logits from ``hidden/{head.layer}``.
        teacher_scores: a q/k cache's ``attention_scores``: the attention term is then the q/k one.
        logit_kind: the cache's logit kind (``TrainPlan.logit_kind``), which forms the KL; None: the kind whose
            arrays the batch holds (two modes may store the same arrays, so a run from a cache names its kind).
    """

    def __init__(
        self,
        loss: LossOptions | None = None,
        *,
        layer_map: Sequence[Pair] = (),
        student_dim: int | None = None,
        teacher_dim: int | None = None,
        ce: str = "causal",
        attention_map: Sequence[Pair] | None = None,
        seed: int = 0,
        teacher_head: TeacherHead | None = None,
        teacher_scores: Mapping[str, Any] | None = None,
        logit_kind: LogitKind | None = None,
    ):
        super().__init__()
        loss = loss or LossOptions()
        self.teacher_head = teacher_head  # a submodule: its buffers move with the loss
        self.logit_kind = logit_kind
        # A q/k cache (teacher_scores: its score record): attention from the student's recorded queries and keys.
        self.attention_flags, self.teacher_scores = loss.attention, teacher_scores
        self.weights = {"ce": loss.ce_weight, "kl": loss.kl_weight, "hidden": loss.gamma, "attention": loss.delta}
        self.kl_setup, self.ce = KlSetup(loss.logit.resolved_temperature(), loss.logit.topk_kl, teacher_head), ce
        self._check_config()
        self.hidden_loss = loss.hidden.loss()
        self.layer_map: list[Pair] = [(int(s), int(t)) for s, t in layer_map] if loss.gamma > 0 else []
        default_attention = [p for p in layer_map if p[0] > 0 and p[1] > 0]
        self.attention_map: list[Pair] = ([(int(s), int(t)) for s, t in (attention_map or default_attention)]
                                          if loss.delta > 0 else [])
        self.projectors = self._build_projectors(student_dim, teacher_dim, seed)
        self.critics: CriticTrainer | None = None
        if self.hidden_loss.adversarial and self.layer_map:
            keys = list(dict.fromkeys(pair_key(p) for p in self.layer_map))
            self.critics = CriticTrainer(
                keys, int(teacher_dim or 0), n_steps=loss.critic.critic_steps, lr=loss.critic.critic_lr, seed=seed
            )

    def forward(
        self, student_out: StudentOutput, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
        scales: Mapping[str, float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Compute every term with a non-zero weight.

        ``scales``: per family (``ce``, ``kl``, ``hidden``, ``attention``) the factor n / R that normalises the term
        by its whole optimizer step's count (``step_norm``); the values returned are the scaled ones. None: 1.

        Returns:
            ``{"loss": total (with graph), "ce", "kl" | "topk_kl", "hidden", "attention", "hidden/s2_t4", ...}``;
            everything but ``loss`` is detached, unweighted, for logging. Absent terms are absent keys.
        """
        terms: dict[str, torch.Tensor] = {}
        vocab: dict[str, ChunkTerm] = {}  # CE and the KL: one pass over the LM head together (vocab_pass)
        logs: dict[str, torch.Tensor] = {}
        masks = token_masks(mask, targets.get("loss_mask"), targets.get("position_ids"), causal=self.ce == "causal")
        # A micro-batch with nothing to count (rare: a loss mask leaves no trained token or no prediction) adds 0 to
        # a term, tied to the graph, rather than stopping the run. The vocabulary terms, mse and cosine divide by a
        # count on the device and add that 0 themselves (so do the hidden losses that say they are empty-safe);
        # asking the others (attention, CKA, wgan) costs a host sync, so only they ask.
        needs_counts = bool(self.attention_map) or (bool(self.layer_map) and not self.hidden_loss.empty_safe)
        any_trained, any_predicts = masks.counted() if needs_counts else (True, True)
        if self.weights["ce"] > 0:
            self._add_ce(student_out, targets, masks, terms, vocab, any_trained)
        if self.weights["kl"] > 0:
            self._add_kl(student_out, targets, masks, terms, vocab, any_predicts)
        scale = dict(scales or {})
        vocab_total = self._vocab_pass(student_out, vocab, terms, scale)
        if self.layer_map:
            terms["hidden"] = self._hidden_term(student_out, targets, masks.trained, logs, any_trained)
        if self.attention_map:
            terms["attention"] = self._attention_term(student_out, targets, masks, logs, any_trained)
        if scale:  # the terms outside the pass, and their per-pair logs, by their step's count
            terms.update({k: v * scale.get(k, 1.0) for k, v in terms.items() if k not in vocab})
            logs.update({k: v * scale.get(k.split("/")[0], 1.0) for k, v in logs.items()})
        return self._total(terms, logs, vocab_total, set(vocab))

    def _vocab_pass(self, out: StudentOutput, vocab: dict[str, ChunkTerm], terms: dict[str, torch.Tensor],
                    scale: Mapping[str, float]) -> torch.Tensor | None:
        """α·CE + β·KL (with its graph) in one pass over the student's logits, each by its ``scale``; their values
        (detached, scaled) go to ``terms``. None without a vocabulary term."""
        if not vocab:
            return None
        factors = [scale.get(_family(name), 1.0) for name in vocab]
        weights = [self.weights[_family(name)] * f for name, f in zip(vocab, factors)]
        total, values = vocab_pass.vocab_pass(out.logits, list(vocab.values()), weights)  # type: ignore[arg-type]
        terms.update((name, value * f) for name, value, f in zip(vocab, values.unbind(), factors))
        return total

    def _total(self, terms: dict[str, torch.Tensor], logs: dict[str, torch.Tensor],
               vocab_total: torch.Tensor | None = None, in_pass: set[str] | None = None) -> dict[str, Any]:
        """The weighted sum of ``terms`` (those ``in_pass`` are already in ``vocab_total``, weighted) and the logs."""
        if not terms:
            raise LossError("no loss term was computed: every weight is 0, or the terms it has need outputs "
                            "this student lacks (CE needs logits)")
        rest = [self.weights[_family(name)] * value for name, value in terms.items() if name not in (in_pass or ())]
        parts = rest + ([] if vocab_total is None else [vocab_total])
        total = torch.stack(parts).sum()
        return {"loss": total, **{k: v.detach() for k, v in terms.items()}, **logs}

    def _add_ce(self, out: StudentOutput, targets: Mapping[str, torch.Tensor], masks: TokenMasks, terms: dict,
                vocab: dict[str, ChunkTerm], any_trained: bool) -> None:
        logits = getattr(out, "logits", None)
        if logits is None:
            return  # an encoder without an LM head: no CE, by design
        ids = _target(targets, "input_ids")
        if self.ce == "causal":
            vocab["ce"] = causal_ce_term(logits, ids, masks.real, pairs=masks.pairs)
        elif not any_trained:
            terms["ce"] = tied_zero(logits)
        else:  # a masked-LM loop puts its own "labels" (-100 where unmasked) in the batch
            vocab["ce"] = token_ce_term(logits, targets.get("labels", ids), masks.trained)

    def _add_kl(self, out: StudentOutput, targets: Mapping[str, torch.Tensor], masks: TokenMasks, terms: dict,
                vocab: dict[str, ChunkTerm], any_predicts: bool) -> None:
        logits = getattr(out, "logits", None)
        if logits is not None and not any_predicts:  # the term keeps its name: every rank logs the same keys
            terms[self._kind_of(targets).term] = tied_zero(logits)
            return
        if logits is None:
            raise LossError("beta > 0 needs student logits, but the student returns none (an encoder?); set beta 0")
        kind = self._kind_of(targets)
        vocab[kind.term] = kind.chunk_term(logits, targets, masks.predicts, self.kl_setup)

    def _kind_of(self, targets: Mapping[str, torch.Tensor]) -> LogitKind:
        """The cache's logit kind when the loss was told its mode, else the one the batch's arrays mark (the head's
        when the loss holds the teacher's head)."""
        kind = self.logit_kind or logit_kinds.from_targets(targets, self.teacher_head is not None)
        if kind is None:
            raise LossError(f"the KL term needs cached teacher logits, but the batch holds {', '.join(sorted(targets))}"
                            f"; set beta 0, or cache logits ({logit_kinds.usage()})")
        return kind

    def _hidden_term(
        self, out: StudentOutput, targets: Mapping[str, torch.Tensor], mask: torch.Tensor, logs: dict, any_trained: bool
    ) -> torch.Tensor:
        """Σ over pairs of the hidden loss; per-pair values (and wgan critic losses) go to ``logs``."""
        states = _student_field(out, "hidden_states", "output_hidden_states=True")

        def value(s: int, t: int) -> torch.Tensor:
            h_s = self.projectors.project((s, t), _layer(states, s, "hidden state"))
            return self._one_hidden((s, t), h_s, _target(targets, f"hidden/{t}"), mask, logs)
        return _pair_sum(logs, "hidden", self.layer_map, any_trained, lambda s: states[s], value)

    def _one_hidden(
        self, pair: Pair, h_s: torch.Tensor, h_t: torch.Tensor, mask: torch.Tensor, logs: dict
    ) -> torch.Tensor:
        if not self.hidden_loss.adversarial:
            return self.hidden_loss.resolved()(h_s, h_t, mask)
        key = pair_key(pair)
        assert self.critics is not None
        self.critics.to(h_s.device)
        if self.training and torch.is_grad_enabled():
            logs[f"critic/{key}"] = torch.tensor(self.critics.step(key, h_s, h_t, mask))
        return self.hidden_loss.resolved()(self.critics[key], h_s, mask)  # the student's side against its critic

    def _attention_term(
        self, out: StudentOutput, targets: Mapping[str, torch.Tensor], masks: TokenMasks, logs: dict, any_trained: bool
    ) -> torch.Tensor:
        """Σ over attention pairs of ``attention_kl``; student block j is ``attentions[j - 1]``. A q/k cache's term
        is ``cached_qk_loss`` instead, from the student's recorded queries and keys."""
        if self.teacher_scores is not None:
            # block -> qk_attention.Captured
            recorded = cast("Mapping[int, Captured]", _student_field(
                out, "attention_qkv", "the q/k recorder (DistillModel runs it for a q/k cache)"))

            def qk_value(s: int, t: int) -> torch.Tensor:
                if s not in recorded:
                    raise LossError(f"the student's block {s} recorded no queries and keys")
                flags = self.attention_flags
                return cached_qk_loss(flags.attention_loss, recorded[s], targets, t, self.teacher_scores or {},
                                      masks.real, masks.trained, flags.relation_heads)
            return _pair_sum(logs, "attention", self.attention_map, any_trained, lambda s: recorded[s].q, qk_value)
        maps = _student_field(out, "attentions", "output_attentions=True and attention_maps.MAPS_ATTENTION")

        def map_value(s: int, t: int) -> torch.Tensor:
            # Rows of trained tokens, over every real key: the teacher saw the whole context.
            return attention_kl(_layer(maps, s - 1, "attention map", shown=s), _target(targets, f"attention/{t}"),
                                masks.real, queries=masks.trained)
        return _pair_sum(logs, "attention", self.attention_map, any_trained, lambda s: maps[s - 1], map_value)

    def _build_projectors(self, student_dim: int | None, teacher_dim: int | None, seed: int) -> Projectors:
        wanted = bool(self.layer_map) and self.hidden_loss.projector
        if wanted and (student_dim is None or teacher_dim is None):
            raise LossError(f"the {self.hidden_loss.name} hidden loss needs student_dim and teacher_dim for its "
                            f"projectors")
        return Projectors(self.layer_map if wanted else [], student_dim or 0, teacher_dim or 0, seed=seed)

    def _check_config(self) -> None:
        """What the options' own checks (``LossOptions.validate``, where flags and API options enter) leave out: the
        top-k variant (a choice of the flag, not of the Python API's options) and the CE kind (internal)."""
        problems = []
        variant = self.kl_setup.topk_variant
        if variant not in TOPK_VARIANTS:
            problems.append(f"unknown top-k variant {variant!r}; choose one of {', '.join(TOPK_VARIANTS)}")
        if self.ce not in CE_KINDS:
            problems.append(f"unknown CE kind {self.ce!r}; choose one of {', '.join(CE_KINDS)}")
        if problems:
            raise LossError("; ".join(problems))


def _family(term: str) -> str:
    """Which weight scales a term: every logit kind's term is the KL's (asked of the registry when the loss runs,
    so that a kind registered after this module was imported counts too)."""
    if term in ("ce", "kl", "hidden", "attention"):
        return term
    terms = {kind.term for kind in logit_kinds.kinds()}
    if term not in terms:  # a kind's term misnamed
        raise LossError(f"loss term {term!r} is neither ce, kl, hidden, attention nor a registered logit kind's "
                        f"term ({sorted(terms)})")
    return "kl"


def _pair_sum(logs: dict, kind: str, pairs: list[Pair], any_trained: bool, student: Callable[[int], torch.Tensor],
              value: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Σ over ``pairs`` of ``value(s, t)``, each logged as ``{kind}/s{s}_t{t}``. A batch with no trained token adds
    instead, per pair, a 0 tied to its student tensor (``student(s)``), under the names a full batch logs."""
    total = torch.zeros(())
    for s, t in pairs:
        term = value(s, t) if any_trained else student(s).sum() * 0.0
        logs[f"{kind}/{pair_key((s, t))}"] = term.detach()
        total = total + term
    return total


def _target(targets: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in targets:
        raise LossError(f"the loss needs the cached target {name!r}, but the batch holds {', '.join(sorted(targets))}")
    return targets[name]


def _student_field(out: StudentOutput, field: str, how: str) -> Sequence[torch.Tensor]:
    value = getattr(out, field, None)
    if value is None:
        raise LossError(f"the student returned no {field}; call it with {how}")
    return value


def _layer(seq: Sequence[torch.Tensor], index: int, what: str, shown: int | None = None) -> torch.Tensor:
    if not 0 <= index < len(seq):
        raise LossError(f"the student has no {what} for layer {index if shown is None else shown}")
    return seq[index]
