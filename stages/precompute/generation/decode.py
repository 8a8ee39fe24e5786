"""The decode loop of ``kdcache generate``: the teacher writes a batch of responses with a KV cache, and every
forward it runs for that is also the forward whose targets the cache keeps. There is no second pass.

A batch of prompts is padded on the left, so that every row's next token sits in the last column; the attention
mask hides the padding and the position ids count each row's own tokens from 0, as a right-padded teacher-forced
batch would. The prefill gives the targets of every prompt position; each decode step feeds the tokens just drawn
and gives theirs. A row's last token (its end-of-sequence token, a stop string's end, or the length limit) is fed
too, so that every stored token has its targets; a finished row's later steps are discarded. What a step keeps is
what precompute keeps (the same layers in HF's numbering, the logit kind's arrays of the raw logits, before any
sampling rule, attention maps), then turned into the same storage-ready arrays by the same functions
(``capture.hidden_targets``, the logit kind, ``to_storage_dtype``, the fp16 range check).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache

from kdcache.stages.precompute.capture.features import (
    check_ranges,
    fp16_bounded,
    hidden_targets,
    max_abs,
    to_storage_dtype,
)
from kdcache.stages.precompute.capture.logit_head import logit_targets
from kdcache.stages.precompute.capture.qk_capture import QKCapture
from kdcache.stages.precompute.capture.transfer import ShardItems, as_numpy, cut_padding
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.generation.options import Sampling
from kdcache.stages.precompute.generation.sampling import ResponseDraws, next_tokens, response_seed
from kdcache.storage import FLOAT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from kdcache.stages.precompute.core.targets import Targets
    from kdcache.stages.precompute.core.teacher_id import Teacher
    from kdcache.storage import HiddenCodec


@dataclass
class Decoded:
    """One batch's responses: per row the whole sequence's ids ``[L_i]`` (prompt then response), its prompt's
    length, and its storage-ready targets (``ShardItems``: ``hidden/{j} [L_i, d]``, logits, attention)."""

    ids: list[np.ndarray]
    prompt_lengths: list[int]
    items: ShardItems


@dataclass
class _Kept:
    """What the forwards of one batch gave, per target, in forward order."""

    hidden: dict[int, list[torch.Tensor]]
    attention: dict[int, list[torch.Tensor]]
    logits: dict[str, list[torch.Tensor]]
    token_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # attention_{q,k,v}/{j}
    forwards: int = 0


class _Rows:
    """The batch's responses as they grow, on the device: the tokens drawn at each step and which rows are done.

    Every row draws its t-th token at step t, so a live row's length is the step count; only a stop string needs
    the tokens on the host (a tokenizer decodes them), and then only a live row's last few.
    """

    def __init__(self, count: int, device: torch.device, limit: int, eos: frozenset[int], stop: tuple[str, ...],
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.steps: list[torch.Tensor] = []  # per step, ``[B]`` ids (a row done before it: whatever was drawn)
        self.done = torch.zeros(count, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(count, dtype=torch.int64, device=device)
        self.eos = torch.tensor(sorted(eos), dtype=torch.int64, device=device)
        self.limit, self.stop, self.tokenizer = limit, stop, tokenizer
        self._tail = max((len(s) for s in stop), default=0) + 2  # tokens decoded to look for a stop string

    def add(self, drawn: torch.Tensor) -> bool:
        """Append ``[B]`` ids; a live row ends on an EOS id, a stop string, or its ``limit``-th token.

        Returns:
            whether a row is still live: the one host sync of a step.
        """
        live = ~self.done
        self.steps.append(drawn)
        self.lengths += live
        ended = torch.isin(drawn, self.eos) | (self.lengths >= self.limit)
        if self.stop:
            ended |= self._stopped(live)
        self.done |= live & ended
        return not bool(self.done.all())

    def _stopped(self, live: torch.Tensor) -> torch.Tensor:
        """``[B]`` whether each live row's text now holds a stop string (its last tokens decoded on the host)."""
        tail = torch.stack(self.steps[-self._tail:], dim=1).tolist()
        found = [bool(on) and any(s in self.tokenizer.decode(ids, skip_special_tokens=False) for s in self.stop)
                 for on, ids in zip(live.tolist(), tail)]
        return torch.tensor(found, dtype=torch.bool, device=live.device)

    def tokens(self) -> list[np.ndarray]:
        """Per row its response ids ``[n_i]`` (int32, on the host)."""
        drawn = torch.stack(self.steps, dim=1).cpu().numpy().astype(np.int32)
        return [row[:n] for row, n in zip(drawn, self.lengths.tolist())]


class DecodeLoop:
    """Runs the teacher's sampling over batches of prompts and keeps its targets on the way.

    Args:
        teacher: the loaded decoder-only teacher (eager attention when maps are kept).
        targets: what to keep (``core.targets``).
        dtype_name: storage dtype of float targets, ``fp16`` or ``bf16``.
        hidden_codec: the configured hidden codec.
        sampling: the sampling rule and the run's seed.
    """

    def __init__(self, teacher: Teacher, targets: Targets, dtype_name: str, hidden_codec: HiddenCodec,
                 sampling: Sampling) -> None:
        self.teacher, self.targets, self.sampling = teacher, targets, sampling
        self.dtype_name, self.hidden_codec = dtype_name, hidden_codec
        self.layers = targets.streams[""]
        # q/k sources: the selected blocks' queries and keys as token rows, recorded at the attention kernel (rotary
        # applied), instead of maps; else the maps, from the model's own output
        recorded = targets.attention.source.recorded_parts
        self.qk = QKCapture(teacher.model, targets) if recorded and self.layers.attention else None
        self.maps = () if self.qk is not None else self.layers.attention
        self.eos = eos_ids(teacher)
        self.pad_id = teacher.tokenizer.pad_token_id if teacher.tokenizer.pad_token_id is not None else 0
        # transformers 5.x names the KV cache ``cache`` and deprecates ``past_key_values``, which older ones take
        self.cache_key = "cache" if "cache" in inspect.signature(teacher.model.forward).parameters \
            else "past_key_values"

    # ---- one batch -----------------------------------------------------------------------------------
    def run(self, prompts: list[np.ndarray], keys: list[tuple[int, int]]) -> Decoded:
        """Sample one response per row and cut each row's targets out.

        Args:
            prompts: per row its prompt ids ``[P_i]``.
            keys: per row its (prompt index, response number): what its draws are seeded with.
        """
        device = self.teacher.device
        draws = ResponseDraws(keys, self.sampling.seed, device)
        kept = _Kept({j: [] for j in self.layers.hidden}, {j: [] for j in self.maps}, {})
        rows = _Rows(len(prompts), device, self.sampling.max_new_tokens, self.eos, self.sampling.stop,
                     self.teacher.tokenizer)
        with torch.inference_mode():
            ids, mask, positions = self._left_padded(prompts)
            cache = DynamicCache()
            last = self._forward(ids, mask, positions, cache, kept, keys)
            live = True
            while live:
                step, live = self._draw(last, rows, draws)
                mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=1)
                positions = positions[:, -1:] + 1
                last = self._forward(step, mask, positions, cache, kept, keys)
            responses = rows.tokens()
            lengths = [len(p) + len(t) for p, t in zip(prompts, responses)]
            items = self._items(kept, [len(p) for p in prompts], ids.shape[1], lengths)
        full = [np.concatenate([p, t]).astype(np.int32) for p, t in zip(prompts, responses)]
        return Decoded(full, [len(p) for p in prompts], items)

    def _draw(self, last: torch.Tensor, rows: _Rows, draws: ResponseDraws) -> tuple[torch.Tensor, bool]:
        """Every row's next token from ``[B, V]`` logits, drawn at once on their device and added to ``rows``.

        Returns:
            ``[B, 1]`` ids to feed (a row done before this step gets the pad id: its later positions are
            discarded; a row that ends now is fed its last token, whose targets are kept), and whether a row is
            still live.
        """
        uniforms = None if self.sampling.greedy else draws.at(len(rows.steps))
        drawn = next_tokens(last, self.sampling, uniforms)
        finished = rows.done.clone()
        live = rows.add(drawn)
        return drawn.masked_fill(finished, self.pad_id)[:, None], live

    def _left_padded(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, P]`` ids padded on the left, their mask, and positions counting each row's tokens from 0."""
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        device = self.teacher.device
        ids_t, mask_t = torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
        return ids_t, mask_t, (mask_t.cumsum(-1) - 1).clamp(min=0)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 kept: _Kept, keys: list[tuple[int, int]]) -> torch.Tensor:
        """One forward with the KV cache; what it gives of the kept targets is appended to ``kept``.

        Returns:
            ``[B, V]`` float32 raw logits of the last position, which the next tokens are drawn from.
        """
        def call() -> CausalLMOutputWithPast:
            return self.teacher.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{self.cache_key: cache}, output_hidden_states=bool(self.layers.hidden),
                output_attentions=bool(self.maps))

        out = call() if self.qk is None else self.qk.run(call, mask, None)
        for name, value in self.qk.arrays(last=ids.shape[1]).items() if self.qk is not None else ():
            kept.token_rows.setdefault(name, []).append(value)
        if out.logits is None:
            raise PrecomputeError(f"{type(self.teacher.model).__name__} returned no logits; it cannot generate")
        for j, parts in kept.hidden.items():
            parts.append(out.hidden_states[j])  # type: ignore[index]  # asked for above
        for j, parts in kept.attention.items():
            parts.append(out.attentions[j - 1])  # type: ignore[index]
        for name, value in self._logits(out.logits, keys, kept.forwards).items():
            kept.logits.setdefault(name, []).append(value)
        kept.forwards += 1  # a logit kind that draws seeds each forward's samples by its number
        return out.logits[:, -1].float()

    def _logits(self, logits: torch.Tensor, keys: list[tuple[int, int]], step: int) -> dict[str, torch.Tensor]:
        """The logit kind's arrays of ``[B, q, V]`` raw logits; a kind that draws does so per row, from a generator
        of its own response and step, so that its samples too depend on nothing but the response."""
        kind = self.targets.logit.kind
        if kind is None:
            return {}
        if not kind.draws:
            return logit_targets(logits, self.targets.logit)
        rows = []
        for i, (p, r) in enumerate(keys):
            generator = torch.Generator(device=logits.device).manual_seed(
                response_seed(self.sampling.seed, p, r, f"logits/{step}"))
            rows.append(logit_targets(logits[i:i + 1], self.targets.logit, generator))
        return {name: torch.cat([row[name] for row in rows]) for name in rows[0]}

    # ---- the batch's targets, as precompute stores them ---------------------------------------------
    def _items(self, kept: _Kept, prompt_lengths: list[int], width: int, lengths: list[int]) -> ShardItems:
        """Every row's valid positions gathered into a right-padded batch, made storage-ready, cut per row."""
        index = _valid_positions(prompt_lengths, width, lengths, self.teacher.device)
        maxima: dict[str, torch.Tensor] = {}
        stored: dict[str, torch.Tensor] = {}
        for j, parts in kept.hidden.items():
            value = self._bounded(f"hidden/{j}", _rows(parts, index), maxima)
            stored.update(hidden_targets(self.hidden_codec, f"hidden/{j}", value))
        for name, parts in kept.token_rows.items():  # q/k as precompute keeps them: as hidden states are kept
            stored.update(hidden_targets(self.hidden_codec, name, self._bounded(name, _rows(parts, index), maxima)))
        heads = self.targets.heads
        for j, parts in kept.attention.items():
            maps = _maps(parts, index)
            stored[f"attention/{j}"] = to_storage_dtype(maps[:, list(heads)] if heads is not None else maps,
                                                        self.dtype_name)
        floats = {a.name for a in self.targets.logit_arrays if a.dtype == FLOAT}
        for name, parts in kept.logits.items():
            value = _rows(parts, index)
            stored[name] = to_storage_dtype(self._bounded(name, value, maxima), self.dtype_name) \
                if name in floats else value
        check_ranges(maxima)
        host = {name: as_numpy(value.cpu()) for name, value in stored.items()}
        return ShardItems([cut_padding(host, i, {"": n}) for i, n in enumerate(lengths)])

    def _bounded(self, name: str, value: torch.Tensor, maxima: dict[str, torch.Tensor]) -> torch.Tensor:
        """``value``, its largest |value| kept for the fp16 range check where it must fit float16."""
        if fp16_bounded(name, self.dtype_name, self.hidden_codec) and value.numel():
            maxima[name] = max_abs(value)
        return value


def eos_ids(teacher: Teacher) -> frozenset[int]:
    """The ids that end a response: the tokenizer's EOS and the generation config's (a chat model's
    end-of-turn token is usually among the latter)."""
    found = {teacher.tokenizer.eos_token_id}
    config = getattr(teacher.model, "generation_config", None)
    value = getattr(config, "eos_token_id", None) if config is not None else None
    found.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in found if i is not None)


def _valid_positions(prompt_lengths: list[int], width: int, lengths: list[int],
                     device: torch.device) -> torch.Tensor:
    """``[B, L]`` column of each row's t-th token in the steps' concatenation (the prompt starts at column
    ``width - P_i``); past a row's length, its last token's column (cut off on the host)."""
    longest = max(lengths)
    index = np.zeros((len(lengths), longest), dtype=np.int64)
    for i, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        start = width - p
        index[i] = start + np.minimum(np.arange(longest), n - 1)
    return torch.from_numpy(index).to(device)


def _rows(parts: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Per-token arrays ``[B, q, ...]`` of every forward, joined and gathered to ``[B, L, ...]``."""
    joined = torch.cat(parts, dim=1)
    shaped = index.view(*index.shape, *([1] * (joined.dim() - 2))).expand(-1, -1, *joined.shape[2:])
    return joined.gather(1, shaped)


def _maps(parts: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Attention maps ``[B, H, q, k]`` of every forward (the prefill's square, then one row per step) assembled
    to ``[B, H, T, T]`` and gathered to each row's own tokens, ``[B, H, L, L]``."""
    first = parts[0]
    total = first.shape[-1] + len(parts) - 1
    full = first.new_zeros((*first.shape[:2], total, total))
    full[:, :, :first.shape[2], :first.shape[3]] = first
    for s, part in enumerate(parts[1:], start=first.shape[2]):
        full[:, :, s, :part.shape[-1]] = part[:, :, 0]
    rows_index = index[:, None, :, None].expand(-1, full.shape[1], -1, total)
    picked = full.gather(2, rows_index)
    return picked.gather(3, index[:, None, None, :].expand(-1, full.shape[1], index.shape[1], -1))
