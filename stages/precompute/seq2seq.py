"""Stage one for encoder-decoder teachers (BART, mBART, T5 / Flan-T5): ``run_seq2seq``.

The same machinery as decoder-only teachers (writer parts, resumption, background writer, job arrays, ranks);
what differs is the data (source/target pairs), the forward (teacher-forced decoder) and the cache, which holds
two token streams (``layout="seq2seq"``, format v2; see docs/cache-format.md).

``runner._run`` sends a teacher here when its config says ``is_encoder_decoder``. The "finished cache" fast
path of decoder-only teachers is not used: rerunning a finished seq2seq precompute loads the weights, finds
every shard committed and writes nothing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.precompute.batching import Partition, collate, plan_batches
from kdcache.stages.precompute.distributed import DistContext
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import PrecomputeOptions
from kdcache.stages.precompute.progress import Progress, RunStats, summarize
from kdcache.stages.precompute.seq2seq_capture import Seq2SeqCapture
from kdcache.stages.precompute.seq2seq_data import PairedData, load_pairs, paired_data_fingerprint, tokenize_pairs
from kdcache.stages.precompute.seq2seq_targets import Seq2SeqTargets, build_seq2seq_spec, resolve_seq2seq_targets
from kdcache.stages.precompute.teacher import (
    Teacher,
    load_for_inference,
    load_tokenizer,
    pick_device,
    save_tokenizer,
    teacher_fingerprint,
)
from kdcache.storage.spec import FORMAT_VERSION

_HEAD_KEYS = ("lm_head", "final_logits_bias")  # what a checkpoint without an LM head lacks
_SEQ2SEQ_ONLY = ("source_column", "target_column", "max_target_length", "encoder_layers", "decoder_layers",
                 "encoder_attention_layers", "decoder_attention_layers", "cross_attention_layers")


def is_seq2seq(config: Any) -> bool:
    """Whether the teacher is an encoder-decoder."""
    return bool(getattr(config, "is_encoder_decoder", False))


def check_not_seq2seq_options(options: PrecomputeOptions, config: Any) -> None:
    """Refuse seq2seq-only options for a decoder-only or encoder teacher, rather than ignore them."""
    given = [name for name in _SEQ2SEQ_ONLY if getattr(options, name) not in (None, ())]
    if "cross_attention" in options.features:
        given.append("features cross_attention")
    if given:
        raise PrecomputeError(f"{', '.join(given)}: only for encoder-decoder teachers, and "
                              f"{options.teacher!r} is a {config.model_type} without a decoder stack")


def load_seq2seq_teacher(options: PrecomputeOptions, config: Any, targets: Seq2SeqTargets, tokenizer: Any,
                         device: Any) -> Teacher:
    """Load an ``AutoModelForSeq2SeqLM`` for inference; eager attention only when maps are captured.

    Raises:
        PrecomputeError: weights missing (a missing LM head only matters when logits are cached).
    """
    from transformers import AutoModelForSeq2SeqLM

    model = load_for_inference(AutoModelForSeq2SeqLM, options, device, eager=targets.wants_attention,
                               optional=() if targets.logits else _HEAD_KEYS)
    fingerprint = {**teacher_fingerprint(options, model), "num_encoder_layers": targets.encoder_depth,
                   "num_decoder_layers": targets.decoder_depth}
    impl = getattr(model.config, "_attn_implementation", None) or "default"
    return Teacher(model, tokenizer, model.config, device, fingerprint, impl)


def check_inputs(teacher: Teacher, data: PairedData) -> None:
    """Refuse ids the embedding table lacks and lengths beyond a learned position table (BART's)."""
    table = teacher.model.get_input_embeddings().num_embeddings
    top = max(max(int(s.max()) for s in data.sources), max(int(t.max()) for t in data.targets))
    if top >= table:
        raise PrecomputeError(f"the tokenizer produced token id {top}, but the teacher's embedding table has only "
                              f"{table} rows; the tokenizer does not belong to this teacher")
    limit = getattr(teacher.config, "max_position_embeddings", None)
    longest = max(max(len(s) for s in data.sources), max(len(t) for t in data.targets))
    if isinstance(limit, int) and longest > limit:
        raise PrecomputeError(f"max_length: sequences reach {longest} tokens, but the teacher has only {limit} "
                              f"positions; lower --max-length / --max-target-length")


def seq2seq_fingerprints(options: PrecomputeOptions, teacher: Teacher, targets: Seq2SeqTargets,
                         data: PairedData) -> dict[str, Any]:
    """Teacher, tokenizer, data and settings fingerprints, identical for every rank and rerun."""
    settings = {
        "max_length": options.max_length, "max_target_length": options.max_target_length or options.max_length,
        "encoder_layers": list(targets.encoder_hidden), "decoder_layers": list(targets.decoder_hidden),
        "encoder_attention_layers": list(targets.encoder_attention),
        "decoder_attention_layers": list(targets.decoder_attention),
        "cross_attention_layers": list(targets.cross_attention),
        "heads": list(targets.heads) if targets.heads is not None else None, "features": list(options.features),
        "top_k": targets.top_k, "logits": targets.logits, "dtype": options.dtype, "codec": options.codec_config,
        "bitround": options.bitround, "triangle": options.triangle, "format_version": FORMAT_VERSION,
        "teacher_dtype": str(teacher.model.dtype).replace("torch.", ""),
        "attn_implementation": teacher.attn_implementation}
    return {"teacher": teacher.fingerprint, "tokenizer": tokenizer_fingerprint(teacher.tokenizer),
            "data": paired_data_fingerprint(options, data), "settings": settings}


def run_seq2seq(options: PrecomputeOptions, dist: DistContext, config: Any, stats: RunStats) -> dict[str, Any]:
    """Compute and cache an encoder-decoder teacher's targets for this process's part of the data.

    Returns:
        the same summary as ``runner.run_precompute``.
    """
    from kdcache.stages.precompute.commit import commit_behind, open_writer

    targets = resolve_seq2seq_targets(options, config)
    tokenizer = load_tokenizer(options)
    data = tokenize_pairs(load_pairs(options), tokenizer, options)
    teacher = load_seq2seq_teacher(options, config, targets, tokenizer, pick_device(options.device, dist.local_rank))
    targets = _with_output_vocab(targets, teacher, options)
    check_inputs(teacher, data)
    spec = build_seq2seq_spec(options, targets, len(data))
    part = Partition.of(options.shard_index, options.num_shards, dist.rank, dist.world)
    writer = open_writer(options.out, spec, seq2seq_fingerprints(options, teacher, targets, data), part)
    with writer:
        save_tokenizer(tokenizer, options.out)
        mine = part.shards(spec.num_shards)
        todo = [k for k in mine if k not in writer.committed_shards()]
        capture = Seq2SeqCapture(teacher.model, targets, options.dtype)
        commit_behind(spec, todo, writer, options, stats, dist.is_main,
                      lambda bounds, progress: _compute_shard(capture, teacher, data, bounds, options, stats,
                                                              progress))
    manifest = writer.finalize()
    dist.barrier()
    if dist.world > 1 and dist.is_main:
        from kdcache.storage import merge_parts

        manifest = merge_parts(options.out)
    extra = {"part": [part.index, part.count], "device": str(teacher.device), "layout": "seq2seq",
             "attn_implementation": teacher.attn_implementation}
    return summarize(stats, manifest, len(mine) - len(todo), options.out, extra)


def _with_output_vocab(targets: Seq2SeqTargets, teacher: Teacher, options: PrecomputeOptions) -> Seq2SeqTargets:
    """The LM head's real output size is the vocabulary (checkpoints may pad it beyond config.vocab_size)."""
    from dataclasses import replace

    head = teacher.model.get_output_embeddings()
    if targets.logits is None or head is None:
        return targets
    vocab = int(head.weight.shape[0])
    if targets.logits == "topk" and options.top_k > vocab:
        raise PrecomputeError(f"top_k {options.top_k} is larger than the teacher's vocabulary of {vocab} tokens")
    return replace(targets, vocab_size=vocab)


def _compute_shard(capture: Seq2SeqCapture, teacher: Teacher, data: PairedData, bounds: tuple[int, int],
                   options: PrecomputeOptions, stats: RunStats, progress: Progress) -> list[dict[str, np.ndarray]]:
    """One shard's pairs in batches bucketed by source length; items come back in data order."""
    import torch

    start, stop = bounds
    sources, targets = data.sources[start:stop], data.targets[start:stop]
    items: list[dict[str, np.ndarray] | None] = [None] * len(sources)
    pad = teacher.tokenizer.pad_token_id if teacher.tokenizer.pad_token_id is not None else 0
    for batch in plan_batches(np.array([len(s) for s in sources]), options.batch_size):
        src, src_mask = collate([sources[i] for i in batch], pad)
        tgt, tgt_mask = collate([targets[i] for i in batch], pad)
        arrays = {"input_ids": src, "attention_mask": src_mask, "labels": tgt, "decoder_attention_mask": tgt_mask}
        tensors = {k: torch.from_numpy(v).to(teacher.device) for k, v in arrays.items()}
        started = time.perf_counter()
        output = capture.run(tensors, [len(sources[i]) for i in batch], [len(targets[i]) for i in batch])
        stats.forward_seconds += time.perf_counter() - started
        for i, item in zip(batch, output):
            item["encoder/input_ids"], item["decoder/input_ids"] = sources[i], targets[i]
            items[i] = item
            stats.tokens += len(sources[i]) + len(targets[i])
        stats.sequences += len(batch)
        progress.update(len(batch))
    return items  # type: ignore[return-value]
