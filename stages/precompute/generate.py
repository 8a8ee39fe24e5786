"""``kdcache generate``: the teacher writes responses to a dataset's prompts, and the targets precompute would keep
of the finished text are kept while it writes them (``generation.DecodeLoop``), so the teacher runs once.

The cache is stage one's in every other respect, and built by the same parts: targets (``core.targets``), spec
(``cache_spec``), writer and commit protocol (``commit``), fingerprints (``runner.build_fingerprints``, with the
sampling settings under ``settings.generation``), parts of a job array or torchrun ranks (``rows.Partition``).
Sequence ``s`` is response ``s % n`` to prompt ``s // n``; a shard is a fixed range of sequences, and a response
depends only on (seed, prompt, response number), so a killed run resumes at its first uncommitted shard and gives
the same bytes. Rows hold the prompt then the response; the loss mask covers the response (its end token
included). Once the cache is complete, ``OUT.generations.jsonl`` beside it holds the conversations as a dataset (text
and token ids) for plain SFT. ``--responses given`` caches a dataset's own responses with ``precompute``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.common.architectures import is_encoder_decoder
from kdcache.stages.precompute.cache_spec import MAX_SHARD_SEQUENCES, SHARD_TOKENS, build_spec
from kdcache.stages.precompute.capture.qk_capture import with_score_rules
from kdcache.stages.precompute.capture.transfer import ShardItems
from kdcache.stages.precompute.commit import check_out_folder, commit_behind, open_writer
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan, TeacherSetup
from kdcache.stages.precompute.core.progress import Progress, RunStats, summarize
from kdcache.stages.precompute.core.targets import Targets, resolve_targets
from kdcache.stages.precompute.core.teacher_id import Teacher
from kdcache.stages.precompute.generation.decode import DecodeLoop
from kdcache.stages.precompute.generation.options import GenerateOptions, Sampling
from kdcache.stages.precompute.generation.packed import (
    discard_leftover,
    pack_plan,
    packed_streams,
    remove_unpacked,
    unpacked_path,
    write_packed,
)
from kdcache.stages.precompute.generation.prompts import Prompts, load_prompts
from kdcache.stages.precompute.parallel.distributed import DistContext
from kdcache.stages.precompute.rows.batching import Partition, plan_batches
from kdcache.stages.precompute.rows.data import TokenStreams
from kdcache.stages.precompute.runner import build_fingerprints, run_precompute
from kdcache.stages.precompute.teacher import (
    load_teacher,
    load_tokenizer,
    pick_device,
    read_config,
    save_tokenizer,
    with_default_features,
    with_output_vocab,
)
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.logits.teacher_head import export_head
from kdcache.storage import (
    CacheLockedError,
    CacheMismatchError,
    CacheReader,
    Store,
    compare_fingerprints,
    merge_parts,
    read_manifest,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from kdcache.storage import CacheWriter, Manifest

GENERATIONS_SUFFIX = ".generations.jsonl"  # the generated conversations: OUT.generations.jsonl, once complete


def run_generate(options: GenerateOptions) -> dict[str, Any]:
    """Generate and cache this process's part of the responses (every rank under torchrun; rank 0 merges).

    Returns:
        precompute's summary (``core.progress.summarize``) plus ``generation`` (the sampling settings) and
        ``generations`` (the dataset file, once the cache is complete).

    Raises:
        KdcacheError: bad input (``PrecomputeError``: a prompt beyond ``--max-length``, chat data without a
            template, responses beyond the teacher's positions, an encoder teacher) or a cache problem.
    """
    if options.generation.responses == "given":  # a faster engine wrote them: only cache them
        return {**run_precompute(options.precompute), "generation": {"responses": "given"}}
    dist = DistContext.from_env()
    try:
        return _run(options, dist)
    finally:
        dist.close()


@dataclass(frozen=True)
class _Ready:
    """What a run has checked and loaded before it writes: the options with the teacher's defaults, the plan, the
    prompts and the sequences made of them, the loaded teacher and its targets, the sampling rule, and whether
    OUT.unpacked stays once packed."""

    options: PrecomputeOptions
    plan: PrecomputePlan
    prompts: Prompts
    rows: TokenStreams
    teacher: Teacher
    targets: Targets
    sampling: Sampling
    keep_unpacked: bool = False


def _run(options: GenerateOptions, dist: DistContext) -> dict[str, Any]:
    """The checks of the input, cheapest first; then the weights, and an estimate or the run."""
    config = read_config(TeacherSetup.of(options.engine))
    pre = with_default_features(options.precompute, config)
    targets = _targets(pre, config)
    plan = PrecomputePlan.of(pre)
    sampling = options.generation.sampling(options.engine.seed)
    tokenizer = load_tokenizer(plan.teacher)
    prompts = load_prompts(plan.rows, tokenizer)
    _check_positions(config, prompts, sampling)
    teacher = load_teacher(plan.teacher, config, targets, tokenizer, pick_device(options.engine.device,
                                                                                   dist.local_rank))
    rows = _sequences(prompts, sampling.num_responses)
    targets = with_score_rules(with_output_vocab(targets, teacher, plan.teacher), teacher.model, rows, teacher.device)
    ready = _Ready(pre, plan, prompts, rows, teacher, targets, sampling, options.generation.keep_unpacked)
    if options.engine.estimate:
        return estimate_generation(ready)
    return _write(ready, check_out_folder(plan.write.out), dist)  # a refused run has written nothing


def _write(ready: _Ready, store: Store, dist: DistContext) -> dict[str, Any]:
    """This part's responses generated and committed, then the manifest; once complete, the generations and, with
    ``--packing``, the packed cache (``generation.packed``: the responses first go one a row to OUT.unpacked,
    removed once OUT is complete unless ``--keep-unpacked``). A complete packed OUT is left as it is."""
    stats, out = RunStats(), ready.plan.write.out
    packing = ready.options.dataset.packing != "none"
    extra: dict[str, Any] = {"device": str(ready.teacher.device), "generation": ready.sampling.record()}
    if packing and (packed := _packed_before(ready, store)) is not None:
        return summarize(stats, packed, packed.spec.num_shards, out, extra)
    responses = check_out_folder(unpacked_path(out)) if packing else store
    manifest, part, skipped = _generate(ready, responses, dist, stats)
    extra["part"] = [part.index, part.count]
    if manifest.status != "complete" or not dist.is_main:
        return summarize(stats, manifest, skipped, unpacked_path(out) if packing else out, extra)
    extra["generations"] = write_generations(responses, out, ready.prompts, ready.sampling.num_responses,
                                             ready.teacher.tokenizer)
    if packing:
        packed = _pack(ready, responses, store, stats)
        if packed is None:  # two parts of a job array found the responses complete at once: the other packs
            extra["packing"] = "another process is packing OUT now; rerun this command to find it complete"
            return summarize(stats, manifest, skipped, unpacked_path(out), {**extra, "unpacked": unpacked_path(out)})
        manifest = packed
        extra.update(_unpacked_after(ready, responses))
    return summarize(stats, manifest, skipped, out, extra)


def _packed_before(ready: _Ready, store: Store) -> Manifest | None:
    """OUT's manifest where an earlier run packed it complete with this run's fingerprints (nothing to do, and
    OUT.unpacked not needed); None where OUT is new or partial.

    Raises:
        CacheMismatchError: OUT holds another cache (refused before anything is generated for it).
    """
    if store.size("manifest.json") is None:
        return None
    manifest = read_manifest(store)
    differences = compare_fingerprints(manifest.fingerprints, _fingerprints(ready, ready.options, ready.rows),
                                       strict=True)
    if differences:
        raise CacheMismatchError(f"{ready.plan.write.out} already holds a different cache:\n  - "
                                 + "\n  - ".join(differences), differences=differences)
    if manifest.status != "complete":
        return None
    discard_leftover(ready.plan.write.out)  # a removal of OUT.unpacked killed midway
    return manifest


def _unpacked_after(ready: _Ready, responses: Store) -> dict[str, Any]:
    """What became of OUT.unpacked once OUT is packed: kept (``--keep-unpacked``, or a cache in object storage),
    or removed, with its size."""
    if ready.keep_unpacked or not responses.is_local:
        return {"unpacked": unpacked_path(ready.plan.write.out)}
    removed = remove_unpacked(ready.plan.write.out)
    return {"removed": {"path": removed[0], "bytes": removed[1]}} if removed is not None else {}


def _generate(ready: _Ready, store: Store, dist: DistContext, stats: RunStats) -> tuple[Manifest, Partition, int]:
    """This part's shards of responses (one a row) generated and committed; the manifest once every rank is done.

    Returns:
        the manifest, this process's part, and how many of its shards an earlier run had committed.
    """
    sampling, teacher, targets = ready.sampling, ready.teacher, ready.targets
    plan, engine = ready.plan, ready.options.engine
    write = replace(plan.write, sequences_per_shard=plan.write.sequences_per_shard or _per_shard(ready.prompts,
                                                                                                  sampling))
    spec = build_spec(write, targets, ready.rows)
    options = replace(ready.options, dataset=replace(ready.options.dataset, packing="none"))
    fingerprints = _fingerprints(ready, options, ready.rows)
    part = Partition.of(write.shard_index, write.num_shards, dist.rank, dist.world)
    writer = open_writer(store, spec, fingerprints, part)
    loop = DecodeLoop(teacher, targets, write.dtype, write.hidden_codec, sampling)
    mine = part.shards(spec.num_shards)
    with writer:
        todo = [k for k in mine if k not in writer.committed_shards()]
        _save_teacher_files(ready, store, dist.is_main)

        def stream(bounds: list[tuple[int, int]], progress: Progress) -> Generator[ShardItems, None, None]:
            return _shards(loop, ready.prompts, sampling.num_responses, bounds, engine.batch_size, stats, progress)

        commit_behind(spec, todo, writer, stats, stream, show_progress=engine.progress and dist.is_main,
                      queue_size=engine.queue_size, workers=engine.writers, label="generate")
    manifest = _finish(writer, store, dist)
    return manifest, part, _whole_run(stats, len(mine) - len(todo), dist)


def _fingerprints(ready: _Ready, options: PrecomputeOptions, rows: TokenStreams) -> dict[str, Any]:
    """Precompute's fingerprints of ``rows`` under ``options``, with the sampling settings beside the others (the
    packed rows' data fingerprint is the prompts', as the responses' is)."""
    fingerprints = build_fingerprints(options, ready.teacher, ready.targets, rows)
    fingerprints["settings"]["generation"] = ready.sampling.record()
    return fingerprints


def _whole_run(stats: RunStats, skipped: int, dist: DistContext) -> int:
    """Under torchrun, the counts of every rank into ``stats`` (what rank 0's summary prints as this run's: its
    own shards alone were half the run at two ranks); the shards skipped, summed alike. Rates stay rank 0's clock
    over the total. One process (a job array's part included): its own, unchanged."""
    tokens, sequences, written, stored, skipped_ = dist.sum([float(stats.tokens), float(stats.sequences),
                                                             float(stats.shards_written), float(stats.stored_bytes),
                                                             float(skipped)])
    stats.tokens, stats.sequences, stats.shards_written = int(tokens), int(sequences), int(written)
    stats.stored_bytes = int(stored)
    return int(skipped_)


def _save_teacher_files(ready: _Ready, store: Store, main: bool) -> None:
    """What stage two reads beside the targets: the tokenizer, and the output head for the ``head`` logit kind."""
    save_tokenizer(ready.teacher.tokenizer, store)
    if logit_kinds.uses_head(ready.targets.logit.name) and main:
        export_head(ready.teacher.model, store, ready.targets.streams[""].depth)


def _pack(ready: _Ready, responses: Store, store: Store, stats: RunStats) -> Manifest | None:
    """The complete unpacked cache's rows packed into OUT (``generation.packed``), its shards not yet committed
    written (a killed packing resumes): its spec counts the packed rows, its fingerprints name the packing. None
    when another live process holds OUT's writer (the last parts of a job array, finishing together)."""
    lengths = [len(CacheReader(responses).get(s, ["input_ids"])["input_ids"]) for s in range(len(ready.rows))]
    rows = pack_plan(lengths, ready.plan.rows.max_length)
    streams = packed_streams(lengths, rows, ready.rows.fingerprint)
    spec = build_spec(replace(ready.plan.write, shard_index=0, num_shards=1), ready.targets, streams)
    fingerprints = _fingerprints(ready, ready.options, streams)
    try:
        writer = open_writer(store, spec, fingerprints, Partition(0, 1))
    except CacheLockedError:
        return None
    _save_teacher_files(ready, store, main=True)
    return write_packed(responses, writer, rows, stats)


ESTIMATE_SEQUENCES = 8  # responses sampled by --estimate (at least one batch)


def estimate_generation(ready: _Ready) -> dict[str, Any]:
    """``--estimate``: the first responses generated (with capture, nothing written) to measure their lengths and
    the rate, and from them the whole run's tokens and time.

    Returns:
        ``{"status": "estimate", "sequences", "sampled", "mean_response_tokens", "longest_response_tokens",
        "tokens_per_second", "tokens", "seconds"}``: ``tokens`` and ``seconds`` projected over every sequence.
    """
    total = len(ready.rows)
    count = min(total, max(ESTIMATE_SEQUENCES, ready.options.engine.batch_size))
    loop = DecodeLoop(ready.teacher, ready.targets, ready.plan.write.dtype, ready.plan.write.hidden_codec,
                      ready.sampling)
    stats = RunStats()
    stats.compute_started = time.perf_counter()
    (items,) = _shards(loop, ready.prompts, ready.sampling.num_responses, [(0, count)],
                       ready.options.engine.batch_size, stats, Progress(0, False, stats))
    seconds = time.perf_counter() - stats.compute_started
    responses = [int(item["loss_mask"].sum()) for item in items]
    prompt_tokens = sum(len(ready.rows.ids[""][s]) for s in range(total))
    tokens = prompt_tokens + total * float(np.mean(responses))
    rate = stats.tokens / max(seconds, 1e-9)
    return {"status": "estimate", "out": ready.plan.write.out, "sequences": total, "sampled": count,
            "mean_response_tokens": round(float(np.mean(responses)), 1),
            "longest_response_tokens": max(responses), "tokens_per_second": round(rate, 1),
            "tokens": int(round(tokens)), "seconds": round(tokens / rate, 1)}


def format_generate_estimate(estimate: dict[str, Any]) -> str:
    """The estimate's lines for the command line."""
    return (f"estimate for {estimate['out']}: {estimate['sequences']:,} responses; {estimate['sampled']} sampled: "
            f"{estimate['mean_response_tokens']:,.1f} tokens a response on average, "
            f"{estimate['longest_response_tokens']} at most\n"
            f"about {estimate['tokens']:,} tokens with the prompts, at {estimate['tokens_per_second']:,.0f} "
            f"tokens/s here: {estimate['seconds'] / 60:,.1f} min (nothing was written)")


def _targets(options: PrecomputeOptions, config: PretrainedConfig) -> Targets:
    """The targets, refused where the decode loop cannot keep them."""
    if is_encoder_decoder(config):
        raise PrecomputeError(f"kdcache generate needs a decoder-only teacher; {options.engine.teacher!r} is an "
                              f"encoder-decoder {config.model_type}")
    targets = resolve_targets(options, config)
    if not targets.causal:
        raise PrecomputeError(f"kdcache generate needs a causal language model; {options.engine.teacher!r} is a "
                              f"{config.model_type} encoder, which writes no text")
    return targets


def _check_positions(config: PretrainedConfig, prompts: Prompts, sampling: Sampling) -> None:
    """Refuse responses that could run past the teacher's position table."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    longest = max(len(p) for p in prompts.ids)
    if isinstance(limit, int) and longest + sampling.max_new_tokens > limit:
        raise PrecomputeError(f"max_new_tokens: the longest prompt ({longest} tokens) plus --max-new-tokens "
                              f"{sampling.max_new_tokens} reaches {longest + sampling.max_new_tokens} tokens, but the "
                              f"teacher has only {limit} positions; lower --max-new-tokens to "
                              f"{max(limit - longest, 0)} or less, or --max-length")


def _sequences(prompts: Prompts, responses: int) -> TokenStreams:
    """The cache's sequences as far as they are known before generating: each prompt ``responses`` times (what
    the spec reads: their count and the loss mask beside the ids)."""
    ids = [a for a in prompts.ids for _ in range(responses)]
    return TokenStreams({"": ids}, prompts.fingerprint, {"loss_mask": ids})


def _per_shard(prompts: Prompts, sampling: Sampling) -> int:
    """Sequences per shard when not given: as precompute sizes them, at the longest a sequence can grow."""
    longest = max(len(p) for p in prompts.ids) + sampling.max_new_tokens
    return max(1, min(MAX_SHARD_SEQUENCES, SHARD_TOKENS // longest))


def _shards(loop: DecodeLoop, prompts: Prompts, responses: int, bounds: list[tuple[int, int]], batch_size: int,
            stats: RunStats, progress: Progress) -> Generator[ShardItems, None, None]:
    """Each shard's responses generated in batches of prompts of similar length, in sequence order."""
    for start, stop in bounds:
        keys = [(s // responses, s % responses) for s in range(start, stop)]
        items: list[dict[str, np.ndarray] | None] = [None] * len(keys)
        for batch in plan_batches(np.array([len(prompts.ids[p]) for p, _ in keys]), batch_size):
            started = time.perf_counter()
            decoded = loop.run([prompts.ids[keys[i][0]] for i in batch], [keys[i] for i in batch])
            stats.forward_seconds += time.perf_counter() - started
            for i, item, ids, prompt in zip(batch, decoded.items, decoded.ids, decoded.prompt_lengths):
                mask = np.zeros(len(ids), dtype=np.uint8)
                mask[prompt:] = 1
                items[i] = {**item, "input_ids": ids, "loss_mask": mask}
                stats.tokens += len(ids)
            stats.sequences += len(batch)
            progress.update(len(batch))
        yield ShardItems([item for item in items if item is not None])


def _finish(writer: CacheWriter, store: Store, dist: DistContext) -> Manifest:
    """The manifest once every rank is done (rank 0 of a torchrun joins the parts), as precompute finishes."""
    manifest = writer.finalize()
    dist.barrier()
    if dist.world > 1 and dist.is_main:
        return merge_parts(store)
    return manifest if dist.world == 1 else read_manifest(store)


def generations_path(out: str) -> Path:
    """Where the generated conversations go: ``OUT.generations.jsonl``, beside the cache folder (not inside it,
    whose every entry ``verify`` accounts for)."""
    path = Path(out).expanduser()
    return path.with_name(path.name + GENERATIONS_SUFFIX)


def write_generations(store: Store, out: str, prompts: Prompts, responses: int,
                      tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The generated conversations from the complete cache, one JSON line per sequence: its prompt and response
    numbers, the prompt's conversation with the reply added (chat data), the response's text, the whole text and
    its token ids (what plain SFT reads). Written whole (a temporary file renamed); None for a cache in object
    storage (read it with ``CacheReader`` there)."""
    if not store.is_local:
        return None
    reader = CacheReader(store)
    lines = []
    for s in range(len(reader)):
        row = reader.get(s, ["input_ids", "loss_mask"])
        ids, mask = row["input_ids"], row["loss_mask"].astype(bool)
        response = tokenizer.decode(ids[mask], skip_special_tokens=True)
        record: dict[str, Any] = {"prompt": s // responses, "response": s % responses,
                                  "text": tokenizer.decode(ids, skip_special_tokens=False),
                                  "response_text": response, "input_ids": ids.tolist(),
                                  "prompt_tokens": int((~mask).sum())}
        if prompts.messages is not None:
            record["messages"] = [*prompts.messages[s // responses], {"role": "assistant", "content": response}]
        lines.append(json.dumps(record, ensure_ascii=False))
    path = generations_path(out)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(scratch, path)
    return str(path)
