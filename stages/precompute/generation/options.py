"""``GenerateOptions``: stage one's groups (teacher, dataset, storage, targets) plus ``generation``: how the teacher
samples its responses. Field names are the flags (``max_new_tokens`` is ``--max-new-tokens``) and the keys of a
``generate:`` config section; the dataset's ``--max-length`` is the longest prompt accepted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kdcache.stages.common.engine_options import PRECOMPUTE, EngineOptions, failed
from kdcache.stages.common.option_groups import assemble, option as _opt
from kdcache.stages.precompute.core.options import DatasetOptions, PrecomputeOptions, StorageOptions, TargetOptions

# the rule that turns (seed, prompt, response number, step) and the logits into a token (``generation.sampling``):
# recorded with the settings, so a cache another rule began is refused rather than resumed with this one. Version 1
# (unrecorded) drew from a torch.Generator per response; 2 draws from Philox-4x32-10 on a counter.
SAMPLER = "philox4x32-10/inverse-cdf/2"
RESPONSES = ("generate", "given")  # the teacher writes them; or the dataset holds them (vLLM, SGLang) and is cached


@dataclass(frozen=True)
class Sampling:
    """What a response depends on besides its prompt: the draws' seed and the sampling rule. Recorded in the
    manifest and the settings fingerprint (``record``)."""

    seed: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...]
    num_responses: int
    sampler: str = SAMPLER

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def record(self) -> dict[str, Any]:
        """The settings as plain JSON (the fingerprint's ``generation`` entry)."""
        return {**asdict(self), "stop": list(self.stop)}


@dataclass(frozen=True)
class GenerationOptions:
    """How the teacher writes its responses."""

    max_new_tokens: int = _opt(128, "tokens a response may have at most (its end-of-sequence token included)")
    temperature: float = _opt(1.0, "softmax temperature of the teacher's sampling; 0: greedy (the most likely token)")
    top_p: float = _opt(1.0, "nucleus sampling: draw from the fewest most likely tokens whose probability reaches "
                             "this (1: all)")
    sampling_top_k: int = _opt(0, "draw from the k most likely tokens only (0: all); --top-k is the logits cached")
    stop: tuple[str, ...] = _opt((), "strings that end a response (it keeps them), beside the teacher's "
                                     "end-of-sequence tokens", nargs="+", metavar="TEXT")
    num_responses: int = _opt(1, "responses sampled per prompt (each from its own draws: seed, prompt, number)")
    keep_unpacked: bool = _opt(False, "with --packing documents: keep OUT.unpacked (the responses one a row, "
                                      "as large as OUT) once OUT is packed; it is removed by default")
    responses: str = _opt("generate", "generate: the teacher writes the responses; given: the conversations of "
                                      "--messages-column already hold them (written by vLLM, SGLang...) and are "
                                      "only cached", choices=list(RESPONSES))

    def validate(self) -> list[str]:
        """Every problem of this group."""
        checks = [("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
                  ("temperature", self.temperature >= 0, "must be >= 0 (0: greedy)"),
                  ("top_p", 0 < self.top_p <= 1, "expected a value in (0, 1]"),
                  ("sampling_top_k", self.sampling_top_k >= 0, "must be >= 0 (0: every token)"),
                  ("num_responses", self.num_responses >= 1, "must be >= 1: each prompt gets this many responses"),
                  ("responses", self.responses in RESPONSES, f"expected one of {', '.join(RESPONSES)}")]
        problems = failed(self, checks)
        if not all(self.stop):
            problems.append(f"stop: got {list(self.stop)!r}; an empty stop string would end every response at once")
        return problems

    def sampling(self, seed: int) -> Sampling:
        return Sampling(seed, float(self.temperature), float(self.top_p), self.sampling_top_k, self.max_new_tokens,
                        tuple(self.stop), self.num_responses)


@dataclass(frozen=True)
class GenerateOptions:
    """Options of ``kdcache generate``: stage one's, plus the ``generation`` group."""

    engine: EngineOptions = field(metadata={"stage": PRECOMPUTE})
    dataset: DatasetOptions
    storage: StorageOptions
    targets: TargetOptions = field(default_factory=TargetOptions)
    generation: GenerationOptions = field(default_factory=GenerationOptions)

    def validate(self) -> list[str]:
        """Every problem found without loading the teacher."""
        problems = self.precompute.validate() + self.generation.validate()
        # a response's targets were computed with it alone: a row where attention crosses responses needs a new forward
        if self.dataset.packing == "concat" and self.generation.responses == "generate":
            problems.append("packing: got 'concat'; generated rows are packed with each response attending only to "
                            "itself, as the teacher computed it: use --packing documents")
        if self.generation.keep_unpacked and self.dataset.packing == "none":
            problems.append("keep_unpacked: there is no OUT.unpacked without --packing documents; drop it")
        given = self.generation.responses == "given"
        if given and not self.dataset.messages_column:
            problems.append("responses: given reads the responses from conversations: set --messages-column")
        if self.dataset.mask_column:
            problems.append("mask_column: generated responses are trained on, and the prompt is not; drop it")
        if self.dataset.source_column or self.dataset.target_column:
            problems.append("source_column/target_column: kdcache generate needs a decoder-only teacher")
        if not given:  # what the decode loop does not do (yet): refused rather than ignored
            unsupported = {"writer_processes": self.engine.writer_processes,
                           "compile_teacher": self.engine.compile_teacher,
                           "teacher_parallel": self.engine.teacher_parallel != "none",
                           "streaming": self.dataset.streaming, "record_text": self.dataset.record_text,
                           "hidden_rank": self.storage.hidden_rank is not None}
            problems += [f"{name}: not supported by kdcache generate yet; drop it (precompute over "
                         f"OUT.generations.jsonl can use it)" for name, given_ in unsupported.items() if given_]
        return problems

    @property
    def precompute(self) -> PrecomputeOptions:
        """The stage-one options these hold (what the shared checks and the teacher's loading read)."""
        return PrecomputeOptions(self.engine, self.dataset, self.storage, self.targets)

    @classmethod
    def of(cls, **flat: object) -> GenerateOptions:
        """Build from flat keyword arguments as the flags name them (tests, benchmarks); no checks."""
        return assemble(cls, flat)
