"""``kdcache draft``: train an EAGLE-3 head from a cache written with ``--layers draft``, with no target in memory.

The cache is read as ``kdcache train`` reads it (``CacheStream``, decoded on the device by ``to_device`` with the
cache's hidden codec), and the head trains under the same DeepSpeed engine set-up (``engine.build_engine``). What
the draft needs beside the three layers comes from the cache too: the target's embedding and token counts
(``draft/``), its next-token distribution (the logits, or ``teacher_head/`` on the last layer).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.draft.export import LAYOUTS, export_draft
from kdcache.stages.draft.model import DraftShape, Eagle3Draft, default_heads
from kdcache.stages.draft.objective import DraftObjective, distribution_arrays
from kdcache.stages.draft.vocab import DraftInputError, DraftVocab
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.draft.draft_inputs import read_draft_inputs
from kdcache.stages.targets.hidden.device_codecs import load_projection
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.engine import build_engine, init_distributed
from kdcache.stages.train.feed.streaming import CacheStream, to_device
from kdcache.storage import CacheReader, KdcacheError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

DEFAULT_DRAFT_VOCAB = 32000


@dataclass(frozen=True)
class DraftOptions:
    """What ``kdcache draft`` takes (its flags, by the same names)."""

    cache: str
    out: str
    ttt_steps: int = 3  # K: steps the draft is fed its own outputs in training
    draft_vocab: int = 0  # N, at most V; 0: min(32000, V), EAGLE-3's usual size
    max_steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    heads: int = 0  # 0: default_heads(d)
    intermediate: int = 0  # 0: 4 d
    layout: str = "speculators"  # export.LAYOUTS: speculators (vLLM reads it) or sglang

    def problems(self) -> list[str]:
        """Values out of range, each with what was expected."""
        checks = [("ttt_steps", self.ttt_steps, "at least 1 (the steps a draft is trained to chain)"),
                  ("max_steps", self.max_steps, "at least 1"),
                  ("batch_size", self.batch_size, "at least 1")]
        out = [f"--{name.replace('_', '-')}: got {value}, expected {wanted}"
               for name, value, wanted in checks if value < 1]
        return out + ([] if self.layout in LAYOUTS else
                      [f"--layout: got {self.layout!r}, expected one of {', '.join(LAYOUTS)}"])


def open_draft_cache(cache: str) -> tuple[CacheReader, dict[str, torch.Tensor], dict[str, Any]]:
    """The cache, its ``draft/`` tensors and record, checked to hold the layers the draft fuses.

    Raises:
        KdcacheError: no ``draft/``, or a fused layer missing from the cache.
    """
    reader = CacheReader(cache)
    tensors, info = read_draft_inputs(reader.store)
    missing = [j for j in info["layers"] if j not in reader.spec.hidden_layers]
    if missing:
        raise DraftInputError(f"the cache's draft/ names layers {info['layers']}, but hidden layers {missing} are not "
                              f"in the cache (it holds {list(reader.spec.hidden_layers)}); rerun stage one with "
                              f"--layers draft")
    return reader, tensors, info


def new_draft(tensors: dict[str, torch.Tensor], info: dict[str, Any], options: DraftOptions) -> Eagle3Draft:
    """A freshly initialised draft over the cache's embedding and most frequent tokens."""
    d, vocab = int(info["hidden_size"]), int(info["vocab_size"])
    size = options.draft_vocab or min(DEFAULT_DRAFT_VOCAB, vocab)
    if not 1 <= size <= vocab:
        raise DraftInputError(f"--draft-vocab: got {options.draft_vocab}, expected 1..{vocab}, at most the target's "
                              f"vocabulary size V (0: min({DEFAULT_DRAFT_VOCAB}, V))")
    words = DraftVocab.most_frequent(tensors["token_counts"], size)
    heads = options.heads or default_heads(d)
    if d % heads:
        raise DraftInputError(f"--heads: got {heads}, expected a divisor of the hidden size {d}")
    shape = DraftShape(d, vocab, size, heads, options.intermediate or 4 * d,
                       tuple(info["layers"]))
    torch.manual_seed(options.seed)
    return Eagle3Draft(shape, tensors["embedding"], words.d2t, words.t2d)


def run_draft(options: DraftOptions) -> dict[str, Any]:
    """Train, export to ``options.out``, and return a summary (steps, first and last loss, accuracy per step)."""
    problems = options.problems()
    if problems:
        raise DraftInputError("; ".join(problems))
    reader, tensors, info = open_draft_cache(options.cache)
    kind = logit_kinds.of(reader.spec.logit_layout)
    names = ["input_ids", *(f"hidden/{j}" for j in info["layers"]), *distribution_arrays(reader.spec, kind)]
    assert kind is not None  # distribution_arrays refused a cache without logits
    draft = new_draft(tensors, info, options)
    dist_info = init_distributed()
    head = load_teacher_head(reader.store, reader.spec.hidden_layers) if kind.teacher_head else None
    objective = DraftObjective(draft, kind, head, options.ttt_steps).to(dist_info.device)
    engine = build_engine(objective, _engine_options(options), dist_info.device)
    stream = CacheStream(reader, sorted(set(names)), batch_size=options.batch_size, seed=options.seed,
                         rank=dist_info.rank, world_size=dist_info.world_size)
    start = time.perf_counter()
    losses = _loop(engine, stream, reader, options.max_steps, dist_info.device)
    out = Path(options.out)
    if dist_info.rank == 0:
        target = {**info, "name_or_path": reader.fingerprints.get("teacher", {}).get("name_or_path")}
        export_draft(draft, out, target, options.ttt_steps, options.layout)
        (out / "draft_run.json").write_text(json.dumps({"options": asdict(options), "losses": losses}, indent=1))
    return {"steps": len(losses), "layout": options.layout, "first_loss": losses[0]["loss"],
            "last_loss": losses[-1]["loss"],
            "last_accuracy": losses[-1]["accuracy"], "out": str(out), "seconds": time.perf_counter() - start}


def _engine_options(options: DraftOptions) -> TrainOptions:
    """The engine set-up ``kdcache train`` uses, for the draft's batch, rate and run folder."""
    return TrainOptions.of(cache=options.cache, student=options.out, out=options.out, batch_size=options.batch_size,
                           lr=options.lr, seed=options.seed, warmup_steps=0)


def _loop(engine: DeepSpeedEngine, stream: CacheStream, reader: CacheReader, steps: int,
          device: torch.device) -> list[dict[str, float]]:
    """``steps`` optimiser steps over the stream (epochs repeat); per step its loss and step-0.. accuracy."""
    projection = load_projection(reader)
    losses: list[dict[str, float]] = []
    engine.train()
    for batch in stream:
        out = engine(to_device(batch, device, reader.spec.hidden_codec, projection))
        engine.backward(out["loss"])
        engine.step()
        losses.append({"loss": float(out["loss"]), "accuracy": float(out["accuracy"])})
        if len(losses) >= steps:
            return losses
    raise KdcacheError("the cache ran out of batches")  # CacheStream repeats epochs; never reached
