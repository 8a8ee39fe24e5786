"""What DeepSpeed trains: the HF student and the distillation loss over every token stream of the cache.

The loss is one ``CompoundLoss`` per token stream that has a term, plus the cross-attention term between
streams (see ``plan``):

* the stream that carries the logits (the only one, or ``decoder``): α·CE, β·KL or top-k KL, γ·hidden and
  δ·self-attention. CE is shifted for causal students and per token otherwise (an encoder-decoder's labels are
  the cached decoder ids, which the student's ``prepare_decoder_input_ids_from_labels`` shifts into its inputs);
* any other stream (``encoder``): γ·hidden and δ·self-attention;
* δ·cross-attention KL on decoder-query / encoder-key maps.

Each stream has its own projectors (pair ``s2_t4`` of the encoder is not the decoder's), and every term is logged
on its own: ``ce``, ``topk_kl``, ``hidden/s1_t2`` (one stream), or ``encoder/hidden``,
``decoder/hidden/s1_t2``, ``cross_attention`` ...
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kdcache.stages.common.architectures import is_causal_config
from kdcache.stages.common.documents import document_attention_mask, documents_apart_problem
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.attention.qk_attention import QKRecorder
from kdcache.stages.targets.logits import LogitKind
from kdcache.stages.train.core.layer_maps import Pair, pair_key
from kdcache.stages.train.core.masks import stream_masks
from kdcache.stages.train.core.options import TrainOptions, resolved_temperature
from kdcache.stages.train.core.plan import StreamPairs, TrainPlan
from kdcache.stages.train.core.student import StudentFacts
from kdcache.stages.train.core.student_head import base_forward, choose_head
from kdcache.stages.train.losses import LossError, cross_attention_kl
from kdcache.stages.train.objective.compound import CompoundLoss, StudentOutput
from kdcache.stages.train.objective.recording import recorded
from kdcache.storage import ArrayKind, prefixed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.stages.targets.logits.teacher_head import TeacherHead


FAMILIES = ("ce", "kl", "hidden", "attention")  # the weights of a stream's terms (CompoundLoss.weights)


def unprefixed_terms() -> set[str]:
    """Logged under their own names whatever the stream: CE and every logit kind's term (the registry's, live)."""
    return {"ce", "kl", *(kind.term for kind in logit_kinds.kinds())}


def stream_view(batch: Mapping[str, torch.Tensor], stream: str, main: bool) -> dict[str, torch.Tensor]:
    """The batch as one stream's ``CompoundLoss`` reads it: ``input_ids``, ``hidden/{j}``, ``attention/{j}``, and
    the logits targets for the ``main`` stream (they live on its tokens)."""
    if not stream:
        return dict(batch)
    prefix = stream + "/"
    view = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
    if main:
        view.update({k: v for k, v in batch.items() if k.startswith("logits/")})
    return view


def student_view(out: StudentOutput, stream: str, main: bool) -> StudentOutput:
    """The student's outputs for one stream: HF names them ``hidden_states`` for one stack and
    ``encoder_hidden_states`` / ``decoder_hidden_states`` (same for attentions) for two."""
    if not stream:
        return out
    return SimpleNamespace(logits=out.logits if main else None,
                           hidden_states=getattr(out, f"{stream}_hidden_states"),
                           attentions=getattr(out, f"{stream}_attentions"))


class _Critics:
    """Every stream's wgan critic trainers, saved and restored together (the loop sees one object)."""

    def __init__(self, parts: dict[str, Any]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {stream: critics.state_dict() for stream, critics in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, critics in self.parts.items():
            critics.load_state_dict(state[stream])


def _module_key(stream: str) -> str:
    return stream or "tokens"  # nn.ModuleDict keys cannot be empty


class DistillLoss(nn.Module):
    """The distillation loss over every stream; see the module docstring.

    Args:
        parts: stream name -> its compound loss (streams with no term are left out; the main stream is last).
        cross_pairs: (student decoder block, teacher decoder block) pairs of the cross-attention term.
        delta: the attention weight (applies to cross-attention as to self-attention).
    """

    def __init__(self, parts: dict[str, CompoundLoss], cross_pairs: Sequence[Pair] = (), delta: float = 0.0):
        super().__init__()
        self.streams = list(parts)
        self.parts = nn.ModuleDict({_module_key(s): part for s, part in parts.items()})
        self.cross_pairs, self.delta = [(int(s), int(t)) for s, t in cross_pairs], delta
        critics = {s: part.critics for s, part in parts.items() if part.critics is not None}
        # One stream keeps its critics' own state layout, so checkpoints of single-stream runs read as before.
        self.critics = (None if not critics else next(iter(critics.values())) if len(parts) == 1
                        else _Critics(critics))

    @property
    def projectors(self) -> nn.Module:
        """The projectors exported beside the student: one stream's own, or every stream's by name."""
        if len(self.streams) == 1:
            return self.part(self.streams[0]).projectors
        return nn.ModuleDict({_module_key(s): self.part(s).projectors for s in self.streams})

    def part(self, stream: str) -> CompoundLoss:
        """The compound loss of ``stream``."""
        return cast(CompoundLoss, self.parts[_module_key(stream)])

    def forward(self, out: Any, batch: Mapping[str, torch.Tensor],
                scales: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Returns ``{"loss": total with graph, ...every term detached}``. ``scales``: each term's n / R for its
        optimizer step (``step_norm``, keyed as ``step_norm.term_counts``); None: every term is this batch's mean."""
        logs: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        scales = scales or {}
        for stream in self.streams:
            main = stream == self.streams[-1]
            own = {f: scales[prefixed(stream, f)] for f in FAMILIES if prefixed(stream, f) in scales}
            terms = self.part(stream)(student_view(out, stream, main), stream_view(batch, stream, main),
                                      batch[prefixed(stream, "mask")], own)
            loss = terms.pop("loss")
            total = loss if total is None else total + loss
            unprefixed = unprefixed_terms()
            logs.update({k if k in unprefixed else prefixed(stream, k): v for k, v in terms.items()})
        if self.cross_pairs:
            cross = self._cross_term(out, batch, logs, scales.get("cross_attention", 1.0))
            total = self.delta * cross if total is None else total + self.delta * cross
            logs["cross_attention"] = cross.detach()
        assert total is not None, "a DistillLoss has at least one part or cross pair"
        return {"loss": total, **logs}

    def _cross_term(self, out: Any, batch: Mapping[str, torch.Tensor], logs: dict, scale: float) -> torch.Tensor:
        maps = out.cross_attentions
        queries = stream_masks(batch, "decoder/", causal=False).trained  # trained decoder tokens, every real key
        total = torch.zeros((), device=queries.device)
        for s, t in self.cross_pairs:
            value = scale * cross_attention_kl(maps[s - 1], batch[f"cross_attention/{t}"], queries,
                                               batch["encoder/mask"])
            logs[f"cross_attention/{pair_key((s, t))}"] = value.detach()
            total = total + value
        return total


def _stream_loss(options: TrainOptions, pairs: StreamPairs, facts: StudentFacts, *, main: bool,
                 logit_kind: LogitKind | None, seed: int, head: TeacherHead | None,
                 scores: Mapping[str, Any] | None = None) -> CompoundLoss | None:
    """One stream's CompoundLoss, or None when it would have no term (the main stream always gets one, so that
    a run with every weight at 0 fails with the loss's own message)."""
    loss = options.loss
    alpha = loss.ce_weight if main and facts.has_lm_head else 0.0
    beta = loss.kl_weight if main and logit_kind else 0.0
    gamma = loss.gamma if pairs.hidden_pairs else 0.0
    delta = loss.delta if pairs.attention_pairs else 0.0
    if not main and not (gamma > 0 or delta > 0):
        return None
    sizes = set(pairs.teacher_hidden_sizes.values())
    return CompoundLoss(
        layer_map=pairs.hidden_pairs, student_dim=facts.hidden_size, teacher_dim=max(sizes) if sizes else None,
        alpha=alpha, beta=beta, gamma=gamma, delta=delta, temperature=resolved_temperature(loss),
        hidden_loss=loss.hidden, topk_variant=loss.topk_kl, ce="causal" if facts.is_causal else "token",
        attention_map=pairs.attention_pairs or None, critic_steps=loss.critic_steps,
        critic_lr=loss.critic_lr, seed=seed, teacher_head=head if main and beta > 0 else None,
        attention_loss=loss.attention_loss, relation_heads=loss.relation_heads, teacher_scores=scores,
        logit_kind=logit_kind if main else None)


def build_criterion(options: TrainOptions, plan: TrainPlan, facts: StudentFacts,
                    head: TeacherHead | None = None) -> DistillLoss:
    """The distillation loss for this plan (``head``: the teacher's LM head of a ``--logits head`` cache)."""
    if options.loss.ce_weight > 0 and facts.has_lm_head and not facts.is_causal and not facts.is_encoder_decoder:
        # The cache holds unmasked inputs, so an encoder's per-token CE predicts each token from itself.
        print("kdcache train: note: CE on an encoder (masked-LM) student is a near-trivial objective here, "
              "because cached inputs are unmasked; consider --alpha 0", file=sys.stderr)
    parts: dict[str, CompoundLoss] = {}
    for i, pairs in enumerate(plan.streams):
        part = _stream_loss(options, pairs, facts, main=pairs is plan.main, logit_kind=plan.logit_kind,
                            seed=options.data.seed + i, head=head,
                            scores=None if plan.source.student_maps else plan.attention_scores)
        if part is not None:
            parts[pairs.stream] = part
    return DistillLoss(parts, plan.cross_attention_pairs if options.loss.delta > 0 else (), options.loss.delta)


def student_inputs(student: PreTrainedModel, batch: Mapping[str, torch.Tensor],
                   causal: bool | None = None) -> dict[str, Any]:
    """The student's forward arguments from a collated batch (see ``streaming.collate``).

    One stream: ``input_ids`` and ``mask``; rows packed with documents kept apart also give ``position_ids`` and
    the 4-D mask that keeps attention inside each document, as the teacher had. Two streams: the encoder's ids
    and mask, and the decoder teacher-forced on the cached decoder ids (the labels), shifted by the student's
    own rule. ``causal``: whether the student attends causally (worked out from its config when None).
    """
    if ArrayKind.INPUT_IDS in batch and ArrayKind.POSITION_IDS in batch:
        causal = is_causal_config(student.config) if causal is None else causal
        mask = document_attention_mask(batch["position_ids"], batch["mask"], causal=causal, dtype=student.dtype)
        return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch["position_ids"]}
    if ArrayKind.INPUT_IDS in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["mask"]}
    labels = batch["decoder/input_ids"]
    return {"input_ids": batch["encoder/input_ids"], "attention_mask": batch["encoder/mask"],
            "decoder_input_ids": student.prepare_decoder_input_ids_from_labels(labels=labels),  # type: ignore[operator]
            "decoder_attention_mask": batch["decoder/mask"], "use_cache": False}


def check_documents_apart(student: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> None:
    """On a batch of rows packed with documents kept apart, refuse a student that does not keep them apart the way
    the teacher did (``stages.common.documents.documents_apart_problem``), in eval mode so dropout does not count.

    Raises:
        LossError: naming the student class and the difference.
    """
    if ArrayKind.POSITION_IDS not in batch:
        return
    training = student.training
    student.eval()
    try:
        with torch.no_grad():
            problem = documents_apart_problem(student, batch["input_ids"], batch["mask"], batch["position_ids"],
                                              causal=is_causal_config(student.config))
    finally:
        student.train(training)
    if problem is not None:
        raise LossError(f"packed documents: the student {type(student).__name__} does not keep them apart with "
                        f"restarting positions and a 4-D mask ({problem}); use a cache written with --packing "
                        f"concat or none for this student")


def unwrapped_student(student: object) -> PreTrainedModel:
    """The transformers model that runs: a PEFT model's own (its adapters are injected into that model's layers, so
    they run with it and its hidden states are the adapted ones), else ``student`` itself."""
    get_base = getattr(student, "get_base_model", None)
    return cast("PreTrainedModel", get_base() if callable(get_base) else student)


class StudentRunner:
    """The student's forward on a cached batch, as every loss of this package wants it: hidden states and attention
    maps when the plan pairs them, the LM head applied by the losses chunk by chunk when it is a plain linear layer
    (``student_head.choose_head``, decided on the first batch), the queries and keys recorded for a q/k cache, and
    packed rows checked once to keep documents apart. ``kdcache train`` (``DistillModel``), ``DistillationLoss`` and
    ``CacheTrainer`` all run the student through it.

    Args:
        student: a transformers model, or a PEFT model wrapping one (``unwrapped_student``).
        plan: the training plan (which outputs to ask for, which blocks to record).
        vocab: whether a vocabulary term (CE or KL) is on, so that the head choice is worth announcing.
        announce: say which path the vocabulary losses take (rank 0, without --quiet).
    """

    def __init__(self, student: object, plan: TrainPlan, *, vocab: bool, announce: bool = True):
        model = unwrapped_student(student)
        self.announce = announce and vocab
        self.want_hidden, self.want_attention = plan.wants_hidden, plan.wants_attention
        self._documents_checked = False
        self._head: tuple[nn.Linear | None] | None = None  # None: undecided until the first batch
        self._causal = is_causal_config(model.config)  # once, not per step
        # A q/k cache: the student's queries and keys of the paired blocks are recorded as it runs (SDPA underneath).
        self.recorder = QKRecorder(model, plan.qk_blocks, self._causal) if plan.qk_blocks else None

    def __call__(self, student: object, batch: Mapping[str, Any]) -> Any:
        """The student's outputs on ``batch`` (on the device, as ``streaming.to_device`` makes it)."""
        model = unwrapped_student(student)
        if not self._documents_checked:
            check_documents_apart(model, batch)
            self._documents_checked = True
        inputs = student_inputs(model, batch, self._causal)
        if self._head is None:
            self._head = (choose_head(model, inputs, one_stream=ArrayKind.INPUT_IDS in batch, announce=self.announce),)
        head = self._head[0]

        def run(attentions: bool) -> Any:
            if head is not None:  # the losses apply the head: the base model only
                return base_forward(model, head, inputs, hidden=self.want_hidden, attentions=attentions)
            return model(**inputs, output_hidden_states=self.want_hidden, output_attentions=attentions)

        # A q/k cache needs no maps from the student: its recorder takes the queries and keys as it runs.
        return run(self.want_attention) if self.recorder is None else recorded(self.recorder, lambda: run(False))


def has_vocab_term(criterion: DistillLoss) -> bool:
    """Whether any stream's loss has CE or a logit KL (α or β > 0)."""
    return any(max(criterion.part(s).weights["ce"], criterion.part(s).weights["kl"]) > 0 for s in criterion.streams)


class DistillModel(nn.Module):
    """The module DeepSpeed trains: the HF student and the loss (with its projectors) side by side.

    ``forward(batch)`` runs the student on the cached token ids (``StudentRunner``) and returns the loss terms.
    """

    def __init__(self, student: PreTrainedModel, criterion: DistillLoss, plan: TrainPlan, *, announce: bool = True):
        super().__init__()
        self.student: PreTrainedModel = student
        self.criterion = criterion
        self.runner = StudentRunner(student, plan, vocab=has_vocab_term(criterion), announce=announce)

    @property
    def recorder(self) -> QKRecorder | None:
        """The q/k recorder of a q/k cache's run, else None."""
        return self.runner.recorder

    def forward(self, batch: dict[str, Any], scales: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Args: batch on the device, as ``streaming.collate`` makes it, with fp32 targets (dense logits as stored,
        fp16 / bf16); ``scales``: each term's share of its optimizer step (``step_norm``)."""
        return self.criterion(self.runner(self.student, batch), batch, scales)
