"""Bad input to storage/ gets a typed error naming the bad value: hidden codec records, attention scores, coded
hidden states out of range, per-row arrays of the wrong shape; a folder that cannot be renamed into place is an error."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kdcache.storage.core.errors import Fp16OverflowError, InvalidSequenceError, NonFiniteValueError, SpecError
from kdcache.storage.encode import encode_shard
from kdcache.storage.hidden_codecs import encode
from kdcache.storage.schema.spec import CacheSpec

D = 8


@pytest.mark.parametrize("value", [5, ["int8"], {"name": "int8", "configuration": [1]},
                                   {"name": "int8", "configuration": {"outliers": "x"}},
                                   {"name": "int8", "configuration": {"outliers": True}},
                                   {"name": "int4", "configuration": {"group": None}},
                                   {"name": "int4", "configuration": {"group": 64.5}},
                                   {"name": "int8", "configuration": {"rotation": True}},
                                   {"name": "int8", "configuration": {"rotation": 1.5}}])
def test_malformed_hidden_codecs_are_spec_errors_naming_the_value(value):
    with pytest.raises(SpecError, match="hidden codec") as info:
        CacheSpec(num_sequences=1, hidden_layers=(0,), hidden_codec=value)
    bad = value if not isinstance(value, dict) else next(iter(value["configuration"].values())) \
        if isinstance(value["configuration"], dict) else value["configuration"]
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("scores", [[1, 2], "x", {"num_heads": 2, "num_kv_heads": 2, "head_dim": 4, "causal": True,
                                                  "blocks": [1]},
                                    {"num_heads": 2, "num_kv_heads": 2, "head_dim": 4, "causal": True,
                                     "blocks": {"1": 3}}])
def test_malformed_attention_scores_are_spec_errors(scores):
    with pytest.raises(SpecError, match="needs attention_scores"):
        CacheSpec(num_sequences=1, attention_layers=(1,), attention_source="qk", attention_scores=scores)


def _coded_spec(**config) -> CacheSpec:
    return CacheSpec(num_sequences=1, hidden_layers=(0,), hidden_codec={"name": "int8", "configuration": config})


def test_coded_nan_is_a_non_finite_error_and_overflow_names_the_real_limit():
    spec = _coded_spec()
    x = np.ones((3, D), np.float32)
    x[1, 2] = np.nan
    with pytest.raises(NonFiniteValueError, match="hidden/0: 1 value"):
        encode_shard(spec, 0, [{"input_ids": np.arange(3), "hidden/0": x}])
    with pytest.raises(Fp16OverflowError, match=r"within \+-65504 "):
        encode_shard(spec, 0, [{"input_ids": np.arange(3), "hidden/0": np.full((3, D), 7e4, np.float32)}])
    no_outliers = _coded_spec(outliers=0, rotation=None)
    encode_shard(no_outliers, 0, [{"input_ids": np.arange(3), "hidden/0": np.full((3, D), 7e4, np.float32)}])
    with pytest.raises(Fp16OverflowError, match=r"within \+-8\.31901e\+06 "):  # 65504 * 127
        encode_shard(no_outliers, 0, [{"input_ids": np.arange(3), "hidden/0": np.full((3, D), 1e7, np.float32)}])


def test_per_row_errors_and_topk_mass_of_the_wrong_shape_are_refused():
    spec = _coded_spec()
    item = {"input_ids": np.arange(3), **encode(spec.hidden_codec, "hidden/0", np.ones((3, D), np.float32))}
    encode_shard(spec, 0, [item])
    with pytest.raises(InvalidSequenceError, match="'hidden_error/0': shape \\(3, 4\\), expected \\(3, 5\\)"):
        encode_shard(spec, 0, [{**item, "hidden_error/0": np.zeros((3, 4), np.float32)}])
    topk = CacheSpec(num_sequences=1, logits="topk", top_k=2, vocab_size=10)
    seq = {"input_ids": np.arange(3), "logits/topk_values": np.tile([1.0, 0.0], (3, 1)).astype(np.float32),
           "logits/topk_ids": np.tile([1, 2], (3, 1)), "logits/lse": np.zeros(3, np.float32)}
    encode_shard(topk, 0, [{**seq, "logits/topk_mass": np.ones(3)}])
    with pytest.raises(InvalidSequenceError, match="'logits/topk_mass': shape \\(2,\\), expected \\(3,\\)"):
        encode_shard(topk, 0, [{**seq, "logits/topk_mass": np.ones(2)}])


def test_put_folder_tolerates_only_a_copy_already_landed(tmp_path, monkeypatch):
    from kdcache.storage.core import stores

    store = stores.open_store(tmp_path)
    files = {"a.txt": b"one", "table.json": b"{}\n"}
    store.put_folder("tok", files, "table.json")
    store.put_folder("tok", files, "table.json")  # another rank's copy is there: the rename fails, and that is fine
    assert sorted(os.listdir(tmp_path)) == ["tok"]

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stores.os, "rename", full_disk)
    with pytest.raises(OSError, match="No space left"):
        store.put_folder("head", files, "table.json")
    assert sorted(os.listdir(tmp_path)) == ["tok"]  # no temp left behind, no folder that looks written


def test_the_rotation_is_built_once_and_each_caller_gets_its_own_copy():
    from kdcache.storage.hidden_codecs.arrays import hadamard_matrix, rotation_signs

    h, signs = hadamard_matrix(8), rotation_signs(3, 8)
    np.testing.assert_allclose(h @ h, np.eye(8), atol=1e-6)
    h[:], signs[:] = 0, 0  # a caller writing into its array changes nobody else's
    assert (hadamard_matrix(8) != 0).all() and set(rotation_signs(3, 8)) == {-1.0, 1.0}


@pytest.mark.parametrize("codec, want", [("bf16", {b"kdcache_dtype": b"bf16"}),
                                         ("int8", {b"kdcache_hidden_codec": b"int8"})])
def test_arrow_columns_name_the_type_they_really_hold(tmp_path, codec, want):
    import pyarrow as pa

    from kdcache.storage import CacheWriter

    spec = CacheSpec(num_sequences=1, backend="arrow", hidden_layers=(0,), hidden_codec=codec)  # dtype fp16
    with CacheWriter(tmp_path, spec, {"teacher": "t"}) as writer:
        writer.write_shard(0, [{"input_ids": np.arange(3), "hidden/0": np.ones((3, D), np.float32)}])
    with pa.ipc.open_stream(pa.OSFile(str(tmp_path / "shards" / "shard-000000.arrow"))) as stream:
        assert stream.schema.field("hidden/0").metadata == want


def test_a_first_run_killed_after_its_folders_can_be_rerun(tmp_path):
    from kdcache.stages.precompute.commit import check_out_folder
    from kdcache.stages.precompute.core.errors import PrecomputeError
    from kdcache.storage.folders import STAGE_ONE_FOLDERS

    for key in STAGE_ONE_FOLDERS:  # tokenizer/ and teacher_head/ land before the manifest
        (tmp_path / key).mkdir()
        (tmp_path / key / ".kdcache-files.json").write_text("{}\n")
    check_out_folder(str(tmp_path))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PrecomputeError, match="found notes.txt"):
        check_out_folder(str(tmp_path))


def test_verify_reports_a_record_it_cannot_decode_and_goes_on(tmp_path):
    from kdcache.storage import CacheWriter, verify_cache

    spec = CacheSpec(num_sequences=2, hidden_layers=(0,), hidden_codec="int8", sequences_per_shard=1)
    with CacheWriter(tmp_path, spec, {"teacher": "t"}) as writer:
        for k in range(2):
            encoded = encode_shard(spec, k, [{"input_ids": np.arange(3), "hidden/0": np.ones((3, D), np.float32)}])
            if k == 0:  # a record naming an array that is not coded: the numpy decode cannot even start
                encoded.lossy["input_ids"] = {"decoded_sq": 1.0}
            writer.commit(encoded)
        writer.finalize()
    report = verify_cache(tmp_path)
    assert [(p.shard, p.array) for p in report.problems] == [(0, None)]
    assert "cannot decode its coded hidden states" in str(report.problems[0]) and report.shards_checked == 2
