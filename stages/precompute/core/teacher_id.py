"""The teacher as the rest of stage one sees it: the loaded ``Teacher`` and the fingerprint that names it.

On the ground floor, apart from the loading (``precompute.teacher``, which places the weights with
``precompute.parallel``), so that what takes a loaded teacher (``capture``) and what fingerprints its files before
loading it (``parallel``'s checks, the runner) need not import the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import snapshot_download

from kdcache.stages.common.fingerprints import config_fingerprint, weights_fingerprint

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from kdcache.stages.precompute.core.plan import TeacherSetup


@dataclass
class Teacher:
    """A loaded teacher: the model in eval/inference mode on its device, its tokenizer and fingerprints."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    device: torch.device
    fingerprint: dict[str, Any]
    attn_implementation: str


def teacher_fingerprint(teacher: TeacherSetup, model: PreTrainedModel) -> dict[str, Any]:
    """name_or_path, revision, config hash and weights hash (of the weight files where they can be found)."""
    folder = _weights_folder(teacher)
    state = None if folder is not None else model.state_dict()
    return {"name_or_path": teacher.name, "revision": teacher.revision,
            "config_hash": config_fingerprint(model.config), "weights_hash": weights_fingerprint(folder, state),
            "num_layers": _depth(model.config)}


def teacher_files_fingerprint(teacher: TeacherSetup, config: PretrainedConfig) -> dict[str, Any] | None:
    """The teacher fingerprint from its files alone (no weights loaded), or None where no files are found."""
    folder = _weights_folder(teacher)
    if folder is None:
        return None
    try:
        weights = weights_fingerprint(folder)
    except ValueError:  # a folder without weight files
        return None
    return {"name_or_path": teacher.name, "revision": teacher.revision,
            "config_hash": config_fingerprint(config), "weights_hash": weights, "num_layers": _depth(config)}


def _depth(config: PretrainedConfig) -> int | None:
    """N, the teacher's block count. Stage two's formula layer maps (uniform, reverse, all-to-one) need the
    real N: the deepest cached layer is only a guess when the cache leaves out the teacher's top block."""
    depth = getattr(config, "num_hidden_layers", None)
    return int(depth) if isinstance(depth, int) else None


def _weights_folder(teacher: TeacherSetup) -> Path | None:
    local = Path(teacher.name).expanduser()
    if local.is_dir():
        return local
    try:  # a hub id: the files transformers just loaded sit in the local hub cache
        return Path(snapshot_download(teacher.name, revision=teacher.revision, local_files_only=True))
    except Exception:
        return None
