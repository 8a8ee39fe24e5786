"""The run's loss, one module for ``kdcache train``, ``CacheTrainer``, evaluation and the Python API.

``DistillationLoss`` is built in one place (``_assemble``) from the run's options and plan, worked out from a cache
and a student (the API) or handed over by the loop (``planned``). It holds a ``CompoundLoss`` per token stream with
a term (α·CE, β·KL on the stream carrying the logits; γ·hidden, δ·attention on each), each with its projectors,
plus δ·cross-attention KL, and runs the student as its terms want (``student_outputs``). It sits on ``train``'s own
floor, above ``objective`` and ``cross``, because a loss built from a cache checks, streams and exports it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kdcache.stages.common.architectures import is_causal_config
from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.attention.qk_attention import QKRecorder
from kdcache.stages.train.api import (
    API_SPEAKER,
    ApiError,
    CacheDataset,
    StreamArgs,
    api_spelling,
    fit_student,
    loss_options,
    open_cache,
    teacher_head_for,
    use_maps_attention,
)
from kdcache.stages.train.checkpoint import PLAN_FILE, STUDENT_DIR, add_tokenizer, save_projectors, write_plan
from kdcache.stages.train.core.checks import CacheCheckError
from kdcache.stages.train.core.layer_maps import pair_key
from kdcache.stages.train.core.masks import stream_masks
from kdcache.stages.train.core.student import tokenizer_fingerprint_of
from kdcache.stages.train.core.student_head import base_forward, choose_head
from kdcache.stages.train.losses.cross_attention import cross_attention_kl
from kdcache.stages.train.objective.compound import CompoundLoss, StudentOutput
from kdcache.stages.train.objective.distill import (
    check_documents_apart,
    recorded,
    student_inputs,
    student_view,
    unwrapped_student,
)
from kdcache.storage import ArrayKind, CacheReader, prefixed

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import Unpack  # typing's own from Python 3.11

    from kdcache.stages.targets.logits.teacher_head import TeacherHead
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.core.plan import StreamPairs, TrainPlan
    from kdcache.stages.train.core.student import StudentFacts


def _stream_view(batch: Mapping[str, torch.Tensor], stream: str, main: bool) -> dict[str, torch.Tensor]:
    """The batch as one stream's ``CompoundLoss`` reads it: ``input_ids``, ``hidden/{j}``, ``attention/{j}``, and
    the logits targets for the ``main`` stream (they live on its tokens)."""
    if not stream:
        return dict(batch)
    prefix = stream + "/"
    view = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
    if main:
        view.update({k: v for k, v in batch.items() if k.startswith("logits/")})
    return view


class _Critics:
    """Every stream's wgan critic trainers, saved and restored together (the loop sees one object)."""

    def __init__(self, parts: dict[str, Any]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {stream: critics.state_dict() for stream, critics in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, critics in self.parts.items():
            critics.load_state_dict(state[stream])


def _stream_loss(options: TrainOptions, plan: TrainPlan, pairs: StreamPairs, facts: StudentFacts, seed: int,
                 head: TeacherHead | None) -> CompoundLoss | None:
    """One stream's CompoundLoss, or None when it would have no term (the main stream always gets one, so that
    a run with every weight at 0 fails with the loss's own message)."""
    loss = options.loss
    main = pairs is plan.main
    logit_kind = plan.logit_kind
    weights = replace(loss, alpha=loss.ce_weight if main and facts.has_lm_head else 0.0,
                      beta=loss.kl_weight if main and logit_kind else 0.0,
                      gamma=loss.gamma if pairs.hidden_pairs else 0.0,
                      delta=loss.delta if pairs.attention_pairs else 0.0)
    if not main and not (weights.gamma > 0 or weights.delta > 0):
        return None
    sizes = set(pairs.teacher_hidden_sizes.values())
    return CompoundLoss(
        weights, layer_map=pairs.hidden_pairs, student_dim=facts.hidden_size, teacher_dim=max(sizes) if sizes else None,
        ce="causal" if facts.is_causal else "token", attention_map=pairs.attention_pairs or None, seed=seed,
        teacher_head=head if main and weights.kl_weight > 0 else None, logit_kind=logit_kind if main else None,
        teacher_scores=None if plan.source.student_maps else plan.attention_scores)


def _stream_parts(options: TrainOptions, plan: TrainPlan, facts: StudentFacts,
                  head: TeacherHead | None) -> dict[str, CompoundLoss]:
    """Stream name -> its ``CompoundLoss``, for the streams with a term (the main stream last, as in the plan)."""
    # CE on an encoder (masked-LM) student is near-trivial: the cache holds unmasked inputs, so its per-token CE
    # predicts each token from itself.
    if options.loss.ce_weight > 0 and facts.has_lm_head and not facts.is_causal and not facts.is_encoder_decoder:
        print("kdcache train: note: CE on an encoder (masked-LM) student is a near-trivial objective here, "
              "because cached inputs are unmasked; consider --alpha 0", file=sys.stderr)
    parts: dict[str, CompoundLoss] = {}
    for i, pairs in enumerate(plan.streams):
        part = _stream_loss(options, plan, pairs, facts, options.data.seed + i, head)
        if part is not None:
            parts[pairs.stream] = part
    return parts


def _module_key(stream: str) -> str:
    return stream or "tokens"  # nn.ModuleDict keys cannot be empty


class DistillationLoss(nn.Module):
    """``kdcache train``'s loss as a module: it owns the projectors (and any wgan critics) and is called as
    ``loss(student_outputs, batch) -> {"loss": total, "ce": ..., "topk_kl": ..., "hidden/s1_t2": ...}``: the
    total with its graph, every term detached and unweighted, named as ``kdcache train`` logs them.

    Args:
        cache: a cache folder or URL, or an open ``CacheReader``; the teacher is never loaded.
        student: the transformers model being trained, or a PEFT model wrapping one. When the attention term reads
            maps, it is switched to the attention that returns them before dropout, with a ``UserWarning`` saying
            so.
        announce: print the notes ``kdcache train`` prints (rank 0); off by default.
        tokenizer: the student's tokenizer, checked against the cache's; default: the one in the student's
            folder, when it has one.
        allow_partial: train from the committed shards of a cache still being written (a path only; an open
            ``CacheReader`` was opened with its own choice, ``open_cache(path, allow_partial=True)``).
        **options: ``kdcache train``'s loss and map options by their flag names: ``alpha``, ``beta``, ``gamma``,
            ``delta``, ``temperature``, ``hidden_loss``, ``topk_kl``, ``attention_loss``, ``relation_heads``,
            ``critic_steps``, ``critic_lr``, ``layer_map``, ``attention_layers`` (maps as text, e.g.
            ``"explicit:1-2,2-4"``), ``seed`` (projector init); unset ones take the CLI's defaults.

    The module is built on the CPU: move it with the student (``loss.to(device)``) and give its parameters to the
    optimizer with the student's.

    Raises:
        ApiError: an unknown option or a refused value; CacheCheckError: the cache does not fit the student.
    """

    def __init__(self, cache: str | os.PathLike[str] | CacheReader, student: object, *, announce: bool = False,
                 tokenizer: PreTrainedTokenizerBase | None = None, allow_partial: bool = False, **options: object):
        super().__init__()
        reader = (open_cache(os.fspath(cache), allow_partial=allow_partial) if isinstance(cache, (str, os.PathLike))
                  else cache)
        resolved = loss_options(reader, options)
        use_maps_attention(student, reader, resolved.loss.delta)
        model = unwrapped_student(student)
        folder = getattr(model, "name_or_path", "") or ""  # the tokenizer given, else the student's folder's
        fingerprint = (tokenizer_fingerprint(tokenizer) if tokenizer is not None
                       else tokenizer_fingerprint_of(folder) if folder else None)
        try:
            resolved, facts, plan = fit_student(resolved, reader, model, tokenizer=fingerprint,
                                                speaker=API_SPEAKER, announce=announce)
        except CacheCheckError as error:  # the checks are training's: said here as the API spells the options
            raise CacheCheckError([api_spelling(p) for p in error.problems]) from None
        head = teacher_head_for(reader, plan, speaker=API_SPEAKER, announce=announce)
        self._assemble(resolved, plan, facts, reader, student, head=head, announce=announce)

    @classmethod
    def planned(cls, options: TrainOptions, plan: TrainPlan, facts: StudentFacts, reader: CacheReader,
                student: object, *, head: TeacherHead | None = None, announce: bool = True) -> DistillationLoss:
        """The loss of options and a plan already worked out and checked (``kdcache train``'s loop: ``fit_student``,
        ``teacher_head_for``); ``head``: the teacher's LM head of a ``--logits head`` cache."""
        loss = cls.__new__(cls)
        nn.Module.__init__(loss)
        loss._assemble(options, plan, facts, reader, student, head=head, announce=announce)
        return loss

    def _assemble(self, options: TrainOptions, plan: TrainPlan, facts: StudentFacts, reader: CacheReader,
                  student: object, *, head: TeacherHead | None, announce: bool) -> None:
        """The one construction path: every stream's part, the cross pairs, and the student's forward's settings."""
        parts = _stream_parts(options, plan, facts, head)
        self.streams = list(parts)  # the main stream is last
        self.parts = nn.ModuleDict({_module_key(s): part for s, part in parts.items()})
        self.delta = options.loss.delta
        self.cross_pairs = [(int(s), int(t)) for s, t in plan.cross_attention_pairs] if self.delta > 0 else []
        critics = {s: part.critics for s, part in parts.items() if part.critics is not None}
        # One stream keeps its critics' own state layout, so checkpoints of single-stream runs read as before.
        self.critics = (None if not critics else next(iter(critics.values())) if len(parts) == 1
                        else _Critics(critics))
        self.reader, self.plan, self.options, self.facts = reader, plan, options, facts
        self._student = (student,)  # a tuple: the student is not a submodule (its weights are not the loss's)
        model = unwrapped_student(student)
        # Whether the first batch says which path the vocabulary terms take (rank 0): when a part has one; a model
        # whose vocabulary term is its own (``cross.cross_model``) sets it.
        self.announce_head = announce and any(max(p.weights["ce"], p.weights["kl"]) > 0 for p in parts.values())
        self._documents_checked = False
        self._head: tuple[nn.Linear | None] | None = None  # None: undecided until the first batch
        self._causal = is_causal_config(model.config)  # once, not per step
        # A q/k cache: the student's queries and keys of the paired blocks are recorded as it runs (SDPA underneath).
        self.recorder = QKRecorder(model, plan.qk_blocks, self._causal) if plan.qk_blocks else None
        # The private form: the public register_load_state_dict_pre_hook is torch >= 2.5 and pyproject allows 2.1.
        self._register_load_state_dict_pre_hook(_earlier_keys, with_module=True)

    @property
    def arrays(self) -> tuple[str, ...]:
        """The cached arrays this loss reads (what ``CacheDataset`` should stream)."""
        return self.plan.names

    @property
    def projectors(self) -> nn.Module:
        """The projectors, to save beside the student (``kdcache train`` exports them to ``projectors.pt``): one
        stream's own, or every stream's by name."""
        if len(self.streams) == 1:
            return self.part(self.streams[0]).projectors
        return nn.ModuleDict({_module_key(s): self.part(s).projectors for s in self.streams})

    def part(self, stream: str) -> CompoundLoss:
        """The compound loss of ``stream``."""
        return cast(CompoundLoss, self.parts[_module_key(stream)])

    def forward(self, student_outputs: StudentOutput, batch: Mapping[str, torch.Tensor],
                scales: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Every term of the loss: ``student_outputs`` (a transformers ``ModelOutput`` with ``hidden_states`` /
        ``attentions`` when asked for) against ``batch`` (on the device, from ``CacheDataset.to_device``).
        ``scales``: each term's share of its optimizer step (``StepCounts.scales``, keyed as
        ``step_norm.term_counts``); None: this batch's means."""
        logs: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        scales = scales or {}
        # Logged under their own names whatever the stream: CE and every logit kind's term (the registry's, live).
        unprefixed = {"ce", "kl", *(kind.term for kind in logit_kinds.kinds())}
        for stream in self.streams:
            main = stream == self.streams[-1]
            part = self.part(stream)  # its weights name the families a step's scales key
            own = {f: scales[prefixed(stream, f)] for f in part.weights if prefixed(stream, f) in scales}
            terms = part(student_view(student_outputs, stream, main), _stream_view(batch, stream, main),
                         batch[prefixed(stream, "mask")], own)
            loss = terms.pop("loss")
            total = loss if total is None else total + loss
            logs.update({k if k in unprefixed else prefixed(stream, k): v for k, v in terms.items()})
        if self.cross_pairs:
            cross = self._cross_term(student_outputs, batch, logs, scales.get("cross_attention", 1.0))
            total = self.delta * cross if total is None else total + self.delta * cross
            logs["cross_attention"] = cross.detach()
        assert total is not None, "a DistillationLoss has at least one part or cross pair"
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

    def student_outputs(self, student: object, batch: Mapping[str, Any]) -> Any:
        """The student's outputs on ``batch`` (on the device) as ``kdcache train`` takes them: the LM head applied
        chunk by chunk inside the losses when it is a plain linear layer, q/k recorded for a q/k cache."""
        model = unwrapped_student(student)
        if not self._documents_checked:
            check_documents_apart(model, batch)
            self._documents_checked = True
        inputs = student_inputs(model, batch, self._causal)
        if self._head is None:
            self._head = (choose_head(model, inputs, one_stream=ArrayKind.INPUT_IDS in batch,
                                      announce=self.announce_head),)
        head = self._head[0]
        hidden, attention = self.plan.wants_hidden, self.plan.wants_attention

        def run(attentions: bool) -> Any:
            if head is not None:  # the losses apply the head: the base model only
                return base_forward(model, head, inputs, hidden=hidden, attentions=attentions)
            return model(**inputs, output_hidden_states=hidden, output_attentions=attentions)

        # A q/k cache needs no maps from the student: its recorder takes the queries and keys as it runs.
        return run(attention) if self.recorder is None else recorded(self.recorder, lambda: run(False))

    def inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The student's forward arguments for ``batch`` (on the device), asking for the hidden states and
        attention maps the loss reads. For a q/k cache use ``student_outputs``, which records the queries and keys."""
        model = unwrapped_student(self._student[0])
        return {**student_inputs(model, batch), "output_hidden_states": self.plan.wants_hidden,
                "output_attentions": self.plan.wants_attention}

    def dataset(self, *, batch_size: int, **kwargs: Unpack[StreamArgs]) -> CacheDataset:
        """A ``CacheDataset`` of this cache streaming exactly ``arrays`` (``kwargs``: its other arguments)."""
        return CacheDataset(self.reader, self.arrays, batch_size=batch_size, **kwargs)

    def save_run(self, student: object, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder`` as ``kdcache train`` exports a run, which ``kdcache eval --run`` scores as the trained
        student: ``student/`` (``save_pretrained``, with the cache's tokenizer), ``projectors.pt`` and ``plan.json``.

        Raises:
            ApiError: ``folder`` already holds a run's record and ``overwrite`` is False.
        """
        out = Path(folder)
        if (out / PLAN_FILE).exists() and not overwrite:
            raise ApiError(f"{str(out)!r} already holds a run ({PLAN_FILE}); pass overwrite=True to replace it, or "
                           "choose another folder")
        student_dir = out / STUDENT_DIR
        save = getattr(student, "save_pretrained", None)  # a PEFT model's writes its adapters
        if not callable(save):
            raise ApiError(f"save_run: a {type(student).__name__} has no save_pretrained; expected the transformers "
                           "(or PEFT) model being trained")
        save(str(student_dir))
        with tempfile.TemporaryDirectory(prefix="kdcache-tokenizer-") as scratch:  # a remote cache's copy
            add_tokenizer(student_dir, self.reader.store.fetch_folder("tokenizer", Path(scratch)))
        save_projectors(out, self.projectors, self.critics)
        write_plan(out, self.plan.to_json())
        return out


def _earlier_keys(module: nn.Module, state: dict[str, Any], prefix: str, *_: object) -> None:
    """Read a state dict of the earlier Python API's loss, which held this module as ``criterion`` (its keys
    ``criterion.parts...``), as this module's own: checkpoints written before the loss became one module load."""
    old = prefix + "criterion."
    for key in [k for k in state if k.startswith(old)]:
        state[prefix + key[len(old):]] = state.pop(key)


class DistillModel(nn.Module):
    """The module DeepSpeed trains in ``kdcache train``: the HF student and the run's loss (with its projectors)
    side by side; ``forward(batch, scales)`` runs the student as the loss wants it and returns the loss terms."""

    def __init__(self, student: PreTrainedModel, criterion: DistillationLoss):
        super().__init__()
        self.student: PreTrainedModel = student
        self.criterion = criterion

    def forward(self, batch: dict[str, Any], scales: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Args: batch on the device, as ``streaming.collate`` makes it, with fp32 targets (dense logits as stored,
        fp16 / bf16); ``scales``: each term's share of its optimizer step (``step_norm``)."""
        return self.criterion(self.criterion.student_outputs(self.student, batch), batch, scales)

