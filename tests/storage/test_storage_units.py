"""Backend-independent pieces of storage/: dtypes, codecs, spec, encode, layout, fingerprints."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from array_api_compat import array_namespace

from kdcache.storage.core.codecs import resolve_codec
from kdcache.storage.core.dtypes import bitround_bits, check_fp16_range, float32_to_bf16_bits, to_float32
from kdcache.storage.core.errors import (
    ChecksumError,
    DiskFullError,
    Fp16OverflowError,
    InvalidSequenceError,
    LayerNotInCacheError,
    ShardError,
    SpecError,
    UnknownCodecError,
    UnknownFeatureError,
)
from kdcache.storage.encode import encode_shard
from kdcache.storage.fingerprint import compare_fingerprints, hash_arrays
from kdcache.storage.hidden_codecs.arrays import NUMPY_COMPAT, NumpyOps, ops_for
from kdcache.storage.layout import attention_rows, pack_attention, unpack_attention
from kdcache.storage.schema.arrays import topk_id_dtype
from kdcache.storage.schema.spec import CacheSpec


def test_bf16_rounds_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.normal(size=4000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4000),
                             np.float32([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0, -0.0, 3.0e38])])
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bf16_bits(values), want)
    np.testing.assert_array_equal(to_float32(want, "bf16"), torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy())


def test_fp16_range_boundary():
    check_fp16_range("hidden/1", 65504.0)
    check_fp16_range("hidden/1", 65519.0)  # still rounds down to 65504
    with pytest.raises(Fp16OverflowError, match=r"hidden/1: largest \|value\| is 65520.*Use dtype 'bf16'"):
        check_fp16_range("hidden/1", 65520.0)


def test_bitround_matches_numcodecs_on_float16():
    import numcodecs

    values = np.random.default_rng(2).normal(size=1000).astype(np.float16)
    ours = bitround_bits(values.view(np.uint16), 10, 5).view(np.float16)
    np.testing.assert_array_equal(ours, numcodecs.BitRound(keepbits=5).decode(numcodecs.BitRound(keepbits=5).encode(values)))


def test_codecs_by_name_and_unknown_codecs_listed():
    assert resolve_codec("zstd")["id"] == "zstd"
    assert resolve_codec({"id": "blosc", "cname": "zstd", "clevel": 3, "shuffle": 2})["clevel"] == 3
    with pytest.raises(UnknownCodecError, match="unknown codec 'lz5'; known codecs: .*blosc.*lz4"):
        resolve_codec("lz5")
    with pytest.raises(UnknownCodecError, match="no Arrow IPC equivalent"):
        CacheSpec(num_sequences=1, backend="arrow", codec="zlib")
    with pytest.raises(UnknownCodecError, match="cannot compress zarr chunks"):
        CacheSpec(num_sequences=1, codec={"id": "delta", "dtype": "<f2"})


@pytest.mark.parametrize("vocab,dtype", [(256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)])
def test_topk_id_dtype_is_the_smallest_that_holds_vocab(vocab, dtype):
    assert topk_id_dtype(vocab) == dtype


def test_spec_round_trips_and_rejects_bad_values():
    spec = CacheSpec(num_sequences=9, hidden_layers=[3, 1, 3], attention_layers=[2], attention_heads=[1, 0],
                     logits="topk", top_k=8, vocab_size=1000, bitround=7, backend="arrow")
    assert spec.hidden_layers == (1, 3) and spec.attention_heads == (0, 1)
    assert CacheSpec.from_dict(spec.to_dict()) == spec
    assert spec.num_shards == 1 and spec.array_names()[:2] == ["input_ids", "offsets"]
    for bad in (dict(backend="hdf5"), dict(dtype="fp8"), dict(logits="topk", vocab_size=10, top_k=11),
                dict(attention_layers=[0]), dict(bitround=10)):
        with pytest.raises(SpecError):
            CacheSpec(num_sequences=1, **bad)
    with pytest.raises(SpecError, match="unknown spec field"):
        CacheSpec.from_dict({**spec.to_dict(), "new_field": 1})


def test_names_expand_and_are_checked():
    spec = CacheSpec(num_sequences=1, hidden_layers=(0, 4), logits="topk", top_k=2, vocab_size=9)
    assert spec.expand_names(["hidden", "logits/lse"]) == ["hidden/0", "hidden/4", "logits/lse"]
    with pytest.raises(LayerNotInCacheError, match=r"cached attention layers: none"):
        spec.check_name("attention/1")
    with pytest.raises(UnknownFeatureError, match="'logit/lse'"):
        spec.expand_names(["logit/lse"])


@pytest.mark.parametrize("triangle", [False, True])
def test_attention_pack_unpack(triangle):
    attn = np.random.default_rng(3).random((4, 5, 5)).astype(np.float32)
    rows = pack_attention(attn, (0, 2), triangle)
    assert rows.shape == (attention_rows(5, triangle), 2)
    assert rows[1].tolist() == ([attn[0, 1, 0], attn[2, 1, 0]] if triangle else [attn[0, 0, 1], attn[2, 0, 1]])
    want = np.tril(attn[[0, 2]]) if triangle else attn[[0, 2]]
    np.testing.assert_array_equal(unpack_attention(rows, 5, triangle), want)


def test_encode_is_pure_and_validates():
    spec = CacheSpec(num_sequences=2, hidden_layers=(1,), logits="topk", top_k=2, vocab_size=50, sequences_per_shard=2)
    seq = lambda n: {"input_ids": np.arange(n), "hidden/1": np.ones((n, 3), np.float32),  # noqa: E731
                     "logits/topk_values": np.tile([2.0, 1.0], (n, 1)).astype(np.float32),
                     "logits/topk_ids": np.tile([7, 3], (n, 1)), "logits/lse": np.zeros(n, np.float32)}
    shard = encode_shard(spec, 0, [seq(2), seq(3)])
    assert shard.num_tokens == 5 and shard.arrays["offsets"].tolist() == [0, 2, 5]
    assert shard.arrays["logits/topk_ids"].dtype == np.uint8 and shard.arrays["hidden/1"].dtype == np.float16
    with pytest.raises(ShardError, match="covers sequences \\[0, 2\\) = 2 sequences, got 1"):
        encode_shard(spec, 0, [seq(2)])
    bad = seq(2) | {"hidden/1": np.ones((2, 4, 1), np.float32)}
    with pytest.raises(InvalidSequenceError, match="sequence 1 .*'hidden/1'"):
        encode_shard(spec, 0, [seq(1), bad])
    unsorted = seq(2) | {"logits/topk_values": np.tile([1.0, 2.0], (2, 1)).astype(np.float32)}
    with pytest.raises(InvalidSequenceError, match="descending"):
        encode_shard(spec, 0, [seq(1), unsorted])
    with pytest.raises(InvalidSequenceError, match="ids in 0..49"):
        encode_shard(spec, 0, [seq(1), seq(2) | {"logits/topk_ids": np.tile([50, 3], (2, 1))}])
    with pytest.raises(LayerNotInCacheError):
        encode_shard(spec, 0, [seq(1), seq(2) | {"hidden/2": np.ones((2, 3), np.float32)}])


def test_compare_fingerprints_in_plain_words():
    cache = {"tokenizer": {"vocab_hash": "sha256:ab12ab12ab12ab12", "vocab_size": 30522, "special_tokens": {"pad_token": "[PAD]"}},
             "teacher": {"name_or_path": "bert", "revision": "main"}}
    student = {"tokenizer": {"vocab_hash": "sha256:cd34cd34cd34cd34", "vocab_size": 50257},
               "teacher": {"name_or_path": "bert", "revision": None}}
    assert compare_fingerprints(cache, student) == [
        "tokenizer vocab differs: the cache was built with a vocabulary of 30522 tokens (hash ab12ab12ab12..), "
        "the student expects 50257 (hash cd34cd34cd34..)"]
    assert compare_fingerprints(cache, cache) == []
    assert compare_fingerprints(cache, {"data": {"split": "train"}}) == [
        "the data fingerprint is not recorded in the cache; expected {\"split\": \"train\"}"]
    assert hash_arrays([np.array([1, 2]), np.array([3])]) != hash_arrays([np.array([1]), np.array([2, 3])])


def test_numpy_ops_are_found_under_the_namespace_of_a_numpy_array():
    """numpy's operations are registered by the wrapper's name, which importing storage does not load
    (``kdcache --help`` stays without it); a numpy array's namespace must be that name."""
    xp = array_namespace(np.empty(0))
    assert xp.__name__ == NUMPY_COMPAT and isinstance(ops_for(xp), NumpyOps)


def test_storage_never_imports_torch():
    code = ("import sys, kdcache.storage, kdcache.storage.writer, kdcache.storage.reader, kdcache.storage.verify, "
            "kdcache.storage.backends.arrow_backend, kdcache.storage.backends.zarr_backend; assert 'torch' not in sys.modules, 'storage imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_cut_to_the_spec_heads_by_the_caller_encodes_like_all_heads() -> None:
    spec = CacheSpec(num_sequences=2, attention_layers=(1,), attention_heads=(1, 3), attention_triangle=True,
                     sequences_per_shard=2)
    rng = np.random.default_rng(0)
    full = [rng.random((4, n, n), dtype=np.float32) for n in (3, 5)]
    seqs = [{"input_ids": np.arange(a.shape[1]), "attention/1": a} for a in full]
    cut = [{**s, "attention/1": s["attention/1"][[1, 3]]} for s in seqs]
    want, got = encode_shard(spec, 0, seqs).arrays, encode_shard(spec, 0, cut).arrays
    assert got["attention/1"].shape[1] == 2
    np.testing.assert_array_equal(got["attention/1"], want["attention/1"])
    with pytest.raises(InvalidSequenceError, match="head counts"):
        encode_shard(spec, 0, [{**s, "attention/1": s["attention/1"][:3]} for s in seqs])


def test_an_error_keeps_its_declared_facts_through_pickling_and_refuses_others() -> None:
    """``KdcacheError`` sets the facts a subclass declares; they survive a writer process's pickle, and a fact the
    class does not declare (a misspelling) is a TypeError, not an attribute kept silently."""
    again = pickle.loads(pickle.dumps(DiskFullError("disk full writing shard 3", needed=10, free=2)))
    assert (str(again), again.needed, again.free) == ("disk full writing shard 3", 10, 2)
    assert ChecksumError("bad bytes", shard=1, array="hidden/0").array == "hidden/0"
    with pytest.raises(TypeError, match="shrad"):
        ChecksumError("bad bytes", shrad=1, array="hidden/0")
