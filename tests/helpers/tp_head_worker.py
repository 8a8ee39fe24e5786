"""Run under torchrun (2 ranks, gloo): load a tiny Llama with transformers' tensor parallelism through kdcache's
loader, and check on every rank, against the same teacher loaded whole in this process:

* the head's vocabulary is split (``vocab_shards``) and ``chunked_head`` picks ``ShardedTopK``;
* the layer outputs (``hidden_states``) are whole on every rank;
* the merged top-k ids, values and logsumexp equal ``torch.topk`` / ``torch.logsumexp`` of the whole model's
  logits.

Writes ``{rank}.json`` with the largest differences into the folder given as the second argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(teacher: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from kdcache.stages.precompute.capture.logit_head import ChunkedHead
    from kdcache.stages.precompute.capture.sharded_head import ShardedTopK, chunked_head, vocab_shards
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.core.plan import PrecomputePlan
    from kdcache.stages.precompute.parallel.distributed import DistContext
    from kdcache.stages.precompute.teacher import load_for_inference
    from kdcache.stages.targets import logits as logit_kinds

    ctx = DistContext.from_env(gpu_collectives=True)
    options = PrecomputeOptions.of(teacher=teacher, data=teacher, out=str(out / "unused"), teacher_parallel="tp:2")
    setup = PrecomputePlan.of(options).teacher
    model = load_for_inference(AutoModelForCausalLM, setup, torch.device("cpu"), eager=False)
    whole = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    shards = vocab_shards(model)
    assert shards is not None and shards[2] == 2, shards
    settings = logit_kinds.LogitSettings(logit_kinds.get("topk"), top_k=8)
    head = chunked_head(model, 5, settings)  # 5-token chunks: several per batch, the last one short
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(7))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 7:] = False
    with torch.no_grad():
        base = model.model(input_ids=ids, output_hidden_states=True)
        reference = whole(input_ids=ids, output_hidden_states=True)
        kept = head.targets(base.last_hidden_state, valid, lambda logits: {})
    values, top = torch.topk(reference.logits, 8, dim=-1)
    lse = torch.logsumexp(reference.logits, dim=-1)
    m = valid
    result = {
        "sharded": isinstance(head, ShardedTopK) and type(head) is not ChunkedHead,
        "first_row": shards[1],
        "hidden": max(float((a - b).abs().max()) for a, b in zip(base.hidden_states, reference.hidden_states)),
        "ids_equal": bool((kept["logits/topk_ids"][m] == top[m].int()).all()),
        "values": float((kept["logits/topk_values"][m] - values[m]).abs().max()),
        "lse": float((kept["logits/lse"][m] - lse[m]).abs().max()),
        "padding_zero": bool((kept["logits/topk_ids"][~m] == 0).all()),
    }
    (out / f"{ctx.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
