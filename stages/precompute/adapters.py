"""Teacher adapters: how one family of teachers is read, loaded and run; the runner is the same for all.

A cache holds named token streams (``storage.streams``). An adapter turns the dataset into those streams, resolves
which layers to keep, loads the teacher and runs it on a padded batch of every stream, returning named arrays
per sequence. Two adapters cover the Hugging Face families:

* ``HookedTeacher``: decoder-only and encoder teachers, one stream (``""``). Forward hooks keep only the
  selected layers, so no other layer's tensors stay alive (``capture.FeatureCapture``).
* ``EncoderDecoderTeacher``: encoder-decoder teachers (BART, mBART, T5), streams ``encoder`` and ``decoder``
  (teacher-forced on the target), plus cross-attention; it reads HF's own outputs
  (``seq2seq_capture.Seq2SeqCapture``), whose layer numbering and final norms are HF's on both stacks.

A new architecture family is a new adapter, not a new runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kdcache.stages.precompute.data import TokenStreams, data_fingerprint, load_texts, tokenize
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import PrecomputeOptions
from kdcache.stages.precompute.targets import Targets
from kdcache.stages.precompute.teacher import Teacher, load_for_inference, load_teacher, teacher_fingerprint
from kdcache.storage.streams import prefixed

# One padded batch of every stream: stream -> (ids [B, L], mask [B, L]) on the teacher's device, the B valid
# lengths per stream, and stream -> position_ids [B, L] for rows packed with documents kept apart (else absent).
# A capture returns one dict of storage-ready arrays per sequence.
Capture = Callable[[dict[str, tuple[Any, Any]], dict[str, list[int]], dict[str, Any]], list[dict[str, np.ndarray]]]


class TeacherAdapter(ABC):
    """The parts of stage one that depend on the teacher's family; see the module docstring. Which layers to
    keep, the spec and the settings fingerprint follow from the token streams (``targets.py``)."""

    @abstractmethod
    def check_options(self, options: PrecomputeOptions, config: Any) -> None:
        """Refuse options that do not apply to this family, rather than ignore them."""

    @abstractmethod
    def load_data(self, options: PrecomputeOptions, tokenizer: Any) -> TokenStreams:
        """The dataset as token streams, in cache order."""

    @abstractmethod
    def load_teacher(self, options: PrecomputeOptions, config: Any, targets: Targets, tokenizer: Any,
                     device: Any) -> Teacher:
        """The weights, for inference (eager attention only when maps are captured)."""

    @abstractmethod
    def capture(self, teacher: Teacher, targets: Targets, options: PrecomputeOptions) -> Any:
        """A context manager giving the ``Capture`` function of this teacher."""


class HookedTeacher(TeacherAdapter):
    """Decoder-only and encoder teachers: one token stream, targets captured by forward hooks."""

    _SEQ2SEQ_ONLY = ("source_column", "target_column", "max_target_length", "encoder_layers", "decoder_layers",
                     "encoder_attention_layers", "decoder_attention_layers", "cross_attention_layers")

    def check_options(self, options: PrecomputeOptions, config: Any) -> None:
        given = [name for name in self._SEQ2SEQ_ONLY if getattr(options, name) not in (None, ())]
        if "cross_attention" in options.features:
            given.append("features cross_attention")
        if given:
            raise PrecomputeError(f"{', '.join(given)}: only for encoder-decoder teachers, and "
                                  f"{options.teacher!r} is a {config.model_type} without a decoder stack")

    def load_data(self, options: PrecomputeOptions, tokenizer: Any) -> TokenStreams:
        rows = tokenize(load_texts(options), tokenizer, options)
        tokens = {"loss_mask": rows.loss_masks, **({"position_ids": rows.positions} if rows.positions else {})}
        return TokenStreams({"": rows.ids}, data_fingerprint(options, tokenizer, rows), tokens, rows.dropped_empty,
                            rows.dropped_untrained)

    def load_teacher(self, options: PrecomputeOptions, config: Any, targets: Targets, tokenizer: Any,
                     device: Any) -> Teacher:
        return load_teacher(options, config, targets, tokenizer, device)

    @contextmanager
    def capture(self, teacher: Teacher, targets: Targets, options: PrecomputeOptions) -> Iterator[Capture]:
        from kdcache.stages.precompute.capture import FeatureCapture

        with FeatureCapture(teacher, targets, options.dtype, options.logits_chunk, options.seed) as hooks:
            yield lambda batch, lengths, positions: hooks.run(*batch[""], lengths[""], positions.get("")).split()


class EncoderDecoderTeacher(TeacherAdapter):
    """Encoder-decoder teachers: streams ``encoder`` and ``decoder`` (the target, teacher-forced)."""

    _HEAD_KEYS = ("lm_head", "final_logits_bias")  # what a checkpoint without an LM head lacks

    def check_options(self, options: PrecomputeOptions, config: Any) -> None:
        return None  # every option applies; the pair loader refuses a missing --target-column and --packing

    def load_data(self, options: PrecomputeOptions, tokenizer: Any) -> TokenStreams:
        from kdcache.stages.precompute.seq2seq_data import load_pairs, paired_data_fingerprint, tokenize_pairs

        data = tokenize_pairs(load_pairs(options), tokenizer, options)
        ids = {"encoder": data.sources, "decoder": data.targets}
        # Every token of both sides is trained on: the masks are all ones, stored so every cache reads alike.
        tokens = {prefixed(s, "loss_mask"): [np.ones(len(q), dtype=np.uint8) for q in seqs] for s, seqs in ids.items()}
        return TokenStreams(ids, paired_data_fingerprint(options, data), tokens, data.dropped_empty)

    def load_teacher(self, options: PrecomputeOptions, config: Any, targets: Targets, tokenizer: Any,
                     device: Any) -> Teacher:
        from transformers import AutoModelForSeq2SeqLM

        model = load_for_inference(AutoModelForSeq2SeqLM, options, device, eager=targets.wants_attention,
                                   optional=() if targets.logits else self._HEAD_KEYS)
        fingerprint = {**teacher_fingerprint(options, model), "num_encoder_layers": targets.streams["encoder"].depth,
                       "num_decoder_layers": targets.streams["decoder"].depth}
        impl = getattr(model.config, "_attn_implementation", None) or "default"
        return Teacher(model, tokenizer, model.config, device, fingerprint, impl)

    @contextmanager
    def capture(self, teacher: Teacher, targets: Targets, options: PrecomputeOptions) -> Iterator[Capture]:
        from kdcache.stages.precompute.seq2seq_capture import Seq2SeqCapture

        capture = Seq2SeqCapture(teacher.model, targets, options.dtype)

        def run(batch: dict[str, tuple[Any, Any]], lengths: dict[str, list[int]],
                positions: dict[str, Any]) -> list[dict[str, np.ndarray]]:
            (src, src_mask), (tgt, tgt_mask) = batch["encoder"], batch["decoder"]
            inputs = {"input_ids": src, "attention_mask": src_mask, "labels": tgt, "decoder_attention_mask": tgt_mask}
            return capture.run(inputs, lengths["encoder"], lengths["decoder"])

        yield run


def adapter_for(config: Any) -> TeacherAdapter:
    """The adapter of this teacher's family, from its config."""
    return EncoderDecoderTeacher() if getattr(config, "is_encoder_decoder", False) else HookedTeacher()
