"""Every reader of logit arrays asks the layout (issue 33): the size bound, the progress summary, what stage one
hands over unrounded, Arrow's file codec and zarr's dimension names, for each mode, the sampled one included.

Expected values are written out from the array shapes of docs/cache-format.md, not taken from the layouts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from kdcache.stages.precompute.core.progress import target_of
from kdcache.stages.precompute.estimate import lower_bound_bytes
from kdcache.storage import TOPK_MASS, CacheSpec, exact_arrays, vocab_id_names

TOKENS = 1000
CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)
DATA = SimpleNamespace(meta={"tokens": {"": TOKENS}, "sum_sq_lengths": {"": 0}})


def _spec(logits: str, backend: str = "zarr", **fields: object) -> CacheSpec:
    return CacheSpec(num_sequences=4, hidden_layers=(), logits=logits, vocab_size=300, backend=backend,
                     **fields)  # type: ignore[arg-type]


def test_the_size_bound_counts_every_array_of_the_layout() -> None:
    # vocabulary of 300 ids: uint16 ids; fp16 values; float32 lse; uint8 counts
    assert lower_bound_bytes(_spec("topk", top_k=5), CONFIG, DATA) == TOKENS * (5 * 2 + 5 * 2 + 4)
    assert lower_bound_bytes(_spec("sampled", samples=6), CONFIG, DATA) == TOKENS * 6 * (2 + 1 + 2)
    assert lower_bound_bytes(_spec("full"), CONFIG, DATA) == TOKENS * 300 * 2
    logprob = _spec("topk", top_k=5, topk_values="logprob", logprob_step=0.01)
    assert lower_bound_bytes(logprob, CONFIG, DATA) == TOKENS * (5 * 2 + 5 * 2)  # uint16 steps, no lse
    assert lower_bound_bytes(_spec("head"), CONFIG, DATA) == 0


@pytest.mark.parametrize(("mode", "fields", "arrays"), [
    ("topk", {"top_k": 5}, ["logits/topk_values", "logits/topk_ids", "logits/lse"]),
    ("sampled", {"samples": 6}, ["logits/sample_ids", "logits/sample_counts", "logits/sample_logp"]),
    ("full", {}, ["logits/full"]),
])
def test_progress_files_each_array_under_its_own_mode(mode: str, fields: dict, arrays: list[str]) -> None:
    spec = _spec(mode, **fields)
    assert {target_of(name, spec) for name in arrays} == {f"logits/{mode}"}
    assert target_of("hidden/2", spec) == "hidden/2" and target_of("offsets", spec) == "index"


def test_stage_one_hands_over_unrounded_what_is_not_a_float_target() -> None:
    assert set(exact_arrays(_spec("topk", top_k=5))) == {"logits/topk_ids", "logits/lse", TOPK_MASS}
    logprob = _spec("topk", top_k=5, topk_values="logprob", logprob_step=0.01)
    assert set(exact_arrays(logprob)) == {"logits/topk_ids", "logits/topk_values", TOPK_MASS}
    assert set(exact_arrays(_spec("sampled", samples=6))) == {"logits/sample_ids", "logits/sample_counts",
                                                              TOPK_MASS}
    assert set(exact_arrays(_spec("full"))) == {TOPK_MASS}
    assert vocab_id_names() >= {"logits/topk_ids", "logits/sample_ids"}
    assert not vocab_id_names() & {"logits/topk_values", "logits/sample_counts", "logits/full"}


def test_arrow_takes_the_top_k_codec_only_for_a_top_k_only_cache() -> None:
    """As before the layouts were asked: the activation codec unless the file holds nothing but top-k logits."""
    from kdcache.storage.backends.arrow_backend import file_codec

    lz4 = {"codec": "lz4"}
    assert file_codec(_spec("topk", "arrow", top_k=5, **lz4)) == ("zstd", 3)  # the top-k codec (default zstd)
    assert file_codec(_spec("sampled", "arrow", samples=6, **lz4)) == ("lz4", None)
    assert file_codec(_spec("full", "arrow", **lz4)) == ("lz4", None)
    with_hidden = CacheSpec(num_sequences=4, hidden_layers=(1,), logits="topk", top_k=5, vocab_size=300,
                            backend="arrow", codec="lz4")
    assert file_codec(with_hidden) == ("lz4", None)


def test_zarr_names_the_dimensions_of_each_logit_array() -> None:
    from kdcache.storage.backends.zarr_backend import _dimension_names

    topk, full, sampled = _spec("topk", top_k=5), _spec("full"), _spec("sampled", samples=6)
    assert _dimension_names(topk, "logits/topk_ids") == ("token", "rank")
    assert _dimension_names(topk, "logits/lse") == ("token",)
    assert _dimension_names(full, "logits/full") == ("token", "vocab")
    assert _dimension_names(sampled, "logits/sample_counts") == ("token", "rank")
    assert _dimension_names(topk, "hidden/1") == ("token", "feature")
