"""``kdcache generate --packing documents``: the generated rows packed into rows of ``--max-length`` tokens, as
precompute packs a dataset's documents, without running the teacher again.

How long a response is becomes known only once it is written, and a cache's rows are counted before its first shard
(``CacheSpec.num_sequences``). So the responses go first into a cache of one response a row beside the output,
``OUT.unpacked`` (resumable as any generated cache), and once that is complete its rows are packed into OUT: the
targets of a response do not depend on what shares its row, since packed documents attend only to themselves
(``position_ids`` restarting at 0 where each starts), so packing only moves stored arrays (attention maps become the
blocks on a packed row's diagonal). The packing is a function of the unpacked cache alone, which depends only on
(seed, prompt, response number): the packed bytes too, whatever the batch size, the ranks, or a kill and a rerun.

Two differences from precompute's packing, both because the teacher does not run again: no EOS is appended to a
response that ended without one (it would have no targets), and a sequence longer than a row is never cut (its
targets were computed with its whole prompt before it): it gets a row of its own. ``concat`` packing, whose
attention crosses documents, would need a new forward and is refused.

Once OUT is complete (and ``OUT.generations.jsonl`` written from the responses), ``OUT.unpacked`` holds nothing OUT
does not, at the same size again: it is removed (``remove_unpacked``) unless ``--keep-unpacked``, and a rerun that
finds OUT complete does nothing, without it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.precompute.core.progress import RunStats
from kdcache.stages.precompute.rows.data import TokenStreams
from kdcache.storage import CacheReader, CacheWriter, Store

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec, Manifest

UNPACKED_SUFFIX = ".unpacked"  # the responses one a row, beside OUT: OUT.unpacked


def unpacked_path(out: str) -> str:
    """Where the unpacked responses go (beside the cache folder, whose every entry ``verify`` accounts for)."""
    path = Path(out).expanduser()
    return str(path.with_name(path.name + UNPACKED_SUFFIX))


def remove_unpacked(out: str) -> tuple[str, int] | None:
    """``OUT.unpacked`` removed: renamed aside first, so that a kill mid-removal leaves no half cache under its
    name (only a hidden ``.NAME.removing`` that the next call, or ``discard_leftover``, finishes).

    Returns:
        the removed folder and its bytes; None where there was none.
    """
    path = Path(unpacked_path(out))
    discard_leftover(out)
    if not path.is_dir():
        return None
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    os.replace(path, _aside(path))
    shutil.rmtree(_aside(path))
    return str(path), size


def discard_leftover(out: str) -> None:
    """What a removal killed midway left aside (nothing reads it), removed."""
    shutil.rmtree(_aside(Path(unpacked_path(out))), ignore_errors=True)


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.removing")


def pack_plan(lengths: Sequence[int], block: int) -> list[list[int]]:
    """Sequences (whole, in order) into rows of at most ``block`` tokens; one that does not fit in what is left
    of a row starts the next, and one longer than ``block`` fills a row alone.

    Returns:
        per packed row, the indices of the unpacked sequences it holds.
    """
    rows: list[list[int]] = []
    used = block + 1  # no row open yet
    for s, length in enumerate(lengths):
        if used + length > block:
            rows.append([])
            used = 0
        rows[-1].append(s)
        used += length
    return rows


def packed_streams(lengths: Sequence[int], plan: list[list[int]], fingerprint: dict[str, Any]) -> TokenStreams:
    """What the packed cache's spec reads of its rows: their count and lengths, and the token arrays stored
    beside the ids (ids are placeholders of each row's length: the spec never reads their values)."""
    ids = [np.zeros(sum(lengths[s] for s in row), dtype=np.int32) for row in plan]
    return TokenStreams({"": ids}, fingerprint, {"loss_mask": ids, "position_ids": ids})


def write_packed(source: Store, writer: CacheWriter, plan: list[list[int]], stats: RunStats) -> Manifest:
    """Every packed shard the writer has not committed yet, joined from the unpacked cache at ``source``.

    Returns:
        the packed cache's manifest (``CacheWriter.finalize``).
    """
    reader = CacheReader(source)
    spec = writer.spec
    with writer:
        for k in sorted(set(range(spec.num_shards)) - writer.committed_shards()):
            start, stop = spec.shard_range(k)
            items = [_joined(reader, spec, plan[r]) for r in range(start, stop)]
            stats.add_shard(writer.write_shard(k, items))
        return writer.finalize()


def _joined(reader: CacheReader, spec: CacheSpec, sequences: list[int]) -> dict[str, np.ndarray]:
    """One packed row: the stored arrays of its sequences joined token after token (``[L, ...]``), attention
    maps ``[H, l_i, l_i]`` placed on the diagonal of ``[H, L, L]``, positions restarting at each sequence."""
    maps = {array.name for array in spec.arrays() if array.geometry is not None}
    parts = [reader.get(s) for s in sequences]
    row = {name: (_block_diagonal([p[name] for p in parts]) if name in maps
                  else np.concatenate([p[name] for p in parts])) for name in parts[0]}
    row["position_ids"] = np.concatenate([np.arange(len(p["input_ids"]), dtype=np.int32) for p in parts])
    return row


def _block_diagonal(maps: list[np.ndarray]) -> np.ndarray:
    """``[H, l_i, l_i]`` maps -> ``[H, L, L]`` with each on the diagonal, zeros between (what documents kept
    apart attend to; the writer stores only the blocks)."""
    total = sum(m.shape[-1] for m in maps)
    out = np.zeros((maps[0].shape[0], total, total), dtype=maps[0].dtype)
    at = 0
    for m in maps:
        out[:, at:at + m.shape[1], at:at + m.shape[2]] = m
        at += m.shape[-1]
    return out
