"""The arrays a hidden codec stores: which kinds it applies to and how its companions are named.

The array kinds a hidden codec applies to are hidden states and the cached queries/keys/values, all activation
token rows ``[T, d]``. Each coded kind's companions are named ``{kind}_{part}/{j}`` (``hidden_scale/3``,
``attention_q_outliers/3``); ``{kind}_error`` holds the per-row error sums stage one hands the writer (recorded
per shard, never stored).
"""

from __future__ import annotations

from kdcache.storage.core.attention_source import QKV_KINDS
from kdcache.storage.core.streams import kind_of, prefixed, split_stream

CODED_KINDS = ("hidden", *QKV_KINDS)
PARTS = ("scale", "outliers", "outlier_ids")
COMPANION_KINDS: dict[str, tuple[str, str]] = {f"{kind}_{part}": (kind, part) for kind in CODED_KINDS
                                               for part in (*PARTS, "error")}
ERROR_FIELDS = ("err_sq", "ref_sq", "cosine", "max_abs", "decoded_sq")  # the columns of an error array [T, 5]


def part_name(name: str, part: str) -> str:
    """The companion array ``part`` ("scale", "outliers", "outlier_ids", "error") of coded array ``name``:
    ``part_name("encoder/hidden/3", "scale") == "encoder/hidden_scale/3"``."""
    stream, rest = split_stream(name)
    kind, layer = rest.split("/", 1)
    return prefixed(stream, f"{kind}_{part}/{layer}")


def part_of(name: str) -> str | None:
    """The part ("scale", "outliers", "outlier_ids", "error") companion ``name`` holds; None for any other array."""
    companion = COMPANION_KINDS.get(kind_of(name))
    return companion[1] if companion else None


def is_part(name: str) -> bool:
    """Whether ``name`` is a companion (scale, outliers, their ids) or a transient error array."""
    return part_of(name) is not None


def applies_to(name: str) -> bool:
    """Whether a hidden codec applies to array ``name`` (the one predicate; see ``CODED_KINDS``)."""
    return kind_of(name) in CODED_KINDS
