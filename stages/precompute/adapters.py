"""Teacher adapters: how one family of teachers is read, loaded and run; the runner is the same for all.

A cache holds named token streams (``storage.core.streams``). An adapter turns the dataset into those streams, resolves
which layers to keep, loads the teacher and runs it on a padded batch of every stream, returning named arrays
per sequence. Two adapters cover the Hugging Face families:

* ``HookedTeacher``: decoder-only and encoder teachers, one stream (``""``). Forward hooks keep only the
  selected layers, so no other layer's tensors stay alive (``capture.FeatureCapture``).
* ``EncoderDecoderTeacher``: encoder-decoder teachers (BART, mBART, T5), streams ``encoder`` and ``decoder``
  (teacher-forced on the target), plus cross-attention; it reads HF's own outputs
  (``EncoderDecoderTeacher.capture``), whose layer numbering and final norms are HF's on both stacks.

A new architecture family is a new adapter, not a new runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch

from kdcache.stages.common.architectures import is_encoder_decoder, lm_class
from kdcache.stages.precompute.capture.features import (
    FeatureCapture,
    check_ranges,
    fp16_bounded,
    hidden_targets,
    max_abs,
    to_storage_dtype,
)
from kdcache.stages.precompute.capture.logit_head import logit_targets
from kdcache.stages.precompute.capture.transfer import ShardItems, as_numpy, cut_padding
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan, RowSetup, TeacherSetup, WriteSetup
from kdcache.stages.precompute.core.targets import Targets
from kdcache.stages.precompute.core.teacher_id import Teacher, teacher_fingerprint
from kdcache.stages.precompute.rows.data import TokenStreams
from kdcache.stages.precompute.rows.row_build import pair_streams, text_streams
from kdcache.stages.precompute.teacher import load_for_inference, load_teacher
from kdcache.stages.targets.hidden.device_codecs import Projection
from kdcache.storage import ArrayKind, applies_to, exact_arrays

if TYPE_CHECKING:
    import numpy as np
    from transformers import PretrainedConfig, PreTrainedTokenizerBase
    from transformers.modeling_outputs import Seq2SeqLMOutput

# One padded batch of every stream: stream -> (ids [B, L], mask [B, L]) on the teacher's device, the B valid
# lengths per stream, and stream -> position_ids [B, L] for rows packed with documents kept apart (else absent).
# A capture queues the batch's work and returns at once; calling what it returns waits for the batch's targets
# and gives one dict of storage-ready arrays per sequence. The caller queues the next batch before it waits, so
# the device never idles while the host takes a batch in (``stream.stream_shards``).
Pending = Callable[[], ShardItems]
Capture = Callable[[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, list[int]], dict[str, torch.Tensor]],
                   Pending]


class TeacherAdapter(ABC):
    """The parts of stage one that depend on the teacher's family; see the module docstring. Which layers to
    keep, the spec and the settings fingerprint follow from the token streams (``targets.py``). What a family
    does not override is a one-stream teacher's."""

    @abstractmethod
    def check_options(self, options: PrecomputeOptions, config: PretrainedConfig) -> None:
        """Refuse options that do not apply to this family, rather than ignore them."""

    def load_data(self, rows: RowSetup, tokenizer: PreTrainedTokenizerBase) -> TokenStreams:
        """The dataset as token streams, in cache order."""
        return text_streams(rows, tokenizer)

    def load_teacher(self, setup: TeacherSetup, config: PretrainedConfig, targets: Targets,
                     tokenizer: PreTrainedTokenizerBase, device: torch.device) -> Teacher:
        """The weights, for inference (eager attention only when maps are captured)."""
        return load_teacher(setup, config, targets, tokenizer, device)  # the module's name, looked up per call

    @abstractmethod
    def capture(self, teacher: Teacher, targets: Targets, plan: PrecomputePlan,
                projection: Projection | None = None) -> AbstractContextManager[Capture]:
        """A context manager giving the ``Capture`` function of this teacher (a rank codec's layers coded through
        ``projection``, or handed out as float32 while it is fitted)."""


class HookedTeacher(TeacherAdapter):
    """Decoder-only and encoder teachers: one token stream, targets captured by forward hooks."""

    _ENCODER_DECODER_ONLY = ("source_column", "target_column", "max_target_length")  # of DatasetOptions

    def check_options(self, options: PrecomputeOptions, config: PretrainedConfig) -> None:
        given = [name for name in self._ENCODER_DECODER_ONLY if getattr(options.dataset, name) is not None]
        per_stream = (options.targets.layers, options.targets.attention_layers)  # a stack's or cross's own value
        given += [f"{name} {s}:{value.text_of(s)}" for name, value in zip(("layers", "attention_layers"), per_stream)
                  if value is not None for s in value.streams if s]
        if ArrayKind.CROSS_ATTENTION in options.targets.features:
            given.append("features cross_attention")
        if given:
            raise PrecomputeError(f"{', '.join(given)}: only for encoder-decoder teachers, and "
                                  f"{options.engine.teacher!r} is a {config.model_type} without a decoder stack")

    def capture(self, teacher: Teacher, targets: Targets, plan: PrecomputePlan,
                projection: Projection | None = None) -> FeatureCapture:
        batch, write = plan.batch, plan.write
        return FeatureCapture(teacher, targets, write.dtype, batch.logits_chunk, plan.teacher.seed, write.hidden_codec,
                              projection, batch.compile_teacher)


class EncoderDecoderTeacher(TeacherAdapter):
    """Encoder-decoder teachers: streams ``encoder`` and ``decoder`` (the target, teacher-forced).

    The decoder is teacher-forced on the target: ``decoder_input_ids`` come from the model's own
    ``prepare_decoder_input_ids_from_labels`` (the shift right with its ``decoder_start_token_id``, which differs
    between BART, mBART and T5), so decoder position t sees target tokens < t and its logits predict target t.

    Unlike the hooked capture, this one asks HF for ``output_hidden_states`` / ``output_attentions`` and keeps
    only the selected layers: the numbering and the final-norm placement are then HF's by construction on both
    stacks (T5 applies ``final_layer_norm`` to the last hidden state; BART does not), at the cost of holding
    every layer of one batch at once, which the batch size bounds.
    """

    _HEAD_KEYS = ("lm_head", "final_logits_bias")  # what a checkpoint without an LM head lacks

    def check_options(self, options: PrecomputeOptions, config: PretrainedConfig) -> None:
        return None  # every option applies; the pair loader refuses a missing --target-column and --packing

    def load_data(self, rows: RowSetup, tokenizer: PreTrainedTokenizerBase) -> TokenStreams:
        return pair_streams(rows, tokenizer)

    def load_teacher(self, setup: TeacherSetup, config: PretrainedConfig, targets: Targets,
                     tokenizer: PreTrainedTokenizerBase, device: torch.device) -> Teacher:
        model = load_for_inference(lm_class(config), setup, device, eager=targets.wants_attention,
                                   optional=() if targets.logit.name else self._HEAD_KEYS)
        fingerprint = {**teacher_fingerprint(setup, model), "num_encoder_layers": targets.streams["encoder"].depth,
                       "num_decoder_layers": targets.streams["decoder"].depth}
        impl = getattr(model.config, "_attn_implementation", None) or "default"
        return Teacher(model, tokenizer, model.config, device, fingerprint, impl)

    @contextmanager
    def capture(self, teacher: Teacher, targets: Targets, plan: PrecomputePlan,
                projection: Projection | None = None) -> Iterator[Capture]:
        """Each batch's sequences: ``encoder/hidden/{j} [L_e, d]``, ``decoder/hidden/{j} [L_d, d]``,
        ``encoder/attention/{j} [H, L_e, L_e]``, ``decoder/attention/{j} [H, L_d, L_d]``, ``cross_attention/{j}
        [H, L_d, L_e]``, logits ``[L_d, ...]``; floats already in the storage dtype. The batch's labels are padded
        with the pad id (never -100, which the shift would not accept everywhere)."""
        model = teacher.model
        if not hasattr(model, "prepare_decoder_input_ids_from_labels"):
            raise PrecomputeError(f"{type(model).__name__} cannot build decoder inputs from labels "
                                  f"(no prepare_decoder_input_ids_from_labels); it is not an encoder-decoder LM")

        exact = frozenset(exact_arrays(targets.logit))  # ids, the fp32 logsumexp, the kept mass...: as computed

        def run(batch: dict[str, tuple[torch.Tensor, torch.Tensor]], lengths: dict[str, list[int]],
                positions: dict[str, torch.Tensor]) -> Pending:
            (src, src_mask), (tgt, tgt_mask) = batch["encoder"], batch["decoder"]
            with torch.inference_mode():
                # checked above (PreTrainedModel does not declare it)
                decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=tgt)  # type: ignore[operator]
                out = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=decoder_input_ids,
                            decoder_attention_mask=tgt_mask, use_cache=False,
                            output_hidden_states=targets.wants_hidden, output_attentions=targets.wants_attention)
                host = _stored(_select(out, targets), exact, plan.write, projection)
            items = ShardItems([cut_padding(host, i, {"encoder": n_e, "decoder": n_d})
                                for i, (n_e, n_d) in enumerate(zip(lengths["encoder"], lengths["decoder"]))])
            return lambda: items

        yield run


def _select(out: Seq2SeqLMOutput, t: Targets) -> dict[str, torch.Tensor]:
    """The selected layers as padded device tensors, by array name."""
    kept: dict[str, torch.Tensor] = {}
    for stream, layers in t.streams.items():  # HF: encoder_hidden_states, decoder_attentions, ...
        kept.update({f"{stream}/hidden/{j}": getattr(out, f"{stream}_hidden_states")[j] for j in layers.hidden})
        kept.update({f"{stream}/attention/{j}": getattr(out, f"{stream}_attentions")[j - 1]
                     for j in layers.attention})
    kept.update({f"cross_attention/{j}": (out.cross_attentions or ())[j - 1] for j in t.cross_attention})
    kept.update(logit_targets(out.logits, t.logit))  # log-probs already, with --topk-values logprob
    return kept


def _stored(kept: dict[str, torch.Tensor], exact: frozenset[str], write: WriteSetup,
            projection: Projection | None) -> dict[str, np.ndarray]:
    """The kept tensors as the host arrays storage takes (``exact``: as computed). fp16 overflow is checked per
    target on the device (one host sync for all of them) before anything is converted: T5-family activations are
    known to exceed 65504, and storage must never see an inf (``Fp16OverflowError`` names the first)."""
    codec = write.hidden_codec
    check_ranges({n: max_abs(v) for n, v in kept.items() if v.is_floating_point() and n not in exact
                  and v.numel() and fp16_bounded(n, write.dtype, codec)})
    stored: dict[str, torch.Tensor] = {}
    for name, value in kept.items():
        if name in exact:
            stored[name] = value
        elif applies_to(name):
            stored.update(hidden_targets(codec, name, value, projection))
        else:
            stored[name] = to_storage_dtype(value, write.dtype)
    return {name: as_numpy(value.cpu()) for name, value in stored.items()}  # bf16 bits: uint16, as stored


def adapter_for(config: PretrainedConfig) -> TeacherAdapter:
    """The adapter of this teacher's family, from its config."""
    return EncoderDecoderTeacher() if is_encoder_decoder(config) else HookedTeacher()
