"""Stage one end to end: ``run_precompute(options) -> summary``, the same for every teacher.

Order of work, cheapest checks first: config and layer checks, tokenizer and data, then the weights; then the
cache is opened (which refuses a different cache and a second writer of the same part), committed shards are
skipped, and the rest are computed shard by shard with a background writer committing behind the forward.
What depends on the teacher's family (its token streams, its layers, how it is run) is the adapter's
(``adapters.py``).

The runner is the edge of stage one: it reads the options, resolves them once into the targets and the plan
(``core.plan``), and hands the parts below the plan's objects, never the options.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import datasets
import torch
import transformers

from kdcache.stages.common.cache_texts import save_texts
from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.precompute.adapters import TeacherAdapter, adapter_for
from kdcache.stages.precompute.cache_spec import build_spec
from kdcache.stages.precompute.capture.compiled import say_compile_cost
from kdcache.stages.precompute.capture.qk_capture import with_score_rules
from kdcache.stages.precompute.capture.transfer import ShardItems
from kdcache.stages.precompute.commit import check_out_folder, commit_behind, open_writer
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan, TeacherSetup
from kdcache.stages.precompute.core.progress import Progress, RunStats, summarize
from kdcache.stages.precompute.core.targets import Targets, resolve_targets, settings_fingerprint
from kdcache.stages.precompute.core.teacher_id import Teacher, teacher_files_fingerprint
from kdcache.stages.precompute.estimate import check_room, estimate, lower_bound_bytes, sample_shards
from kdcache.stages.precompute.parallel.distributed import DistContext
from kdcache.stages.precompute.parallel.layouts import Grid, Layout
from kdcache.stages.precompute.parallel.parallel_run import (
    check_parallel,
    check_tensor_plan,
    group_todo,
    lend_share,
    memory_only,
)
from kdcache.stages.precompute.projection_fit import check_rank, fit_bases, fit_bounds, stored_projection
from kdcache.stages.precompute.rows.batching import Partition
from kdcache.stages.precompute.rows.data import TokenStreams
from kdcache.stages.precompute.stream import compute_shard, stream_shards
from kdcache.stages.precompute.teacher import (
    check_positions,
    check_token_ids,
    load_tokenizer,
    pick_device,
    read_config,
    save_tokenizer,
    with_default_features,
    with_output_vocab,
)
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.draft.draft_inputs import (
    draft_layers,
    export_draft_inputs,
    is_draft_preset,
    target_embedding,
    token_counts,
)
from kdcache.stages.targets.hidden.device_codecs import Projection
from kdcache.stages.targets.logits.teacher_head import export_head
from kdcache.storage import (
    CacheReader,
    KdcacheError,
    Store,
    compare_fingerprints,
    merge_parts,
    open_store,
    projected,
    read_manifest,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from kdcache.storage import CacheSpec, CacheWriter, Manifest


def run_precompute(options: PrecomputeOptions) -> dict[str, Any]:
    """Compute and cache the teacher's targets for this process's part of the data.

    Under torchrun (RANK / WORLD_SIZE set) every rank runs this; rank 0 merges the parts after a barrier.

    Args:
        options: validated options (``pipeline.config.build`` runs ``options.validate()`` once, with the type
            checks, so that a user sees every problem together); ``PrecomputeOptions.of`` builds unchecked ones.

    Returns:
        the summary (see ``stages.precompute.core.progress.summarize``): status, tokens, bytes per token per target,
        wall time and throughput.

    Raises:
        KdcacheError: any bad input (``PrecomputeError``) or cache problem (mismatch, lock, overflow).
    """
    torch.manual_seed(options.engine.seed)
    layout = Layout.parse(options.engine.teacher_parallel)
    if layout.tensor > 1:  # before the process group: every rank refuses on its own, none waits in the group
        check_tensor_plan(layout, read_config(TeacherSetup.of(options.engine)))
    dist = DistContext.from_env(gpu_collectives=layout.tensor > 1)
    try:
        with _quiet_libraries(not (options.engine.progress and dist.is_main)):
            return _run(options, dist, layout)
    finally:
        dist.close()


@contextmanager
def _quiet_libraries(quiet: bool) -> Iterator[None]:
    """Hide the datasets/transformers loading bars on other ranks and with --no-progress."""
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


@dataclass(frozen=True)
class _Prepared:
    """Stage one before the weights load: the options with the teacher's defaults and the plan made of them, and
    what was read and checked without the weights (config, targets, tokenizer, the output store, the rows)."""

    options: PrecomputeOptions
    plan: PrecomputePlan
    config: PretrainedConfig
    adapter: TeacherAdapter
    targets: Targets
    tokenizer: PreTrainedTokenizerBase
    store: Store
    data: TokenStreams

    @property
    def rows(self) -> dict[str, Any]:
        """How the rows came about, for the summary."""
        return {"built": self.data.built, "build_seconds": self.data.meta.get("build_seconds")}


@dataclass(frozen=True)
class _Loaded:
    """The teacher on its device(s) in its place of the rank grid, its targets as the weights tell them, and the
    spec of the cache it writes."""

    layout: Layout
    grid: Grid
    teacher: Teacher
    targets: Targets
    spec: CacheSpec


def _run(options: PrecomputeOptions, dist: DistContext, layout: Layout) -> dict[str, Any]:
    """The cheap checks, then a finished cache's summary, a memory estimate, a size estimate, or the run."""
    stats = RunStats()
    ready = _prepare(options)
    engine = ready.options.engine
    if not engine.estimate and (reused := _reused(ready, stats)) is not None:
        return reused  # nothing to compute: the weights are never loaded
    device = pick_device(engine.device, dist.local_rank * (layout.size if layout.kind == "layers" else 1))
    memory = check_parallel(ready.plan, ready.config, ready.targets, layout, device)
    if engine.estimate and memory_only(ready.plan, ready.config, layout, dist.world, device):
        return {"status": "memory", "out": ready.options.storage.out, "memory": memory}
    loaded = _load(ready, layout, Grid.of(layout, dist.rank, dist.world), device)
    if engine.compile_teacher and dist.is_main:  # what compiling will cost here, said before it is paid
        shards = sample_shards(loaded.spec) if engine.estimate else range(loaded.spec.num_shards)
        say_compile_cost(device, ready.data, loaded.spec, shards, engine.batch_size)
    if engine.estimate:
        return {**_estimate(ready, loaded), "memory": memory}
    return _write(ready, loaded, dist, stats)


def _prepare(options: PrecomputeOptions) -> _Prepared:
    """Everything checked before the weights load, cheapest first; the plan once the options are complete."""
    config = read_config(TeacherSetup.of(options.engine))
    options = with_default_features(options, config)
    adapter = adapter_for(config)
    adapter.check_options(options, config)
    targets = resolve_targets(options, config)
    check_rank(options.storage.resolved_hidden_codec, config)
    plan = PrecomputePlan.of(options)
    tokenizer = load_tokenizer(plan.teacher)
    store = check_out_folder(plan.write.out)  # before the rows are written there; the one store of the output
    data = adapter.load_data(plan.rows, tokenizer)
    check_positions(config, data)
    return _Prepared(options, plan, config, adapter, targets, tokenizer, store, data)


def _reused(ready: _Prepared, stats: RunStats) -> dict[str, Any] | None:
    """The summary of a complete cache this run would reproduce; else None, once the destination is known to hold
    at least the cache's lower bound of bytes."""
    write, targets, data = ready.plan.write, ready.targets, ready.data
    finished = finished_cache(ready)
    if finished is not None:
        return summarize(stats, finished, finished.spec.num_shards, write.out, {"reused": True, "rows": ready.rows})
    spec = build_spec(write, targets, data)
    check_room(write.out, lower_bound_bytes(spec, ready.config, data, targets.attention.source))
    return None


def _load(ready: _Prepared, layout: Layout, grid: Grid, device: torch.device) -> _Loaded:
    """The weights on ``device``, and what they tell: the output vocabulary, the score rules, the token ids."""
    plan = ready.plan
    teacher = ready.adapter.load_teacher(plan.teacher, ready.config, ready.targets, ready.tokenizer, device)
    targets = with_score_rules(with_output_vocab(ready.targets, teacher, plan.teacher), teacher.model, ready.data,
                               device)
    check_token_ids(teacher, ready.data)
    return _Loaded(layout, grid, teacher, targets, build_spec(plan.write, targets, ready.data))


def _estimate(ready: _Prepared, loaded: _Loaded) -> dict[str, Any]:
    """``--estimate``: the teacher over the first shards, written to a scratch cache (``estimate.estimate``; a rank
    codec fits its basis there too)."""
    plan, teacher, targets, data, stats = ready.plan, loaded.teacher, loaded.targets, ready.data, RunStats()
    projection = _projection(ready, loaded, dist=None)  # --estimate: fitted, not stored
    with ready.adapter.capture(teacher, targets, plan, projection) as capture:
        progress = Progress(0, False, stats)
        return estimate(loaded.spec, data, plan.write.out,
                        lambda bounds: compute_shard(capture, teacher, data, bounds, plan.batch.batch_size, stats,
                                                     progress),
                        build_fingerprints(ready.options, teacher, targets, data))


def _write(ready: _Prepared, loaded: _Loaded, dist: DistContext, stats: RunStats) -> dict[str, Any]:
    """This part's shards computed and committed (or lent to the group's leader), then the manifest finished."""
    st, grid = ready.plan.write, loaded.grid
    part = Partition.of(st.shard_index, st.num_shards, grid.group, grid.groups)
    group = dist.groups_of(grid.tensor)
    fingerprints = build_fingerprints(ready.options, loaded.teacher, loaded.targets, ready.data)
    writer = open_writer(ready.store, loaded.spec, fingerprints, part) if grid.writes else None
    projection = _projection(ready, loaded, dist)
    mine = part.shards(loaded.spec.num_shards)
    todo = _compute(ready, loaded, writer, mine, group, dist, stats, projection)
    manifest = _finish(writer, ready.store, dist)
    extra = {"part": [part.index, part.count], "device": str(loaded.teacher.device),
             "teacher_parallel": str(loaded.layout), "attn_implementation": loaded.teacher.attn_implementation,
             "dropped_rows": {"empty": ready.data.dropped_empty, "untrained": ready.data.dropped_untrained},
             "rows": ready.rows}
    return _run_totals(summarize(stats, manifest, len(mine) - len(todo), st.out, extra), dist, grid.writes)


def _compute(ready: _Prepared, loaded: _Loaded, writer: CacheWriter | None, mine: list[int],
             group: ProcessGroup | None, dist: DistContext, stats: RunStats,
             projection: Projection | None) -> list[int]:
    """Run the teacher over this part's shards not yet committed, committing behind it (a writing rank) or
    lending its share to the group's leader; returns the shards it ran."""
    plan, teacher, spec = ready.plan, loaded.teacher, loaded.spec
    with writer or nullcontext(), ready.adapter.capture(teacher, loaded.targets, plan, projection) as capture:
        def stream(bounds: list[tuple[int, int]], progress: Progress) -> Generator[ShardItems, None, None]:
            return stream_shards(capture, teacher, ready.data, bounds, plan.batch.batch_size, stats, progress)

        # A tensor-parallel group runs its leader's list of shards in lockstep; only the leader writes them.
        todo = group_todo([k for k in mine if k not in writer.committed_shards()] if writer else None, group,
                          loaded.grid)
        if writer is None:
            lend_share(spec, todo, stream, stats)
            return todo
        _save_beside_shards(ready, loaded, dist)
        engine = ready.options.engine
        commit_behind(spec, todo, writer, stats, stream, show_progress=engine.progress and dist.is_main,
                      queue_size=engine.queue_size, workers=engine.writers, processes=engine.writer_processes)
    return todo


def _save_beside_shards(ready: _Prepared, loaded: _Loaded, dist: DistContext) -> None:
    """The tokenizer, and on the main rank the texts (``--record-text``), a head cache's LM head and a draft
    cache's embedding and token counts (``--layers draft``): before any shard, so that a killed run leaves them
    with its first shard."""
    save_tokenizer(ready.tokenizer, ready.store)
    if ready.data.texts and dist.is_main:
        save_texts(ready.store, ready.data.texts["text"], ready.data.texts["text_end"])
    if logit_kinds.uses_head(loaded.targets.logit.name) and dist.is_main:
        export_head(loaded.teacher.model, ready.store, loaded.targets.streams[""].depth)
    if is_draft_preset(ready.options.targets.layers.get("")) and dist.is_main:
        vocab = int(target_embedding(loaded.teacher.model).shape[0])
        layers = draft_layers(loaded.targets.streams[""].depth)
        export_draft_inputs(loaded.teacher.model, ready.store, layers, token_counts(ready.data.ids[""], vocab))


def _finish(writer: CacheWriter | None, store: Store, dist: DistContext) -> Manifest:
    """The manifest once every rank is done: the last part to finish turns it "complete"; rank 0 of a torchrun
    joins the ranks' parts."""
    manifest = writer.finalize() if writer else None
    dist.barrier()
    if manifest is None:
        manifest = read_manifest(store)
    if dist.world > 1 and dist.is_main:
        manifest = merge_parts(store)
    return manifest


def _run_totals(summary: dict[str, Any], dist: DistContext, writes: bool) -> dict[str, Any]:
    """This run's counts over every writing rank (each group's leader), not rank 0's alone: what it printed as
    "6 shard(s) written" of 12 for two groups. Rates stay rank 0's clock over the total."""
    keys = ("shards_written", "shards_skipped", "tokens", "sequences", "bytes_written")
    totals = dist.sum([float(summary[k]) if writes else 0.0 for k in keys])
    summary.update({k: int(v) for k, v in zip(keys, totals)})
    compute = summary["compute_seconds"]
    summary["tokens_per_second"] = round(summary["tokens"] / compute, 1) if compute > 0 else 0.0
    return summary


def _projection(ready: _Prepared, loaded: _Loaded, dist: DistContext | None) -> Projection | None:
    """A rank codec's bases (``projection_fit``), before any shard: the cache's stored ones, else fitted on the
    leading sequences and stored first in the output store, where under torchrun the main rank fits and stores
    them while the others wait, then read them; ``dist`` None (``--estimate``): fitted, not stored. None without a
    rank."""
    codec = loaded.spec.hidden_codec
    rank = codec.rank
    teacher = loaded.teacher
    data = ready.data
    if rank is None:
        return None
    names = [n for n in loaded.spec.sequence_names() if projected(codec, n)]
    first = next(iter(data.ids.values()))
    batch_size = ready.plan.batch.batch_size
    bounds = fit_bounds([len(s) for s in first], 4 * batch_size)

    def fit() -> dict[str, Any]:
        stats = RunStats()
        with ready.adapter.capture(teacher, loaded.targets, ready.plan, Projection(fitting=True)) as capture:
            with closing(stream_shards(capture, teacher, data, bounds, batch_size, stats,
                                       Progress(0, False, stats))) as shards:  # its helper thread ends here
                return fit_bases(shards, names, rank, teacher.device)

    if dist is None:
        return Projection.from_arrays(fit())
    if not dist.is_main:
        dist.barrier()
    projection = stored_projection(ready.store, rank, names, fit)
    if dist.is_main:
        dist.barrier()
    return projection


def finished_cache(ready: _Prepared) -> Manifest | None:
    """The manifest of a complete cache in the output store that this run would reproduce, else None.

    Checked before the weights load, from what is known without them (weight-file hashes, config, tokenizer,
    data, settings), so rerunning a finished precompute, or ``kdcache run`` over its cache, never loads the
    teacher. What only the loaded model tells (runtime dtype, attention kernel) is left to the writer's full
    check on a real run.
    """
    teacher_fp = teacher_files_fingerprint(ready.plan.teacher, ready.config)
    if teacher_fp is None or ready.store.size("manifest.json") is None:
        return None
    try:
        reader = CacheReader(ready.store)
    except KdcacheError:  # partial, corrupt or foreign: the normal path resumes it or explains the problem
        return None
    expected = {"teacher": teacher_fp, "tokenizer": tokenizer_fingerprint(ready.tokenizer),
                "data": ready.data.fingerprint, "settings": settings_fingerprint(ready.options, ready.targets)}
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


def merge_cache(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Join every part's committed shards into ``manifest.json`` (``kdcache merge``).

    Returns:
        ``{"out", "status", "committed_shards", "num_shards", "num_tokens"}``.
    """
    store = open_store(path)
    if store.size("manifest.json") is None:
        raise PrecomputeError(f"merge: {str(path)!r} holds no kdcache cache (no manifest.json)")
    manifest = merge_parts(store)
    return {"out": str(path), "status": manifest.status, "committed_shards": len(manifest.shards),
            "num_shards": manifest.spec.num_shards, "num_tokens": manifest.num_tokens}


__all__ = ["run_precompute", "merge_cache"]
