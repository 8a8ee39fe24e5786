"""Top-k logits from an LM head whose vocabulary is split across a tensor-parallel group, never gathered whole.

transformers' plan for a causal LM's head (``colwise_gather_output``) keeps rows ``[v0, v1)`` of the ``[V, d]``
weight on each rank and all-gathers the ``[C, V]`` logits after the matmul. Here the matmul runs on the local
rows only (``[C, V/N]``), and each rank hands the group just its own top-k and logsumexp, which combine exactly:

* the top-k of the whole row is the top-k of the N shards' top-ks (every entry of the global top-k is among its
  own shard's top-k), with shard-local ids moved by the shard's first row ``v0``;
* ``logsumexp(row) = logsumexp_n(logsumexp(shard_n))``.

So each rank sends ``C x (2k + 1)`` numbers instead of receiving ``C x V``. Ties between equal values may come
out in another order than a single device's ``topk`` gives; the values and the logsumexp match up to the
reduction order of the sharded matmuls (the docs state the measured size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.precompute.capture.logit_head import ChunkedHead
from kdcache.stages.targets.logits import LogitSettings
from kdcache.stages.targets.logits.teacher_head import finish_logits
from kdcache.stages.targets.logits.topk import as_logprobs
from kdcache.storage import TOPK_MASS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel


def vocab_shards(model: PreTrainedModel) -> tuple[Any, int, int] | None:
    """``(process group, first row, ranks)`` of the head's vocabulary shards, or None where the head's weight is
    not split by rows across ranks (no tensor parallelism, or a group of one)."""
    from torch.distributed.tensor import DTensor, Shard

    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, DTensor):
        return None
    dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    if not dims or weight.device_mesh.size(dims[0]) == 1:
        return None
    group = weight.device_mesh.get_group(dims[0])
    local = weight.to_local()
    rows = torch.tensor([local.shape[0]], device=local.device)  # where the group's collectives run (NCCL: a GPU)
    everyone = [torch.zeros_like(rows) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(everyone, rows, group=group)
    place = torch.distributed.get_rank(group)
    return group, int(sum(int(r) for r in everyone[:place])), len(everyone)


def merge_topk(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int,
               group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole row's top-k and logsumexp from each rank's shard results.

    Args:
        values: ``[C, k]`` this shard's top values (``-inf`` where the shard has fewer than k rows).
        ids: ``[C, k]`` their vocabulary ids (global).
        lse: ``[C]`` fp32 logsumexp of this shard's logits.
        group: the tensor-parallel process group.

    Returns:
        ``values [C, k]`` sorted descending, ``ids [C, k]``, ``lse [C]`` fp32, the same on every rank.
    """
    ranks = torch.distributed.get_world_size(group)
    gathered = [[torch.empty_like(t) for _ in range(ranks)] for t in (values, ids, lse)]
    for out, mine in zip(gathered, (values, ids, lse)):
        torch.distributed.all_gather(out, mine.contiguous(), group=group)
    all_values, all_ids = torch.cat(gathered[0], dim=-1), torch.cat(gathered[1], dim=-1)
    top, where = torch.topk(all_values, k, dim=-1, largest=True, sorted=True)
    return top, all_ids.gather(-1, where), torch.logsumexp(torch.stack(gathered[2]), dim=0)


class ShardedTopK(ChunkedHead):
    """``ChunkedHead`` for top-k logits when the head's vocabulary is split across ranks (``vocab_shards``).

    Args:
        model: the tensor-parallel teacher.
        chunk: valid tokens per chunk (> 0).
        settings: the run's logit mode and its fields (``Targets.logit``: top-k, log-prob step).
        shards: ``vocab_shards(model)``.
    """

    def __init__(self, model: PreTrainedModel, chunk: int, settings: LogitSettings,
                 shards: tuple[Any, int, int]) -> None:
        super().__init__(model, chunk)
        self.settings = settings
        self.group, self.first, _ = shards
        head = model.get_output_embeddings()
        self.weight = head.weight.to_local()  # [V/N, d], rows first..first + V/N - 1
        bias = getattr(head, "bias", None)
        self.bias = bias.to_local() if bias is not None else None
        self.scale = getattr(model.config, "logit_scale", None)
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self._probing = False

    def probe(self, last: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        self._probing = True
        try:
            return super().probe(last, valid)
        finally:
            self._probing = False

    def _kept(self, chunk: torch.Tensor, keep: Callable[[torch.Tensor], dict[str, torch.Tensor]]
              ) -> dict[str, torch.Tensor]:
        """This chunk's ``[C, d]`` -> the merged top-k targets (or, while probing, the logsumexp and top-1)."""
        local = finish_logits(torch.nn.functional.linear(chunk, self.weight, self.bias), self.scale, self.cap)
        k = 1 if self._probing else self.settings.top_k
        values, ids = torch.topk(local, min(k, local.shape[-1]), dim=-1, largest=True, sorted=True)
        if values.shape[-1] < k:  # a shard narrower than k: pad with entries that never win
            pad = k - values.shape[-1]
            values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
            ids = torch.nn.functional.pad(ids, (0, pad), value=0)
        values, ids, lse = merge_topk(values, ids + self.first, torch.logsumexp(local.float(), dim=-1), k, self.group)
        if self._probing:
            return {"logits/lse": lse, "logits/top1": ids[..., 0]}
        mass = torch.exp(values.float() - lse.unsqueeze(-1)).sum(-1)
        kept = {"logits/topk_values": values, "logits/topk_ids": ids.to(torch.int32), "logits/lse": lse,
                TOPK_MASS: mass}
        return as_logprobs(kept) if self.settings.logprob_step else kept


def chunked_head(model: PreTrainedModel, chunk: int, settings: LogitSettings) -> ChunkedHead:
    """The head for this run: ``ShardedTopK`` for top-k logits from a vocabulary-sharded head, else the plain
    ``ChunkedHead`` (whose head module, under tensor parallelism, gathers each ``[chunk, V]`` block: full and
    sampled logits need the whole row)."""
    ranked = settings.kind is not None and settings.kind.ranked
    shards = vocab_shards(model) if chunk > 0 and ranked else None
    return ShardedTopK(model, chunk, settings, shards) if shards else ChunkedHead(model, chunk)
