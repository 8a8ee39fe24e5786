"""Feature capture: forward hooks that keep only the selected layers, already unpadded and in fp16 on the device.

Layer numbering is HF's ``hidden_states`` numbering, and the cached layer ``j`` equals ``hidden_states[j]``
exactly:

* layer 0 is the input of the first block (embeddings after their norm/dropout), taken by a pre-hook;
* layer j (1 <= j < N) is the output of block j;
* layer N is the base model's ``last_hidden_state``. For GPT-2 (``ln_f``) and Llama (``norm``) that is the last
  block's output *after* the final norm, which is what HF returns as ``hidden_states[N]``; a hook on the last
  block would cache the un-normed tensor instead.

Attention maps come from hooks on the attention modules of the selected blocks only (eager attention returns
its probabilities from there), so no other layer's ``[B, H, L, L]`` tensor is kept alive. Models that do not
declare where their attention is recorded fall back to ``output_attentions=True``.

Inside each hook the tensor is turned into what is stored: converted to the storage dtype on the device, with its
largest |value| kept on the device for the fp16 overflow check, read when the batch reaches the host
(``finish``: no sync of its own). Padding never reaches the writer: on a GPU it is dropped on the device before
the copy, on the CPU cut off by views (``transfer``). The range check also sees padded positions; they are
ordinary activations of pad tokens, finite like the rest.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.common.documents import document_attention_mask, documents_apart_problem
from kdcache.stages.precompute.capture.compiled import TeacherCalls
from kdcache.stages.precompute.capture.logit_head import logit_targets
from kdcache.stages.precompute.capture.qk_capture import QKCapture
from kdcache.stages.precompute.capture.sharded_head import chunked_head
from kdcache.stages.precompute.capture.transfer import HostBatch, HostCopier, ShardItems, valid_rows
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.targets import Targets
from kdcache.stages.precompute.core.teacher_id import Teacher
from kdcache.stages.precompute.parallel.layouts import no_autograd
from kdcache.stages.targets.hidden import device_codecs
from kdcache.storage import FLOAT, HiddenCodec, applies_to, check_fp16_range, hidden_codec_of, projected

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import PreTrainedModel

def to_storage_dtype(x: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """Round float values to the storage dtype on the device: fp16, or bf16 bits as int16 (numpy reads uint16)."""
    if dtype_name == "fp16":
        return x.to(torch.float16)
    return x.to(torch.bfloat16).view(torch.int16)


def hidden_targets(codec: HiddenCodec, name: str, hidden: torch.Tensor,
                   projection: device_codecs.Projection | None = None) -> dict[str, torch.Tensor]:
    """A hidden state (or cached queries/keys/values) ``[B, L, d]`` as the arrays its codec stores, made on its
    device: the float type of a float codec, or codes, scales, outliers and per-row errors
    (``stages.targets.hidden.device_codecs.encode``; a rank codec's layers through ``projection``). While the projection
    is being fitted, its layers come out as float32 ``[B, L, d]`` for the fit (never stored)."""
    if projection is not None and projection.fitting and projected(codec, name):
        return {name: hidden.float()}
    if device_codecs.quantised(codec):
        return device_codecs.encode(codec, name, hidden, projection)
    return {name: to_storage_dtype(hidden, str(codec.float_dtype))}


def fp16_bounded(name: str, dtype_name: str, codec: HiddenCodec) -> bool:
    """Whether target ``name`` must stay within float16's range: fp16 targets, and coded arrays (hidden states,
    queries/keys/values) of every codec but bf16 (quantised codecs keep outliers and scales in fp16)."""
    return codec.float_dtype != "bf16" if applies_to(name) else dtype_name == "fp16"


def max_abs(values: torch.Tensor) -> torch.Tensor:
    """The largest |value| of a tensor, on its device (no host sync): one pass (``aminmax``) over what may be a
    large activation, rather than the copies ``abs()`` would make. A NaN passes on to storage, which reports it as
    the teacher bug it is; an inf is refused here like any value beyond float16."""
    return torch.stack(torch.aminmax(values.detach())).float().abs().amax()


def check_ranges(maxima: dict[str, torch.Tensor]) -> None:
    """One host sync for every target's largest |value|; refuse the first beyond float16 (``check_maxima``)."""
    if maxima:
        names = list(maxima)
        check_maxima(dict(zip(names, torch.stack([maxima[n] for n in names]).cpu().tolist())))


def check_maxima(maxima: dict[str, float]) -> frozenset[str]:
    """Refuse the first target whose largest |value| is beyond float16, naming it; return the names found finite.

    Raises:
        Fp16OverflowError: names the array, the value and ``--dtype bf16`` (T5-family activations often
            overflow float16; storage must never see an inf). A NaN is left to storage, which reports it as the
            teacher bug it is: such a target is not in the returned set, so storage checks it on the host.
    """
    for name, value in maxima.items():
        if not math.isnan(value):
            check_fp16_range(name, value, fix="Rerun with --dtype bf16, or leave this layer out.")
    return frozenset(name for name, value in maxima.items() if not math.isnan(value))


def finish(batch: HostBatch) -> ShardItems:
    """A batch's per-sequence targets once its copy has landed, range-checked (``check_maxima``)."""
    batch.wait()
    started = time.perf_counter()
    finite = check_maxima(batch.maxima())
    return ShardItems(batch.split(), finite=finite, host_seconds=time.perf_counter() - started,
                      leases=[batch.lease] if batch.lease is not None else [])


def find_blocks(model: PreTrainedModel, num_layers: int) -> torch.nn.ModuleList:
    """The ``ModuleList`` of the teacher's N transformer blocks (``h``, ``layers``, ``encoder.layer``...)."""
    base = model.base_model
    candidates = [m for _, m in base.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not candidates:
        raise PrecomputeError(f"cannot find the {num_layers} transformer blocks of {type(base).__name__}")
    return candidates[0]  # named_modules walks outer to inner; the first list of N modules is the block stack


def find_attention(block: torch.nn.Module, base: torch.nn.Module) -> tuple[torch.nn.Module, int] | None:
    """The self-attention module inside ``block`` and where its probabilities sit in its output tuple, from
    transformers' own recorder table (a class, or a record of class, name fragment and output index)."""
    spec = (getattr(type(base), "_can_record_outputs", None) or {}).get("attentions")
    whole = isinstance(spec, type)
    cls: type[torch.nn.Module] | None = spec if whole else getattr(spec, "target_class", None)
    fragment, index = (None, 1) if whole else (getattr(spec, "layer_name", None), getattr(spec, "index", 1))
    if cls is None:
        return None
    wanted = None if fragment is None else "." + fragment.strip(".") + "."
    for name, module in block.named_modules():
        if isinstance(module, cls) and (wanted is None or wanted in "." + name + "."):
            return module, index
    return None


class FeatureCapture:
    """Hooks on one teacher that turn a padded batch into storage-ready targets.

    Use as a context manager (hooks are removed on exit), and call ``run`` once per batch.
    """

    def __init__(self, teacher: Teacher, targets: Targets, dtype_name: str, chunk_tokens: int = 0,
                 seed: int = 0, hidden_codec: HiddenCodec | None = None,
                 projection: device_codecs.Projection | None = None, compiled: bool = False) -> None:
        self.seed = seed
        self.hidden_codec = hidden_codec or hidden_codec_of(None, dtype_name)  # None: the float dtype itself
        self.projection = projection  # a rank codec's bases (or its fit mode)
        self.teacher, self.targets, self.dtype_name = teacher, targets, dtype_name
        self.model = teacher.model
        self.calls = TeacherCalls(self.model, compiled)  # the forward, through torch.compile or eager
        self._handles: list[RemovableHandle] = []
        self._lengths: list[int] = []
        self._out: dict[str, Any] = {}
        self._amax: dict[str, torch.Tensor] = {}
        self._attention_fallback = False
        self._paused = False  # hooks ignore forwards run only to check the chunked head or packed documents
        self._documents_checked = False
        # Full logits are stored whole anyway; head mode runs the head once, on the first batch, to check it.
        self._kind = targets.logit.kind
        self._head = chunked_head(self.model, self._kind.capture_chunk(chunk_tokens) if self._kind else 0,
                                  targets.logit)
        if self._kind and self._kind.teacher_head and not self._head.active:
            raise PrecomputeError(f"logits head: {type(self.model).__name__} has no plain LM head to copy; use "
                                  f"--logits topk or full")
        recorded = targets.attention.source.recorded_parts
        self._qk = QKCapture(self.model, targets) if recorded else None
        self._copier = HostCopier(teacher.device)
        self._no_autograd = no_autograd(self.model)
        self._install()

    # ---- hooks ---------------------------------------------------------------------------------------
    def _install(self) -> None:
        t = self.targets.streams[""]
        blocks = find_blocks(self.model, t.depth)
        base = self.model.base_model
        tie_last = getattr(self.model.config, "tie_last_hidden_states", True) is not False
        for j in t.hidden:
            if j == 0:  # the first block's input: positional, or the keyword hidden_states
                hook = blocks[0].register_forward_pre_hook(
                    lambda module, args, kwargs: self._keep_hidden(0, args[0] if args else kwargs["hidden_states"]),
                    with_kwargs=True)
            elif j == t.depth and tie_last:
                hook = base.register_forward_hook(self._hidden_hook(j, last=True))
            else:
                hook = blocks[j - 1].register_forward_hook(self._hidden_hook(j, last=False))
            self._handles.append(hook)
        for j in t.attention if self._qk is None else ():  # queries and keys are recorded, not hooked
            found = find_attention(blocks[j - 1], base)
            if found is None:
                self._attention_fallback = True
                continue
            module, index = found
            self._handles.append(module.register_forward_hook(self._attention_hook(j, index)))

    def _hidden_hook(self, j: int, *, last: bool) -> Callable[[torch.nn.Module, tuple, Any], None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if last:
                hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            else:
                hidden = output if isinstance(output, torch.Tensor) else output[0]
            self._keep_hidden(j, hidden)
        return hook

    def _attention_hook(self, j: int, index: int) -> Callable[[torch.nn.Module, tuple, Any], None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            probs = output[index] if isinstance(output, (tuple, list)) else None
            if probs is None:
                raise PrecomputeError(f"attention block {j} returned no probabilities; is attention eager?")
            self._keep_attention(j, probs)
        return hook

    # ---- reductions on the device --------------------------------------------------------------------
    # Padding stays in place until the host (views cut it off there): a device-side gather would be one more
    # full copy of every target. Bucketed batches carry little padding, so little extra crosses to the host.
    def _keep_range(self, name: str, values: torch.Tensor) -> None:
        """Remember the largest |value| (on the device, no sync) for the fp16 range check."""
        if fp16_bounded(name, self.dtype_name, self.hidden_codec) and values.numel():
            self._amax[name] = max_abs(values)

    def _keep_hidden(self, j: int, hidden: torch.Tensor) -> None:
        """``[B, L, d]`` -> the stored arrays of its codec, padded, made on the device; range recorded."""
        if self._paused:
            return
        self._keep_range(f"hidden/{j}", hidden)
        self._out.update(hidden_targets(self.hidden_codec, f"hidden/{j}", hidden, self.projection))

    def _keep_attention(self, j: int, probs: torch.Tensor) -> None:
        """``[B, H, L, L]`` probabilities -> ``[B, H', L, L]`` kept heads in the storage dtype.

        Heads are cut here, on the device, so unkept heads never cross to the host (storage accepts maps that
        already hold exactly the spec's heads). Probabilities never overflow fp16.
        """
        if self._paused:
            return
        if self.targets.heads is not None:
            probs = probs[:, list(self.targets.heads)]
        self._out[f"attention/{j}"] = to_storage_dtype(probs, self.dtype_name)

    def _keep_logits(self, kept: dict[str, torch.Tensor]) -> None:
        """The logit kind's arrays (``logit_targets``), still padded: those its storage layout keeps in the float
        dtype range-checked and converted; the rest (ids, the fp32 logsumexp, log-probs that storage quantises)
        handed over as computed."""
        for array in self.targets.logit_arrays:
            if array.dtype == FLOAT and array.name in kept:
                self._keep_range(array.name, kept[array.name])
                kept[array.name] = to_storage_dtype(kept[array.name], self.dtype_name)
        self._out.update(kept)

    # ---- one batch ----------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: list[int],
            position_ids: torch.Tensor | None = None) -> HostBatch:
        """Run the teacher on one right-padded batch and collect its targets.

        Args:
            input_ids: ``[B, L]`` token ids on the teacher's device (padding right).
            attention_mask: ``[B, L]`` 1 for valid tokens.
            lengths: the B valid lengths.
            position_ids: ``[B, L]`` for rows packed with documents kept apart: positions restart per document
                and attention stays inside each (``stages.common.documents``).

        Returns:
            the batch's targets on their way to the host, padding removed (``transfer.HostBatch``; ``finish``
            waits for them and checks their range: an fp16 overflow is raised there, naming the layer).
        """
        self._lengths, self._out, self._amax = list(lengths), {}, {}
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            self._check_documents(input_ids, attention_mask, position_ids)
            kwargs.update(position_ids=position_ids, attention_mask=document_attention_mask(
                position_ids, attention_mask, causal=self.targets.causal, dtype=self.model.dtype))
        if self.targets.causal:
            kwargs["use_cache"] = False  # no KV cache: nothing is generated
        if self._attention_fallback:
            kwargs["output_attentions"] = True
        with self._no_autograd():
            forward = partial(self._forward, kwargs, attention_mask, lengths[0])
            if self._qk is not None:
                forward = partial(self._qk.run, forward, attention_mask, position_ids)
            output, kept = self.calls.run(forward, reset=self._reset)
            for name, value in self._qk.arrays().items() if self._qk is not None else ():  # the hidden codec applies
                self._keep_range(name, value)
                self._out.update(hidden_targets(self.hidden_codec, name, value))
            if self._attention_fallback:
                for j in self.targets.streams[""].attention:
                    if f"attention/{j}" not in self._out:
                        self._keep_attention(j, output.attentions[j - 1])
            self._keep_logits(kept)
        # on its way to the host (``transfer.HostCopier``: on a GPU the padding is dropped there and the rest
        # copied on a side stream)
        lengths, out, amax = self._lengths, self._out, self._amax
        self._out, self._amax = {}, {}
        return self._copier.start(out, amax, lengths)

    def __call__(self, batch: dict[str, tuple[torch.Tensor, torch.Tensor]], lengths: dict[str, list[int]],
                 positions: dict[str, torch.Tensor]) -> Callable[[], ShardItems]:
        """The ``adapters.Capture`` of stream ``""``: the batch queued (``run``), taken in (``finish``) when what
        it returns is called."""
        host = self.run(*batch[""], lengths[""], positions.get(""))
        return lambda: finish(host)

    def _reset(self) -> None:
        """Forget what a failed forward kept, before the batch runs again."""
        self._out, self._amax = {}, {}

    def _check_documents(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor) -> None:
        """Once, on the first packed batch: refuse a teacher that does not keep documents apart (hooks paused)."""
        if self._documents_checked:
            return
        with self._hooks_paused(), self._no_autograd():
            problem = documents_apart_problem(self.model, input_ids, attention_mask, position_ids,
                                              causal=self.targets.causal)
        if problem is not None:
            raise PrecomputeError(f"packing documents: {type(self.model).__name__} does not keep packed documents "
                                  f"apart with restarting positions and a 4-D mask ({problem}); use --packing concat "
                                  f"or none")
        self._documents_checked = True

    def _forward(self, kwargs: dict[str, Any], attention_mask: torch.Tensor,
                 first_length: int) -> tuple[Any, dict[str, torch.Tensor]]:
        """The teacher's forward and its logit targets: through the chunked head from the base model when it
        applies (top-k, and ``head`` mode, which stores no logits), else the model's own forward."""
        keep = self._keeper(kwargs["input_ids"])
        if not self._head.active:
            output = self.calls.model(**kwargs)
            return output, keep(getattr(output, "logits", None))
        output = self.calls.base(**kwargs)
        valid = attention_mask.bool()
        if not self._head.checked and not self._check_head(kwargs, output.last_hidden_state, valid, first_length):
            with self._hooks_paused():
                return output, keep(self.calls.model(**kwargs).logits)
        stores = bool(self.targets.logit_arrays)  # head mode stores nothing per token
        rows = valid_rows(self._lengths, valid.shape[1], valid.device)
        return output, self._head.targets(output.last_hidden_state, valid, keep, rows) if stores else {}

    def _keeper(self, input_ids: torch.Tensor) -> Callable[[torch.Tensor | None], dict[str, torch.Tensor]]:
        """``logit_targets`` with this run's settings; a kind that draws does so from a generator seeded by the
        batch's own tokens, so a shard's samples are the same on every rerun and every rank."""
        t = self.targets
        generator = None
        if self._kind and self._kind.draws:
            digest = hashlib.sha256(input_ids.cpu().numpy().tobytes()).digest()
            generator = torch.Generator(device=input_ids.device)
            generator.manual_seed(int.from_bytes(digest[:7], "little") ^ self.seed)
        return lambda logits: logit_targets(logits, t.logit, generator)

    @contextmanager
    def _hooks_paused(self) -> Iterator[None]:
        """Forwards run inside only to check something: the hooks keep nothing of them."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _check_head(self, kwargs: dict[str, Any], last: torch.Tensor, valid: torch.Tensor, length: int) -> bool:
        """Check the chunked head once against the model's own forward on the first sequence (hooks paused);
        on disagreement the run falls back to the full forward (``head`` mode cannot: it refuses)."""
        probe = self._head.probe(last, valid)
        with self._hooks_paused():
            first = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            if self._head.agrees(self.calls.model(**first).logits, probe, length):
                return True
            if self._kind and self._kind.teacher_head:
                raise PrecomputeError(f"logits head: {type(self.model).__name__}'s logits are not its LM head "
                                      f"applied to the last hidden layer, so stage two could not rebuild them; use "
                                      f"--logits topk or full")
            print(f"kdcache precompute: note: {type(self.model).__name__}'s logits are not its output embedding of "
                  f"the last hidden state; computing them with the full forward (no chunking)", file=sys.stderr)
            return False

    def __enter__(self) -> FeatureCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
