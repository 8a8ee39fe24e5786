"""Length-bucketed batches, planned shard by shard, and the shard-to-rank partition.

Batches never cross a shard: a shard's targets then depend only on the shard's own sequences, so a resumed run,
a run on two ranks and an uninterrupted run form exactly the same batches for it and write the same bytes.
Within a shard, sequences are sorted by length (stable, longest first: the largest batch comes first, so an
out-of-memory error shows up at once rather than an hour in), which keeps padding small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Partition:
    """This process's share of the cache: shards ``k`` with ``k % count == index``.

    ``index``/``count`` combine a job array (``--num-shards N --shard-index I``) with torchrun ranks:
    job I, rank r of W, owns part ``I * W + r`` of ``N * W``.
    """

    index: int
    count: int

    @classmethod
    def of(cls, shard_index: int, num_shards: int, rank: int, world: int) -> Partition:
        return cls(shard_index * world + rank, num_shards * world)

    def shards(self, num_shards: int) -> list[int]:
        """Cache shards this part owns, in order."""
        return list(range(self.index, num_shards, self.count))


def plan_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Group one shard's sequences (``lengths``: their ``[S]`` valid lengths, shard-local order) into batches of
    similar length, of at most ``batch_size``: index arrays into ``lengths`` that cover each sequence once."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def collate(sequences: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad B int arrays ``[L_i]`` into ``(input_ids [B, L_max] int64, attention_mask [B, L_max] int64)``,
    with ``pad_id`` in the padding (masked out, so its value never matters).

    Right padding keeps every valid token at its own position (0..L_i-1), so causal and absolute-position
    models see the same inputs as they would for the sequence alone.
    """
    longest = max(len(s) for s in sequences)
    ids = np.full((len(sequences), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = seq
        mask[row, :len(seq)] = 1
    return ids, mask
