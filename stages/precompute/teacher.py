"""Loading the teacher: config first (to check the request cheaply), then weights, tokenizer and device.

The model class follows the checkpoint's own architecture: a causal LM loads with ``AutoModelForCausalLM``, a
masked LM with ``AutoModelForMaskedLM``, and a bare encoder (MiniLM) with ``AutoModel`` when no logits are
asked for. Loading an LM head that the checkpoint does not have would give random logits, so that is refused.

Checks of the teacher against the request and the rows, in stage one's order: the default features from its
config, its position table against the longest row (before the weights), then its embedding table against the
token ids and its LM head's real vocabulary (after).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from kdcache.stages.common.architectures import ModelClass
from kdcache.stages.common.fingerprints import clear_call_state
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.hub import offline_unless_reachable
from kdcache.stages.precompute.core.plan import TeacherSetup
from kdcache.stages.precompute.core.targets import CAUSAL_SUFFIXES, Targets
from kdcache.stages.precompute.core.teacher_id import Teacher, teacher_fingerprint
from kdcache.stages.precompute.parallel.layouts import Grid, Layout, load_kwargs, settle
from kdcache.storage import Store, folder_is_complete, put_folder

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from kdcache.stages.precompute.core.options import PrecomputeOptions
    from kdcache.stages.precompute.rows.data import TokenStreams

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def read_config(setup: TeacherSetup) -> PretrainedConfig:
    """Load the teacher's ``AutoConfig`` (small, no weights).

    Raises:
        PrecomputeError: the teacher cannot be found or read.
    """
    unreachable = offline_unless_reachable(setup.name)  # one try, not five per file
    try:
        config = AutoConfig.from_pretrained(setup.name, revision=setup.revision)
    except Exception as exc:  # OSError for missing repos/files, ValueError for unknown model types
        why = unreachable or exc
        raise PrecomputeError(f"cannot load the teacher config from {setup.name!r}: {why}") from None
    return config  # the family (decoder-only or encoder, encoder-decoder) picks the adapter (adapters.adapter_for)


def load_tokenizer(setup: TeacherSetup) -> PreTrainedTokenizerBase:
    """The teacher's tokenizer.

    Raises:
        PrecomputeError: it cannot be loaded.
    """
    try:
        return AutoTokenizer.from_pretrained(setup.name, revision=setup.revision)
    except Exception as exc:
        raise PrecomputeError(f"cannot load the tokenizer of {setup.name!r}: {exc}") from None


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` means this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PrecomputeError(f"device {name!r} asked for, but CUDA is not available here")
    return torch.device(name)


def has_lm_head(config: PretrainedConfig) -> bool:
    """Whether the teacher's checkpoint has a language-model head (a causal or masked LM, or an encoder-decoder LM)."""
    archs = getattr(config, "architectures", None) or []
    heads = (*CAUSAL_SUFFIXES, "ForMaskedLM", "ForConditionalGeneration")
    return any(a.endswith(heads) for a in archs) or (not archs and bool(getattr(config, "is_decoder", False)))


def _model_class(config: PretrainedConfig, targets: Targets, teacher: str) -> ModelClass:
    archs = getattr(config, "architectures", None) or []
    if targets.logit.name is None:
        return transformers.AutoModel
    if any(a.endswith(CAUSAL_SUFFIXES) for a in archs) or (not archs and targets.causal):
        return transformers.AutoModelForCausalLM
    if any(a.endswith("ForMaskedLM") for a in archs):
        return transformers.AutoModelForMaskedLM
    raise PrecomputeError(f"teacher {teacher!r} has no language-model head (architectures: {archs or 'unknown'}), "
                          f"so it has no logits to cache; drop 'logits' from --features")


def load_teacher(setup: TeacherSetup, config: PretrainedConfig, targets: Targets,
                 tokenizer: PreTrainedTokenizerBase, device: torch.device) -> Teacher:
    """Load the weights for inference (``load_for_inference``): eager attention only when attention maps are
    captured, otherwise the checkpoint's default (usually SDPA) keeps the forward fast."""
    model = load_for_inference(_model_class(config, targets, setup.name), setup, device,
                               eager=targets.wants_attention)
    torch.manual_seed(setup.seed)
    fingerprint = teacher_fingerprint(setup, model)
    impl = getattr(model.config, "_attn_implementation", None) or "default"
    return Teacher(model, tokenizer, model.config, device, fingerprint, impl)


def load_for_inference(cls: ModelClass, setup: TeacherSetup, device: torch.device, *, eager: bool,
                       optional: tuple[str, ...] = ()) -> PreTrainedModel:
    """``cls`` (an Auto class, or a model class) ``.from_pretrained`` in the requested dtype, eval mode, no grads,
    on ``device``; ``eager`` attention where maps are captured (fused kernels never materialise them), and
    ``optional``: prefixes of weights that may be missing (an LM head when no logits are cached).

    Raises:
        PrecomputeError: the weights cannot be loaded, or some are missing (random weights would silently
            corrupt the targets).
    """
    # "auto" is the checkpoint's dtype, but fp32 on a CPU: half precision there is slow, not faster
    dtype = getattr(torch, _DTYPES[setup.dtype]) if setup.dtype != "auto" else (
        "auto" if device.type != "cpu" else torch.float32)
    kwargs: dict[str, Any] = {"revision": setup.revision, "dtype": dtype, "output_loading_info": True}
    if eager:
        kwargs["attn_implementation"] = "eager"
    # a sharded or layer-placed teacher lands on its devices as it loads: the ``from_pretrained`` keywords of
    # --teacher-parallel for this launcher rank (``parallel.load_kwargs``)
    layout, placed = Layout.parse(setup.parallel), {}
    if not (layout.kind == "none" or (layout.kind == "tp" and layout.size == 1)):
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        placed = load_kwargs(layout, Grid.of(layout, rank, world), int(os.environ.get("LOCAL_RANK", str(rank))))
    kwargs.update(placed)
    try:
        model, info = cls.from_pretrained(setup.name, **kwargs)
    except Exception as exc:
        raise PrecomputeError(f"cannot load the teacher weights from {setup.name!r}: {exc}") from None
    missing = sorted(k for k in info.get("missing_keys") or [] if not (optional and k.startswith(optional)))
    if missing:
        raise PrecomputeError(f"teacher {setup.name!r} checkpoint lacks {len(missing)} weight(s) that "
                              f"{type(model).__name__} needs (e.g. {', '.join(missing[:3])}); they would be random")
    model = model.eval().requires_grad_(False)
    if placed:
        settle(model)
    return model if placed else model.to(device)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, store: Store) -> None:
    """Save the tokenizer into the cache's ``tokenizer/`` in the output ``store`` (it appears whole; safe for many
    ranks)."""
    if folder_is_complete(store, "tokenizer"):
        return
    clear_call_state(tokenizer)  # the same tokenizer.json whichever rank saves it, whether or not it tokenized
    with tempfile.TemporaryDirectory(prefix="kdcache-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        put_folder(store, "tokenizer", Path(tmp))


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
    if options.targets.logit.topk_values == "logprob" and not has_lm_head(config):
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


def with_output_vocab(targets: Targets, teacher: Teacher, setup: TeacherSetup) -> Targets:
    """Use the LM head's real output size as the vocabulary (checkpoints may pad it beyond config.vocab_size)."""
    head = teacher.model.get_output_embeddings()
    kind = targets.logit.kind
    if kind is None or head is None:
        return targets
    vocab = int(head.weight.shape[0])
    # logit.top_k is --top-k for the one mode that reads it (topk), 0 for the modes that ignore it
    for problem in kind.teacher_problems(setup.name, "" in targets.streams, targets.causal, vocab,
                                         targets.logit.top_k):
        raise PrecomputeError(problem)
    return replace(targets, vocab_size=vocab)
