"""``PrecomputeOptions``: every setting of stage one, as frozen groups (engine, dataset, storage, targets).

Field names are the CLI contract (``pipeline.config`` turns ``top_k`` into ``--top-k``) and the YAML keys of
the ``precompute:`` section. ``validate()`` finds every problem it can without loading the model; problems
that need the model's config (a layer out of range, top-k above the vocabulary) are checked in
``stages.precompute.teacher`` right after the config is read, before any weights load.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kdcache.stages.common.engine_options import (
    PRECOMPUTE,
    EngineOptions,
    failed,
    looks_like_path,
)
from kdcache.stages.common.option_groups import assemble, option as _opt, option_group
from kdcache.stages.common.stream_options import STREAM_PREFIXES, StreamLayers
from kdcache.stages.targets.attention.flags import AttentionFlags
from kdcache.stages.targets.draft.draft_layers import is_draft_preset
from kdcache.stages.targets.logits.base import LogitFlags
from kdcache.storage import (
    DEFAULT_BACKEND,
    HiddenCodec,
    SpecError,
    backend_names,
    hidden_codec_of,
    hidden_codecs,
)

FEATURES = ("hidden", "attention", "cross_attention", "logits")  # cross_attention: encoder-decoder teachers only
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                   ".text": "text", ".arrow": "arrow"}
# How rows are cut from the documents (``rows.packing``); the flag's choices, so they live with the options.
PACKING = ("none", "documents", "concat")
# Batches queued on the device ahead of the host's taking them in (``stream``); ``parallel.memory`` counts their
# activations in each rank's memory.
IN_FLIGHT = 2


@dataclass(frozen=True)
class DatasetOptions:
    """The dataset, its columns, and how texts become rows of tokens."""

    data: str = field(metadata={"help": "dataset: a hub name, or local json/jsonl/csv/parquet/text file(s) or glob"})
    split: str = _opt("train", "dataset split")
    data_config: str | None = _opt(None, "dataset configuration name (hub datasets with several)")
    text_column: str = _opt("text", "column holding the text")
    messages_column: str | None = _opt(None, "column holding chat conversations (lists of {role, content}), "
                                             "rendered with the tokenizer's chat template; losses then train on "
                                             "the assistant's tokens only")
    chat_template: str | None = _opt(None, "Jinja chat template FILE for --messages-column (default: the "
                                           "tokenizer's own)", metavar="FILE")
    mask_column: str | None = _opt(None, "column of [start, end) character spans of --text-column that losses "
                                         "train on (default: every token)")
    max_length: int = _opt(512, "tokens per sequence: truncation length, or row length with --packing")
    packing: str = _opt("none", "pack documents into rows of --max-length tokens instead of truncating each: "
                                "'documents' keeps them apart (positions restart, attention stays inside each), "
                                "'concat' lets attention cross them; --packing alone means documents",
                        choices=list(PACKING), nargs="?", const="documents")
    max_sequences: int | None = _opt(None, "cap on the number of sequences (the first ones in data order)")
    source_column: str | None = _opt(None, "encoder-decoder: column holding the source text (default: --text-column)")
    target_column: str | None = _opt(None, "encoder-decoder: column holding the target text the decoder is "
                                           "teacher-forced on (required for encoder-decoder teachers)")
    max_target_length: int | None = _opt(None, "encoder-decoder: target tokens per sequence (default: --max-length)")
    streaming: bool = _opt(False, "read the dataset as a stream (files of any size, in file order; the same rows "
                                  "as without it)")
    tokenize_workers: int = _opt(0, "processes that tokenize the data once per cache (0: the host's cores)")
    record_text: bool = _opt(False, "record each sequence's text and its tokens' character ends in the cache "
                                    "(texts/), so a student with another tokenizer can train from it "
                                    "(kdcache train --cross-tokenizer); needs a fast tokenizer")

    def validate(self) -> list[str]:
        """Every problem of this group."""
        checks = [("max_length", self.max_length >= 1, "must be >= 1"),
                  ("max_sequences", self.max_sequences is None or self.max_sequences >= 1, "must be >= 1"),
                  ("max_target_length", self.max_target_length is None or self.max_target_length >= 1,
                   "must be >= 1"),
                  ("packing", self.packing in PACKING, f"expected one of {', '.join(PACKING)}"),
                  ("tokenize_workers", self.tokenize_workers >= 0, "must be >= 0 (0: the host's cores)")]
        problems = _data_problems(self.data) + failed(self, checks)
        if self.messages_column and self.mask_column:
            problems.append("mask_column: conversations (--messages-column) are masked by role; drop --mask-column")
        if self.chat_template and not self.messages_column:
            problems.append("chat_template: only used with --messages-column")
        elif self.chat_template and not Path(self.chat_template).expanduser().is_file():
            problems.append(f"chat_template: file {self.chat_template!r} does not exist")
        return problems


@dataclass(frozen=True)
class StorageOptions:
    """Where the cache goes, how it is encoded, and this job's part of it."""

    out: str = field(metadata={"help": "cache folder to create or resume"})
    format: str = _opt(DEFAULT_BACKEND, "storage backend", choices=backend_names())
    dtype: str = _opt("fp16", "storage dtype of float targets", choices=["fp16", "bf16"])
    codec: str | None = _opt(None, "numcodecs codec name (e.g. zstd, blosc-lz4) or JSON config; default blosc-lz4")
    bitround: int | None = _opt(None, "lossy: mantissa bits kept in activations (fp16 1..9, bf16 1..6)")
    hidden_codec: str | None = _opt(None, f"hidden-state codec: {hidden_codecs.listing()} (quantised on the teacher's "
                                          "device; pca8 with --hidden-rank = hidden size), or a JSON {name, "
                                          "configuration}; default: --dtype")
    hidden_rank: int | None = _opt(None, "project hidden states onto R principal directions per layer, fitted on the "
                                         "teacher's first tokens and stored in the cache, before --hidden-codec "
                                         "(a quantised one) codes them; 1 <= R < hidden size (R = hidden size: pca8)")
    sequences_per_shard: int = _opt(0, "sequences per cache shard, the unit of commit, resume and partition (0: as "
                                       "many as hold 32,768 tokens at the longest row, at most 256: rows of up to "
                                       "128 tokens get 256, 2,048-token rows 16, so that the writers start early)")
    num_shards: int = _opt(1, "job-array size: this many independent jobs share the cache")
    shard_index: int = _opt(0, "this job's index in the job array, 0..num_shards-1")

    @property
    def codec_config(self) -> str | dict[str, Any] | None:
        """The codec as ``storage`` takes it: a name, a config dict (from JSON), or None for the default."""
        if self.codec and self.codec.strip().startswith("{"):
            return json.loads(self.codec)
        return self.codec

    @cached_property
    def resolved_hidden_codec(self) -> HiddenCodec:
        """``--hidden-codec`` (a name or a JSON record) and ``--hidden-rank`` as the configured codec that stage one
        carries and the spec records: the one place stage one resolves it."""
        value = self.hidden_codec
        codec = hidden_codec_of(json.loads(value) if value and value.strip().startswith("{") else value, self.dtype)
        if self.hidden_rank is None:
            if codec.full_rank:
                raise SpecError(f"--hidden-codec {codec.name} codes full-rank PCA coefficients: give "
                                f"--hidden-rank d, the teacher's hidden size (e.g. 384 for MiniLM)")
            return codec
        if codec.float_dtype:
            raise SpecError(f"--hidden-rank {self.hidden_rank} codes the projection's coefficients with a quantised "
                            f"--hidden-codec ({hidden_codecs.listing(quantised=True)}), not {codec.name!r}")
        return codec.configure({**codec.record()["configuration"], "rank": self.hidden_rank})

    def validate(self) -> list[str]:
        """Every problem of this group."""
        checks = [("sequences_per_shard", self.sequences_per_shard >= 0, "must be >= 0 (0: sized by tokens)"),
                  ("num_shards", self.num_shards >= 1, "must be >= 1"),
                  ("shard_index", 0 <= self.shard_index < max(self.num_shards, 1),
                   f"must be in 0..num_shards-1 ({self.num_shards - 1})")]
        problems = _out_problems(self.out) + failed(self, checks) + self._codec_problems()
        limit = 9 if self.dtype == "fp16" else 6
        if self.bitround is not None and not 1 <= self.bitround <= limit:
            problems.append(f"bitround: got {self.bitround}, expected 1..{limit} for dtype {self.dtype}")
        return problems

    def _codec_problems(self) -> list[str]:
        from kdcache.storage import KdcacheError, resolve_codec  # imports numcodecs: only when checked

        problems = []
        for key, check in (("codec", lambda: resolve_codec(self.codec_config)),
                           ("hidden_codec", lambda: self.resolved_hidden_codec)):
            try:
                check()
            except json.JSONDecodeError as exc:
                problems.append(f"{key}: {getattr(self, key)!r} is not valid JSON: {exc}")
            except KdcacheError as exc:
                problems.append(f"{key}: {exc}")
            except (ValueError, TypeError) as exc:  # a configuration value of the wrong type (int("x"), int(None))
                problems.append(f"{key}: {getattr(self, key)!r} has a bad value: {exc}")
        return problems


@dataclass(frozen=True)
class TargetOptions:
    """What is cached: layers and attention blocks per token stream, heads, and the logit mode.

    ``layers`` and ``attention_layers`` hold a value per token stream (``stages.common.stream_options``): the
    unprefixed one for a one-stream teacher and as both stacks' default, ``encoder:`` / ``decoder:`` per stack,
    ``cross:`` for cross-attention blocks. ``layers`` always holds the unprefixed value ("all" unless given).
    """

    layers: StreamLayers = _opt(StreamLayers.parse("all"), "hidden layers to cache, HF numbering (0 = embeddings), "
                                "or 'all', or 'draft' (the layers an EAGLE-3 draft fuses, 2, N/2 and N-3, plus the "
                                "target's embedding and token counts in draft/); an encoder-decoder's stacks apart as "
                                "encoder:0,2 decoder:1,2 ('none': no layer of that stack; an unprefixed value covers "
                                "both)", nargs="+",
                                metavar="[STREAM:]LAYERS")
    features: tuple[str, ...] = _opt((), "targets to cache: hidden, attention, logits (default: hidden, plus "
                                         "logits when the teacher has a language-model head)")
    attention_layers: StreamLayers | None = _opt(None, "attention blocks to cache (1..N) or 'all', per stack as "
                                                       "--layers; cross:1,2 for cross-attention blocks (with feature "
                                                       "cross_attention; default the decoder's attention blocks); "
                                                       "default: --layers without 0", nargs="+",
                                                 metavar="[STREAM:]BLOCKS")
    heads: tuple[int, ...] | None = _opt(None, "attention heads to keep (0-based); default all")
    triangle: bool = _opt(False, "store only the causal triangle of attention maps (causal teachers)")
    # The families declare their flags: --attention-source in stages.targets.attention, --top-k, --logits... in
    # stages.targets.logits.
    attention: AttentionFlags = option_group(AttentionFlags)
    logit: LogitFlags = option_group(LogitFlags)

    def __post_init__(self) -> None:
        if "" not in self.layers.streams:  # only stacks given: the rest follow the default, "all"
            object.__setattr__(self, "layers", self.layers.with_stream("", "all"))

    def validate(self) -> list[str]:
        """Every problem of this group."""
        problems = []
        if any(f not in FEATURES for f in self.features):
            problems.append(f"features: got {list(self.features)}, expected a non-empty subset of {list(FEATURES)}")
        problems += _stream_problems("layers", self.layers, ("", "encoder", "decoder"))
        if self.attention_layers is not None:
            problems += _stream_problems("attention_layers", self.attention_layers, ("", *STREAM_PREFIXES))
        if self.heads is not None and (not self.heads or min(self.heads) < 0):
            problems.append(f"heads: got {list(self.heads)}, expected non-negative head indices")
        return problems + self.logit.problems(self.features)


@dataclass(frozen=True)
class PrecomputeOptions:
    """Options of ``kdcache precompute`` in groups (see ``docs/architecture.md`` for the cache they produce).

    Flags and YAML keys stay flat (``--top-k``, not ``--targets.top-k``): option names are unique across the
    groups (``stages.common.option_groups``).
    """

    engine: EngineOptions = field(metadata={"stage": PRECOMPUTE})  # the teacher's fields of the shared group
    dataset: DatasetOptions
    storage: StorageOptions
    targets: TargetOptions = field(default_factory=TargetOptions)

    def validate(self) -> list[str]:
        """Every problem found without loading the teacher, as one message each (empty when fine)."""
        return [p for group in (self.engine, self.dataset, self.storage, self.targets) for p in group.validate()]

    @classmethod
    def of(cls, **flat: object) -> PrecomputeOptions:
        """Build from flat keyword arguments as the flags name them (tests, benchmarks). No checks:
        ``pipeline.config.build`` is the checked way in."""
        return assemble(cls, flat)


def _stream_problems(name: str, value: StreamLayers, streams: tuple[str, ...]) -> list[str]:
    """Streams ``name`` does not take, and layer lists that do not read (a stack may keep 'none')."""
    problems = [f"{name}: got {str(value)!r}, stream {s!r} has no {name}; expected streams among "
                f"{[p for p in streams if p]}" for s in value.streams if s not in streams]
    for stream in (s for s in value.streams if s in streams):
        layers, label = value.get(stream), f"{stream}_{name}" if stream else name
        lowered = tuple(v.lower() for v in layers)
        if (stream and lowered == ("none",)) or lowered == ("all",) or (label == "layers" and is_draft_preset(layers)):
            continue
        if not layers or not all(re.fullmatch(r"-?\d+", v.strip()) for v in layers):
            problems.append(f"{label}: got {list(layers)}, expected 'all' or a list of layer numbers such as 2,4,6")
    return problems


def _data_problems(data: str) -> list[str]:
    expanded = os.path.expanduser(data)
    if os.path.exists(expanded) or glob.glob(expanded):
        return []
    if looks_like_path(data, data=True, data_extensions=tuple(DATA_EXTENSIONS)) or any(c in data for c in "*?["):
        return [f"data: no file or folder matches {data!r}"]
    return []


def _out_problems(out: str) -> list[str]:
    path = Path(out).expanduser()
    if path.exists():
        if not path.is_dir():
            return [f"out: {out!r} exists and is not a folder"]
        return [] if os.access(path, os.W_OK) else [f"out: folder {out!r} is not writable"]
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return [f"out: cannot create {out!r}: {str(parent)!r} is not a folder"]
    if not os.access(parent, os.W_OK):
        return [f"out: cannot create {out!r}: {str(parent)!r} is not writable"]
    return []
