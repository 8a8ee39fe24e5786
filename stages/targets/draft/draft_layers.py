"""The ``--layers draft`` preset: which of a target's hidden layers an EAGLE-3 draft fuses (no torch here: stage
one's options read it on their light path)."""

from __future__ import annotations

from collections.abc import Iterable

DRAFT_PRESET = "draft"  # the --layers value that selects draft_layers(N)


def draft_layers(depth: int) -> tuple[int, int, int]:
    """The low, middle and high layers EAGLE-3 fuses, in HF ``hidden_states`` numbering (0 = embeddings).

    EAGLE-3's trainers (SpecForge, speculators, NeMo) capture the outputs of blocks ``1, N//2 - 1, N - 4``
    counted from 0, i.e. hidden states ``2, N//2, N - 3``. Two may coincide on a shallow target (N < 7); the draft
    then reads that layer twice, as its fc expects three.

    Raises:
        ValueError: fewer than 5 blocks (layer N - 3 would fall below layer 2).
    """
    if depth < 5:
        raise ValueError(f"layers: the 'draft' preset reads hidden layers 2, N/2 and N-3, which needs at least 5 "
                         f"blocks; this target has {depth}")
    return 2, depth // 2, depth - 3


def is_draft_preset(values: Iterable[str]) -> bool:
    """Whether a ``--layers`` value is the draft preset."""
    return tuple(v.strip().lower() for v in values) == (DRAFT_PRESET,)
