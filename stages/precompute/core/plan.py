"""``PrecomputePlan``: what stage one does, as the objects its parts take, built once from the options.

The options (``core.options``) are the CLI's and the YAML's face: flat names, strings, groups that follow the
flags. Only the edge reads them: the runner, the target resolution (``core.targets``), the family's and the
teacher's checks of the request (``adapters.check_options``, ``teacher.with_default_features``), and this
module, which turns them into frozen parts, each handed to the code that needs it and nothing more:

* ``TeacherSetup``: which teacher, how it loads and where (``teacher``, ``core.teacher_id``, ``parallel``);
* ``RowSetup``: the dataset and how its texts become rows (``rows``), with the teacher whose tokenizer reads them;
* ``WriteSetup``: how the targets are stored (``cache_spec``, ``capture``), the hidden codec as its object;
* ``BatchSetup``: how the teacher is run (batch size, logit chunks, compiling), for ``stream``, ``capture`` and
  ``parallel.memory``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kdcache.stages.common.engine_options import EngineOptions
    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.storage import HiddenCodec


@dataclass(frozen=True)
class TeacherSetup:
    """The teacher and how it is loaded: path or hub id, revision, run dtype, seed, and its placement."""

    name: str
    revision: str | None
    dtype: str  # "auto", "fp32", "fp16" or "bf16": what the weights run in
    seed: int
    parallel: str  # --teacher-parallel, which ``parallel.Layout`` reads (a floor above this one)
    device_memory: str | None  # a memory size per rank given by hand, else None (the device's own)

    @classmethod
    def of(cls, engine: EngineOptions) -> TeacherSetup:
        """The engine group's teacher fields (before the rest of the plan: the config is read with these)."""
        return cls(engine.teacher, engine.revision, engine.teacher_dtype, engine.seed, engine.teacher_parallel,
                   engine.device_memory)


@dataclass(frozen=True)
class RowSetup:
    """The dataset and how its texts become the cache's rows (the fields of ``DatasetOptions``, in its order, so
    that the row table's key stays what it was), the teacher whose tokenizer reads them, and ``scratch``: rows
    kept only while the run lasts (``--estimate``)."""

    data: str
    split: str
    data_config: str | None
    text_column: str
    messages_column: str | None
    chat_template: str | None
    mask_column: str | None
    max_length: int
    packing: str
    max_sequences: int | None
    source_column: str | None
    target_column: str | None
    max_target_length: int | None
    streaming: bool
    tokenize_workers: int
    record_text: bool
    teacher: str = ""
    scratch: bool = False

    # Not what the rows are: how they are read and built, and where they are kept.
    NOT_KEYED = ("streaming", "tokenize_workers", "chat_template", "teacher", "scratch")

    @property
    def source(self) -> str:
        """The source column of source/target pairs: ``--source-column``, else ``--text-column``."""
        return self.source_column or self.text_column

    def key(self) -> dict[str, Any]:
        """The dataset's part of the row table's key (``rows.row_build.row_key``)."""
        return {k: v for k, v in asdict(self).items() if k not in self.NOT_KEYED}


@dataclass(frozen=True)
class WriteSetup:
    """How the targets are stored: backend, dtype, codecs (the hidden codec resolved), the attention triangle,
    shard size, and this job's part of the job array."""

    out: str
    backend: str
    dtype: str
    codec: str | dict[str, Any] | None
    bitround: int | None
    hidden_codec: HiddenCodec
    triangle: bool
    sequences_per_shard: int
    shard_index: int
    num_shards: int


@dataclass(frozen=True)
class BatchSetup:
    """How the teacher is run over the rows: sequences per forward, tokens per logit chunk, compiled or not."""

    batch_size: int
    max_length: int
    logits_chunk: int
    compile_teacher: bool
    estimate: bool


@dataclass(frozen=True)
class PrecomputePlan:
    """Stage one's request as objects (module docstring); ``features`` are the targets with the teacher's defaults
    filled in."""

    teacher: TeacherSetup
    rows: RowSetup
    write: WriteSetup
    batch: BatchSetup
    features: tuple[str, ...]

    @classmethod
    def of(cls, options: PrecomputeOptions) -> PrecomputePlan:
        """The plan of validated options (``teacher.with_default_features`` applied first, where a run
        has a teacher's config)."""
        engine, dataset, storage = options.engine, options.dataset, options.storage
        rows = RowSetup(**asdict(dataset), teacher=engine.teacher, scratch=engine.estimate)
        write = WriteSetup(storage.out, storage.format, storage.dtype, storage.codec_config, storage.bitround,
                           storage.resolved_hidden_codec, options.targets.triangle, storage.sequences_per_shard,
                           storage.shard_index, storage.num_shards)
        batch = BatchSetup(engine.batch_size, dataset.max_length, engine.logits_chunk, engine.compile_teacher,
                           engine.estimate)
        return cls(TeacherSetup.of(engine), rows, write, batch, options.targets.features)
