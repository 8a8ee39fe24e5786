"""Stage one end to end: ``run_precompute(options) -> summary``, the same for every teacher.

Order of work, cheapest checks first: config and layer checks, tokenizer and data, then the weights; then the
cache is opened (which refuses a different cache and a second writer of the same part), committed shards are
skipped, and the rest are computed shard by shard with a background writer committing behind the forward.
What depends on the teacher's family (its token streams, its layers, how it is run) is the adapter's
(``adapters.py``).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kdcache.stages.common import logit_kinds
from kdcache.stages.common.cache_texts import save_texts
from kdcache.stages.common.device_codecs import Projection
from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.common.teacher_head import export_head
from kdcache.stages.precompute.adapters import Capture, TeacherAdapter, adapter_for
from kdcache.stages.precompute.batching import Partition
from kdcache.stages.precompute.commit import check_out_folder, commit_behind, open_writer
from kdcache.stages.precompute.data import TokenStreams
from kdcache.stages.precompute.distributed import DistContext
from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.estimate import check_room, estimate, lower_bound_bytes
from kdcache.stages.precompute.options import PrecomputeOptions
from kdcache.stages.precompute.parallel import Grid, Layout
from kdcache.stages.precompute.parallel_run import check_parallel, group_todo, lend_share, memory_only
from kdcache.stages.precompute.progress import Progress, RunStats, format_summary, summarize
from kdcache.stages.precompute.projection_fit import check_rank, fit_bases, fit_bounds, stored_projection
from kdcache.stages.precompute.qk_capture import with_score_rules
from kdcache.stages.precompute.stream import compute_shard, stream_shards
from kdcache.stages.precompute.targets import Targets, build_spec, resolve_targets, settings_fingerprint
from kdcache.stages.precompute.teacher import (
    Teacher,
    has_lm_head,
    load_tokenizer,
    pick_device,
    read_config,
    save_tokenizer,
    teacher_files_fingerprint,
)
from kdcache.stages.precompute.transfer import ShardItems
from kdcache.storage import KdcacheError, Store, projected

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from kdcache.storage import CacheSpec, Manifest


def run_precompute(options: PrecomputeOptions) -> dict[str, Any]:
    """Compute and cache the teacher's targets for this process's part of the data.

    Under torchrun (RANK / WORLD_SIZE set) every rank runs this; rank 0 merges the parts after a barrier.

    Args:
        options: validated options (``pipeline.config.build`` runs ``options.validate()`` once, with the type
            checks, so that a user sees every problem together); ``PrecomputeOptions.of`` builds unchecked ones.

    Returns:
        the summary (see ``stages.precompute.progress.summarize``): status, tokens, bytes per token per target,
        wall time and throughput.

    Raises:
        KdcacheError: any bad input (``PrecomputeError``) or cache problem (mismatch, lock, overflow).
    """
    import torch

    torch.manual_seed(options.engine.seed)
    dist = DistContext.from_env(gpu_collectives=Layout.parse(options.engine.teacher_parallel).tensor > 1)
    try:
        with _quiet_libraries(not (options.engine.progress and dist.is_main)):
            return _run(options, dist)
    finally:
        dist.close()


@contextmanager
def _quiet_libraries(quiet: bool) -> Iterator[None]:
    """Hide the datasets/transformers loading bars on other ranks and with --no-progress."""
    import datasets
    import transformers

    if not quiet:
        yield
        return
    # Put back what was there: enabling bars that a log (pipeline.quiet) turned off would only warn.
    was = datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            datasets.enable_progress_bars()
        if was[1]:
            transformers.utils.logging.enable_progress_bar()


def _run(options: PrecomputeOptions, dist: DistContext) -> dict[str, Any]:
    st = options.storage
    stats = RunStats()
    config = read_config(options)
    options = with_default_features(options, config)
    adapter = adapter_for(config)
    adapter.check_options(options, config)
    targets = resolve_targets(options, config)
    check_rank(options.storage.resolved_hidden_codec, config)
    tokenizer = load_tokenizer(options)
    store = check_out_folder(st.out)  # before the rows are written there; the one store of the output below
    data = adapter.load_data(options, tokenizer)
    check_positions(config, data)
    rows = {"built": data.built, "build_seconds": data.meta.get("build_seconds")}
    if not options.engine.estimate:
        finished = finished_cache(store, options, config, targets, tokenizer, data)
        if finished is not None:  # nothing to compute: don't pay for loading the weights
            return summarize(stats, finished, finished.spec.num_shards, st.out, {"reused": True, "rows": rows})
        check_room(st.out, lower_bound_bytes(build_spec(options, targets, data), config, data,
                                             targets.attention_source))
    layout = Layout.parse(options.engine.teacher_parallel)
    device = pick_device(options.engine.device, dist.local_rank * (layout.size if layout.kind == "layers" else 1))
    memory = check_parallel(options, config, targets, layout, device)
    if options.engine.estimate and memory_only(options, config, layout, dist.world, device):
        return {"status": "memory", "out": st.out, "memory": memory}
    grid = Grid.of(layout, dist.rank, dist.world)
    teacher = adapter.load_teacher(options, config, targets, tokenizer, device)
    targets = with_score_rules(with_output_vocab(targets, teacher, options), teacher.model, data, device)
    check_token_ids(teacher, data)
    spec = build_spec(options, targets, data)
    if options.engine.estimate:
        projection = _projection(options, adapter, teacher, targets, data, spec, into=None)
        return {**run_estimate(options, adapter.capture(teacher, targets, options, projection), teacher, targets,
                               data, spec), "memory": memory}
    part = Partition.of(st.shard_index, st.num_shards, grid.group, grid.groups)
    group = dist.groups_of(grid.tensor)
    fingerprints = build_fingerprints(options, teacher, targets, data)
    writer = open_writer(store, spec, fingerprints, part) if grid.writes else None
    # Before any shard; under torchrun the main rank fits and stores a rank codec's basis while the others wait.
    waits = spec.hidden_codec.rank is not None
    if waits and not dist.is_main:
        dist.barrier()
    projection = _projection(options, adapter, teacher, targets, data, spec, into=store)
    if waits and dist.is_main:
        dist.barrier()
    mine = part.shards(spec.num_shards)
    with writer or nullcontext(), adapter.capture(teacher, targets, options, projection) as capture:
        def stream(bounds: list[tuple[int, int]], progress: Progress) -> Generator[ShardItems, None, None]:
            return stream_shards(capture, teacher, data, bounds, options, stats, progress)

        # A tensor-parallel group runs its leader's list of shards in lockstep; only the leader writes them.
        todo = group_todo([k for k in mine if k not in writer.committed_shards()] if writer else None, group, grid)
        if writer is None:
            lend_share(spec, todo, stream, stats)
        else:
            save_tokenizer(tokenizer, store)
            if data.texts and dist.is_main:  # --record-text: before any shard, like the tokenizer
                save_texts(store, data.texts["text"], data.texts["text_end"])
            if logit_kinds.uses_head(targets.logits) and dist.is_main:
                export_head(teacher.model, store, targets.streams[""].depth)
            commit_behind(spec, todo, writer, stats, stream, show_progress=options.engine.progress and dist.is_main,
                          queue_size=options.engine.queue_size, workers=options.engine.writers)
    manifest = writer.finalize() if writer else None  # the last part to finish turns the manifest "complete"
    dist.barrier()
    if manifest is None:
        from kdcache.storage import read_manifest

        manifest = read_manifest(store)
    if dist.world > 1 and dist.is_main:
        from kdcache.storage import merge_parts

        manifest = merge_parts(store)
    extra = {"part": [part.index, part.count], "device": str(teacher.device), "teacher_parallel": str(layout),
             "attn_implementation": teacher.attn_implementation,
             "dropped_rows": {"empty": data.dropped_empty, "untrained": data.dropped_untrained}, "rows": rows}
    return _run_totals(summarize(stats, manifest, len(mine) - len(todo), st.out, extra), dist, grid.writes)


def _run_totals(summary: dict[str, Any], dist: DistContext, writes: bool) -> dict[str, Any]:
    """This run's counts over every writing rank (each group's leader), not rank 0's alone: what it printed as
    "6 shard(s) written" of 12 for two groups. Rates stay rank 0's clock over the total."""
    keys = ("shards_written", "shards_skipped", "tokens", "sequences", "bytes_written")
    totals = dist.sum([float(summary[k]) if writes else 0.0 for k in keys])
    summary.update({k: int(v) for k, v in zip(keys, totals)})
    compute = summary["compute_seconds"]
    summary["tokens_per_second"] = round(summary["tokens"] / compute, 1) if compute > 0 else 0.0
    return summary


def _projection(options: PrecomputeOptions, adapter: TeacherAdapter, teacher: Teacher, targets: Targets,
                data: TokenStreams, spec: CacheSpec, *, into: Store | None) -> Projection | None:
    """A rank codec's bases (``projection_fit``): the cache's stored ones, else fitted on the leading sequences
    (and stored first in the output store ``into``, unless None); None without a rank."""
    codec, rank = spec.hidden_codec, spec.hidden_codec.rank
    if rank is None:
        return None
    names = [n for n in spec.sequence_names() if projected(codec, n)]
    first = next(iter(data.ids.values()))
    bounds = fit_bounds([len(s) for s in first], 4 * options.engine.batch_size)

    def fit() -> dict[str, Any]:
        stats = RunStats()
        with adapter.capture(teacher, targets, options, Projection(fitting=True)) as capture:
            with closing(stream_shards(capture, teacher, data, bounds, options, stats,
                                       Progress(0, False, stats))) as shards:  # its helper thread ends here
                return fit_bases(shards, names, rank, teacher.device)

    if into is None:
        return Projection.from_arrays(fit())
    return stored_projection(into, codec, names, fit)


def check_positions(config: PretrainedConfig, data: TokenStreams) -> None:
    """Refuse sequences longer than the teacher's position table (they would index past it)."""
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(data.longest(s) for s in data.streams)
    if isinstance(limit, int) and longest > limit:
        flags = "--max-length / --max-target-length" if len(data.streams) > 1 else "--max-length"
        raise PrecomputeError(f"max_length: sequences reach {longest} tokens, but the teacher has only {limit} "
                              f"positions; lower {flags} to {limit} or less")


def with_default_features(options: PrecomputeOptions, config: PretrainedConfig) -> PrecomputeOptions:
    """Without ``--features``: hidden states, plus logits when the teacher has a language-model head (an
    encoder such as MiniLM has none, so it caches hidden states only)."""
    if options.targets.features:
        return options
    if options.targets.topk_values == "logprob" and not has_lm_head(config):
        raise PrecomputeError(f"topk_values: teacher {options.engine.teacher!r} has no language-model head, so no "
                              f"logits are cached and --topk-values logprob has nothing to store; drop it")
    features = ("hidden", "logits") if has_lm_head(config) else ("hidden",)
    return replace(options, targets=replace(options.targets, features=features))


def check_token_ids(teacher: Teacher, data: TokenStreams) -> None:
    """Refuse token ids the teacher's embedding table does not have (a tokenizer from another model)."""
    table: int = teacher.model.get_input_embeddings().num_embeddings  # type: ignore[assignment]  # an nn.Embedding
    top = data.max_id
    if top >= table:
        raise PrecomputeError(f"the tokenizer produced token id {top}, but the teacher's embedding table has only "
                              f"{table} rows; the tokenizer does not belong to this teacher")


def with_output_vocab(targets: Targets, teacher: Teacher, options: PrecomputeOptions) -> Targets:
    """Use the LM head's real output size as the vocabulary (checkpoints may pad it beyond config.vocab_size)."""
    head = teacher.model.get_output_embeddings()
    if targets.logits is None or head is None:
        return targets
    vocab = int(head.weight.shape[0])
    kind = logit_kinds.get(targets.logits)
    for problem in kind.teacher_problems(options.engine.teacher, "" in targets.streams, targets.causal, vocab,
                                         options.targets.top_k):
        raise PrecomputeError(problem)
    return replace(targets, vocab_size=vocab)


def finished_cache(store: Store, options: PrecomputeOptions, config: PretrainedConfig, targets: Targets,
                   tokenizer: PreTrainedTokenizerBase, data: TokenStreams) -> Manifest | None:
    """The manifest of a complete cache in the output ``store`` that this run would reproduce, else None.

    Checked before the weights load, from what is known without them (weight-file hashes, config, tokenizer,
    data, settings), so rerunning a finished precompute, or ``kdcache run`` over its cache, never loads the
    teacher. What only the loaded model tells (runtime dtype, attention kernel) is left to the writer's full
    check on a real run.
    """
    from kdcache.storage import CacheReader, compare_fingerprints

    teacher_fp = teacher_files_fingerprint(options, config)
    if teacher_fp is None or store.size("manifest.json") is None:
        return None
    try:
        reader = CacheReader(store)
    except KdcacheError:  # partial, corrupt or foreign: the normal path resumes it or explains the problem
        return None
    expected = {"teacher": teacher_fp, "tokenizer": tokenizer_fingerprint(tokenizer), "data": data.fingerprint,
                "settings": settings_fingerprint(options, targets)}
    if compare_fingerprints(reader.fingerprints, expected):
        return None  # a different cache: the writer explains every difference (spec included) and refuses
    return reader.manifest


def build_fingerprints(options: PrecomputeOptions, teacher: Teacher, targets: Targets,
                       data: TokenStreams) -> dict[str, Any]:
    """Teacher, tokenizer, data and settings fingerprints; identical for every rank and every rerun."""
    settings = {**settings_fingerprint(options, targets),
                "teacher_dtype": str(teacher.model.dtype).replace("torch.", ""),
                "attn_implementation": teacher.attn_implementation}
    return {"teacher": teacher.fingerprint, "tokenizer": tokenizer_fingerprint(teacher.tokenizer),
            "data": data.fingerprint, "settings": settings}


def run_estimate(options: PrecomputeOptions, capturing: AbstractContextManager[Capture], teacher: Teacher,
                 targets: Targets, data: TokenStreams, spec: CacheSpec) -> dict[str, Any]:
    """``--estimate``: the teacher over the first shards, written to a scratch cache (``estimate.estimate``)."""
    stats = RunStats()
    with capturing as capture:
        progress = Progress(0, False, stats)
        return estimate(spec, data, options.storage.out,
                        lambda bounds: compute_shard(capture, teacher, data, bounds, options, stats, progress),
                        build_fingerprints(options, teacher, targets, data))


def merge_cache(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Join every part's committed shards into ``manifest.json`` (``kdcache merge``).

    Returns:
        ``{"out", "status", "committed_shards", "num_shards", "num_tokens"}``.
    """
    from kdcache.storage import merge_parts, open_store

    store = open_store(path)
    if store.size("manifest.json") is None:
        raise PrecomputeError(f"merge: {str(path)!r} holds no kdcache cache (no manifest.json)")
    manifest = merge_parts(store)
    return {"out": str(path), "status": manifest.status, "committed_shards": len(manifest.shards),
            "num_shards": manifest.spec.num_shards, "num_tokens": manifest.num_tokens}


__all__ = ["run_precompute", "merge_cache", "format_summary"]
