"""Capture for seq2seq teachers: one teacher-forced forward per batch, targets cut per stream.

The decoder is teacher-forced on the target: ``decoder_input_ids`` come from the model's own
``prepare_decoder_input_ids_from_labels`` (the shift right with its ``decoder_start_token_id``, which differs
between BART, mBART and T5), so decoder position t sees target tokens < t and its logits predict target t.

Unlike the single-stream capture, this one asks HF for ``output_hidden_states`` / ``output_attentions`` and
keeps only the selected layers: the numbering and the final-norm placement are then HF's by construction on
both stacks (T5 applies ``final_layer_norm`` to the last hidden state; BART does not), at the cost of holding
every layer of one batch at once, which the batch size bounds.

fp16 overflow is checked per target on the device (one host sync per batch) before anything is converted
(``capture.check_ranges``): T5-family activations are known to exceed 65504, and storage must never see an inf.
"""

from __future__ import annotations

from typing import Any

import torch

from kdcache.stages.precompute.capture import (
    check_ranges,
    cut_padding,
    max_abs,
    to_numpy,
    to_storage_dtype,
)
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.logit_head import logit_targets
from kdcache.stages.precompute.targets import Targets


class Seq2SeqCapture:
    """Runs an encoder-decoder teacher on padded batches and returns storage-ready per-sequence targets.

    Args:
        model: an ``AutoModelForSeq2SeqLM`` in eval mode (eager attention when maps are captured).
        targets: what to keep.
        dtype_name: storage dtype, "fp16" or "bf16".
    """

    def __init__(self, model: Any, targets: Targets, dtype_name: str) -> None:
        if not hasattr(model, "prepare_decoder_input_ids_from_labels"):
            raise PrecomputeError(f"{type(model).__name__} cannot build decoder inputs from labels "
                                  f"(no prepare_decoder_input_ids_from_labels); it is not a seq2seq LM")
        self.model, self.targets, self.dtype_name = model, targets, dtype_name

    def run(self, batch: dict[str, torch.Tensor], enc_lengths: list[int], dec_lengths: list[int]) -> list[dict]:
        """Forward one right-padded batch and cut each sequence's targets out of it.

        Args:
            batch: ``input_ids``/``attention_mask`` ``[B, L_e]`` and ``labels``/``decoder_attention_mask``
                ``[B, L_d]`` on the teacher's device; labels are padded with the pad id (never -100, which
                the shift would not accept everywhere).
            enc_lengths, dec_lengths: the B valid lengths of each side.

        Returns:
            one dict per sequence: ``encoder/hidden/{j} [L_e, d]``, ``decoder/hidden/{j} [L_d, d]``,
            ``encoder/attention/{j} [H, L_e, L_e]``, ``decoder/attention/{j} [H, L_d, L_d]``,
            ``cross_attention/{j} [H, L_d, L_e]``, logits ``[L_d, ...]``; floats already in the storage dtype.

        Raises:
            Fp16OverflowError: a target exceeds float16's range (fp16 caches only).
        """
        t = self.targets
        with torch.inference_mode():
            decoder_input_ids = self.model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             decoder_input_ids=decoder_input_ids,
                             decoder_attention_mask=batch["decoder_attention_mask"], use_cache=False,
                             output_hidden_states=t.wants_hidden, output_attentions=t.wants_attention)
            kept = self._select(out)
            self._check_range(kept)
            host = {name: to_numpy(self._to_storage(name, value)) for name, value in kept.items()}
        return [cut_padding(host, i, {"encoder": n_e, "decoder": n_d})
                for i, (n_e, n_d) in enumerate(zip(enc_lengths, dec_lengths))]

    def _select(self, out: Any) -> dict[str, torch.Tensor]:
        """The selected layers as padded device tensors, by array name."""
        t = self.targets
        kept: dict[str, torch.Tensor] = {}
        for stream, layers in t.streams.items():  # HF: encoder_hidden_states, decoder_attentions, ...
            kept.update({f"{stream}/hidden/{j}": getattr(out, f"{stream}_hidden_states")[j] for j in layers.hidden})
            kept.update({f"{stream}/attention/{j}": getattr(out, f"{stream}_attentions")[j - 1]
                         for j in layers.attention})
        kept.update({f"cross_attention/{j}": out.cross_attentions[j - 1] for j in t.cross_attention})
        kept.update(logit_targets(out.logits, t.logits, t.top_k))
        return kept

    def _check_range(self, kept: dict[str, torch.Tensor]) -> None:
        """Refuse the first target beyond float16's range, naming it (one host sync for all of them)."""
        if self.dtype_name == "fp16":
            check_ranges({n: max_abs(v) for n, v in kept.items()
                          if v.is_floating_point() and n != "logits/lse" and v.numel()})

    def _to_storage(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name in ("logits/topk_ids", "logits/lse"):
            return value
        return to_storage_dtype(value, self.dtype_name)
