"""Seq2seq students in stage two: the batch, the loss and the module DeepSpeed trains.

The loss is two ``CompoundLoss`` instances, one per stack, plus a cross-attention term:

* decoder side: α·CE on the target tokens (the labels are the cached ``decoder/input_ids``; the student's own
  ``prepare_decoder_input_ids_from_labels`` shifts them into decoder inputs, so position t predicts target t
  and no further shift is applied), β·KL or top-k KL on the decoder logits, γ·hidden and δ·self-attention on
  decoder pairs;
* encoder side: γ·hidden and δ·self-attention on encoder pairs;
* δ·cross-attention KL on decoder-query / encoder-key maps.

Each stack has its own projectors (pair "s2_t4" of the encoder is not the decoder's), and every term is logged
on its own: ``ce``, ``topk_kl``, ``encoder/hidden``, ``decoder/hidden/s1_t2``, ``cross_attention``, ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from kdcache.stages.train.compound import CompoundLoss
from kdcache.stages.train.layer_maps import pair_key
from kdcache.stages.train.losses.cross_attention import cross_attention_kl
from kdcache.stages.train.options import TrainOptions
from kdcache.stages.train.seq2seq_plan import Seq2SeqPlan
from kdcache.stages.train.student import StudentFacts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Pair = tuple[int, int]


# ---- batches ------------------------------------------------------------------------------------------------
def collate_seq2seq(sequences: list[dict[str, np.ndarray]], sample_ids: Sequence[int], pin: bool = False) -> dict:
    """Pad cached seq2seq sequences into one batch, keeping stored dtypes (see ``streaming.collate``).

    Returns:
        ``encoder/input_ids`` / ``encoder/mask`` ``[B, L_e]``, ``decoder/input_ids`` / ``decoder/mask``
        ``[B, L_d]`` (int64, 0 at padding), ``encoder/hidden/{j} [B, L_e, d]``, ``decoder/hidden/{j}`` and
        logits ``[B, L_d, ...]``, ``encoder/attention/{j} [B, H', L_e, L_e]``, ``decoder/attention/{j}
        [B, H', L_d, L_d]``, ``cross_attention/{j} [B, H', L_d, L_e]``, and ``sample_ids [B]``.
    """
    size = {side: max(len(s[f"{side}/input_ids"]) for s in sequences) for side in ("encoder", "decoder")}
    out: dict[str, torch.Tensor] = {"sample_ids": torch.tensor(list(sample_ids), dtype=torch.int64)}
    for side in ("encoder", "decoder"):
        mask = np.zeros((len(sequences), size[side]), dtype=np.int64)
        for i, s in enumerate(sequences):
            mask[i, :len(s[f"{side}/input_ids"])] = 1
        out[f"{side}/mask"] = torch.from_numpy(mask)
    for name in sequences[0]:
        out[name] = torch.from_numpy(_pad_stack(name, [s[name] for s in sequences], size))
    if pin and torch.cuda.is_available():
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


def _streams_of(name: str) -> tuple[str, ...]:
    """The stream each ragged dim of a per-sequence array follows, in order."""
    if name.startswith("cross_attention/"):
        return ("decoder", "encoder")
    side = "encoder" if name.startswith("encoder/") else "decoder"  # logits live on decoder tokens
    return (side, side) if "/attention/" in name else (side,)


def _pad_stack(name: str, arrays: list[np.ndarray], size: dict[str, int]) -> np.ndarray:
    """Zero-pad ragged arrays to ``[B, ...]``: dim 0 is ragged (tokens), or dims 1 and 2 for attention maps
    (after the heads). fp16 stays fp16, bf16 bits become int16, ids int64 (as ``streaming.collate``)."""
    from kdcache.stages.train.streaming import _batch_dtype

    streams = _streams_of(name)
    ragged = (1, 2) if len(streams) == 2 else (0,)
    shape = list(arrays[0].shape)
    for dim, stream in zip(ragged, streams):
        shape[dim] = size[stream]
    dtype = _batch_dtype("input_ids" if name.endswith("input_ids") else name, arrays[0].dtype)
    out = np.zeros((len(arrays), *shape), dtype=dtype)
    for i, a in enumerate(arrays):
        bf16_bits = a.dtype == np.uint16 and dtype == np.int16  # uint16 ids are cast, bf16 bits reinterpreted
        rows: tuple[Any, ...] = (i, *(slice(0, n) for n in a.shape))
        out[rows] = a.view(dtype) if bf16_bits else a
    return out


# ---- the loss ---------------------------------------------------------------------------------------------------
def _side_view(batch: Mapping[str, torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    """The batch as one stream's ``CompoundLoss`` expects it: ``input_ids``, ``hidden/{j}``, ``attention/{j}``
    (and, for the decoder, the logits targets, which live on decoder tokens)."""
    prefix = side + "/"
    view = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
    if side == "decoder":
        view.update({k: v for k, v in batch.items() if k.startswith("logits/")})
    return view


class _Critics:
    """Both stacks' wgan critic trainers, saved and restored together (the loop sees one object)."""

    def __init__(self, parts: dict[str, Any]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {side: critics.state_dict() for side, critics in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for side, critics in self.parts.items():
            critics.load_state_dict(state[side])


class Seq2SeqLoss(nn.Module):
    """The compound loss of a seq2seq student; see the module docstring.

    Args:
        encoder, decoder: the per-stack compound losses, or None for a stack with no term.
        cross_pairs: (student decoder block, teacher decoder block) pairs of the cross-attention term.
        delta: the attention weight (applies to cross-attention as to self-attention).
    """

    def __init__(self, encoder: CompoundLoss | None, decoder: CompoundLoss | None, cross_pairs: Sequence[Pair],
                 delta: float):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.cross_pairs, self.delta = [tuple(p) for p in cross_pairs], delta
        parts = {side: part.critics for side, part in (("encoder", encoder), ("decoder", decoder))
                 if part is not None and part.critics is not None}
        self.critics = _Critics(parts) if parts else None

    @property
    def projectors(self) -> nn.ModuleDict:
        """Both stacks' projectors (what the loop exports beside the student)."""
        return nn.ModuleDict({side: part.projectors for side, part in (("encoder", self.encoder),
                                                                         ("decoder", self.decoder)) if part})

    def forward(self, out: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Returns ``{"loss": total with graph, ...every term detached}``."""
        logs: dict[str, torch.Tensor] = {}
        total = torch.zeros((), device=batch["decoder/mask"].device)
        for side, part in (("decoder", self.decoder), ("encoder", self.encoder)):
            if part is None:
                continue
            view = SimpleNamespace(logits=out.logits if side == "decoder" else None,
                                   hidden_states=getattr(out, f"{side}_hidden_states"),
                                   attentions=getattr(out, f"{side}_attentions"))
            terms = part(view, _side_view(batch, side), batch[f"{side}/mask"])
            total = total + terms.pop("loss")
            logs.update({_log_name(side, k): v for k, v in terms.items()})
        if self.cross_pairs:
            cross = self._cross_term(out, batch, logs)
            total = total + self.delta * cross
            logs["cross_attention"] = cross.detach()
        return {"loss": total, **logs}

    def _cross_term(self, out: Any, batch: Mapping[str, torch.Tensor], logs: dict) -> torch.Tensor:
        maps = out.cross_attentions
        total = torch.zeros((), device=batch["decoder/mask"].device)
        for s, t in self.cross_pairs:
            value = cross_attention_kl(maps[s - 1], batch[f"cross_attention/{t}"], batch["decoder/mask"],
                                       batch["encoder/mask"])
            logs[f"cross_attention/{pair_key((s, t))}"] = value.detach()
            total = total + value
        return total


def _log_name(side: str, term: str) -> str:
    """Decoder CE and KL keep their usual names; hidden and attention terms get their stack's prefix."""
    return term if term in ("ce", "kl", "topk_kl") else f"{side}/{term}"


# ---- building it ------------------------------------------------------------------------------------------------
def _side_loss(options: TrainOptions, hidden: Sequence[Pair], attention: Sequence[Pair], sizes: dict[int, int],
               facts: StudentFacts, *, decoder: bool, logits: str | None) -> CompoundLoss | None:
    """One stack's CompoundLoss, or None when it would have no term. CE is per token: labels are targets."""
    alpha = options.alpha if decoder else 0.0
    beta = options.beta if decoder and logits else 0.0
    gamma, delta = (options.gamma if hidden else 0.0), (options.delta if attention else 0.0)
    if not (alpha > 0 or beta > 0 or gamma > 0 or delta > 0):
        return None
    return CompoundLoss(
        layer_map=hidden, student_dim=facts.hidden_size, teacher_dim=max(sizes.values()) if sizes else None,
        alpha=alpha, beta=beta, gamma=gamma, delta=delta, temperature=options.temperature,
        hidden_loss=options.hidden_loss, topk_variant=options.topk_kl, ce="token", attention_map=attention or None,
        critic_steps=options.critic_steps, critic_lr=options.critic_lr, seed=options.seed + (1 if decoder else 0))


def build_seq2seq_loss(options: TrainOptions, plan: Seq2SeqPlan, facts: StudentFacts) -> Seq2SeqLoss:
    """The seq2seq compound loss for this plan."""
    encoder = _side_loss(options, plan.encoder_hidden_pairs, plan.encoder_attention_pairs,
                         plan.encoder_hidden_sizes or {}, facts, decoder=False, logits=None)
    decoder = _side_loss(options, plan.hidden_pairs, plan.attention_pairs, plan.teacher_hidden_sizes, facts,
                         decoder=True, logits=plan.logits)
    return Seq2SeqLoss(encoder, decoder, plan.cross_attention_pairs if options.delta > 0 else (), options.delta)


class Seq2SeqDistillModel(nn.Module):
    """What DeepSpeed trains for a seq2seq student: the HF model and the loss (with its projectors)."""

    def __init__(self, student: PreTrainedModel, criterion: Seq2SeqLoss, plan: Seq2SeqPlan):
        super().__init__()
        self.student: PreTrainedModel = student
        self.criterion = criterion
        self.want_hidden = bool(plan.hidden_pairs or plan.encoder_hidden_pairs)
        self.want_attention = bool(plan.attention_pairs or plan.encoder_attention_pairs or plan.cross_attention_pairs)

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Teacher-forced forward on the cached target; batch as ``collate_seq2seq`` makes it, on the device."""
        labels = batch["decoder/input_ids"]
        out = self.student(input_ids=batch["encoder/input_ids"], attention_mask=batch["encoder/mask"],
                           decoder_input_ids=self.student.prepare_decoder_input_ids_from_labels(  # type: ignore[operator]
                               labels=labels),
                           decoder_attention_mask=batch["decoder/mask"], use_cache=False,
                           output_hidden_states=self.want_hidden, output_attentions=self.want_attention)
        return self.criterion(out, batch)


def build_seq2seq_model(options: TrainOptions, plan: Seq2SeqPlan, facts: StudentFacts,
                        student: PreTrainedModel) -> Seq2SeqDistillModel:
    """The module handed to DeepSpeed (``loop.run_training`` calls this for a seq2seq plan)."""
    return Seq2SeqDistillModel(student, build_seq2seq_loss(options, plan, facts), plan)
