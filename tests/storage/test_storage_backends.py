"""One shared storage suite, run once per backend (zarr, arrow). Small random arrays; no mocks.

Its data: ``_cache_data``. Mixed in: two-stream caches (``_seq2seq_suite``), format 3 (``_format3_suite``), every
file checked (``_integrity_suite``), hidden codecs (``_codec_suite``), partial caches and parts
(``_partial_suite``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kdcache.storage import CacheReader, CacheSpec, CacheWriter, to_float32
from kdcache.storage.core.errors import (
    CacheMismatchError,
    FormatVersionError,
    Fp16OverflowError,
    InvalidSequenceError,
    LayerNotInCacheError,
    ManifestError,
    SpecError,
    UnknownCodecError,
    UnknownFeatureError,
)
from kdcache.storage.core.logit_layouts import vocab_id_names
from tests.storage._cache_data import FINGERPRINTS, HEADS, D, expected, make_sequences, run_cli
from tests.storage._codec_suite import HiddenCodecSuite
from tests.storage._format3_suite import Format3Suite
from tests.storage._integrity_suite import IntegritySuite
from tests.storage._partial_suite import PartialSuite
from tests.storage._seq2seq_suite import Seq2SeqSuite


class StorageSuite(Seq2SeqSuite, Format3Suite, IntegritySuite, HiddenCodecSuite, PartialSuite):
    """Everything the issue's "Done when" asks, for one backend (set by the subclass)."""

    backend = ""
    fingerprints = FINGERPRINTS

    def spec(self, **kwargs) -> CacheSpec:
        base = dict(num_sequences=7, backend=self.backend, hidden_layers=(0, 2), attention_layers=(1,),
                    logits="topk", top_k=5, vocab_size=300, sequences_per_shard=3)
        return CacheSpec(**{**base, **kwargs})

    def build(self, path: Path, spec: CacheSpec, lengths: list[int] | None = None, *, shards=None,
              finalize: bool = True, fingerprints=FINGERPRINTS):
        lengths = lengths or [(i % 6) + 1 for i in range(spec.num_sequences)]
        seqs = make_sequences(spec, lengths)
        with CacheWriter(path, spec, fingerprints) as writer:
            for k in range(spec.num_shards) if shards is None else shards:
                start, stop = spec.shard_range(k)
                writer.write_shard(k, seqs[start:stop])
            if finalize:
                writer.finalize()
        return seqs

    def assert_same(self, got: dict, want: dict) -> None:
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype or name in vocab_id_names(), name  # ids: the smallest type
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    # ---- round trips ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("options", [
        dict(logits="full", attention_layers=(1, 2)),
        dict(logits="topk", attention_triangle=True, attention_heads=(1, 3), dtype="bf16"),
        dict(logits="topk", attention_triangle=False, attention_heads=(0,), codec="zstd", topk_codec="lz4"),
        dict(logits="topk", token_arrays=("loss_mask", "position_ids")),
        dict(logits=None, token_arrays=("position_ids",), attention_triangle=True, attention_heads=(1, 2)),
        dict(logits="sampled", samples=6, sample_temperature=2.0, token_arrays=("loss_mask",)),
        dict(logits="head", attention_layers=()),
        dict(logits="topk", topk_values="logprob", logprob_step=0.02, token_arrays=("loss_mask",)),
    ], ids=["full-square-fp16", "topk-triangle-heads-bf16", "topk-headsubset-othercodecs", "token-arrays",
            "documents-triangle", "sampled", "head", "topk-logprob"])
    def test_every_target_round_trips_bit_exact(self, tmp_path, options):
        spec = self.spec(**options)
        seqs = self.build(tmp_path, spec)
        reader = CacheReader(tmp_path)
        for i, item in enumerate(seqs):
            self.assert_same(reader[i], expected(spec, item))
        from_shards = list(reader.iter_sequences())
        for i, item in enumerate(seqs):
            self.assert_same(from_shards[i], expected(spec, item))
        assert reader.num_tokens == sum(len(s["input_ids"]) for s in seqs)

    def test_already_converted_inputs_are_stored_as_given(self, tmp_path):
        spec = self.spec(logits=None, attention_layers=())
        seqs = make_sequences(spec, [3, 4, 1, 2, 5, 6, 2])
        for item in seqs:
            item["hidden/0"] = item["hidden/0"].astype(np.float16)
        with CacheWriter(tmp_path, spec, FINGERPRINTS) as writer:
            for k in range(spec.num_shards):
                writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
            writer.finalize()
        np.testing.assert_array_equal(CacheReader(tmp_path)[4]["hidden/0"], seqs[4]["hidden/0"])

    def test_ragged_lengths_one_to_max(self, tmp_path):
        max_len = 13
        spec = self.spec(num_sequences=max_len, sequences_per_shard=4, attention_triangle=True)
        seqs = self.build(tmp_path, spec, lengths=list(range(1, max_len + 1)))
        reader = CacheReader(tmp_path)
        assert reader.num_tokens == max_len * (max_len + 1) // 2
        for i in (0, 3, 4, 12):
            got = reader.get(i, names=["input_ids", "attention"])
            assert got["attention/1"].shape == (HEADS, i + 1, i + 1)
            np.testing.assert_array_equal(got["input_ids"], seqs[i]["input_ids"])
        shard = reader.read_shard(1, names=["hidden/2"])
        assert list(shard.arrays) == ["hidden/2"] and shard.arrays["hidden/2"].shape == (5 + 6 + 7 + 8, D)
        np.testing.assert_array_equal(shard.offsets, [0, 5, 11, 18, 26])

    @pytest.mark.parametrize("vocab,dtype", [(200, np.uint8), (65536, np.uint16), (70000, np.uint32)])
    def test_topk_ids_use_smallest_type_and_survive_large_vocab(self, tmp_path, vocab, dtype):
        spec = self.spec(hidden_layers=(), attention_layers=(), vocab_size=vocab, top_k=4)
        seqs = make_sequences(spec, [3] * 7)
        seqs[5]["logits/topk_ids"][0] = [vocab - 1, 0, vocab // 2, 65535 % vocab]  # the extremes of the range
        with CacheWriter(tmp_path, spec, FINGERPRINTS) as writer:
            for k in range(spec.num_shards):
                writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
            writer.finalize()
        got = CacheReader(tmp_path)[5]["logits/topk_ids"]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, seqs[5]["logits/topk_ids"])

    def test_concurrent_reads_are_consistent(self, tmp_path):
        from concurrent.futures import ThreadPoolExecutor

        spec = self.spec(sequences_per_shard=2)
        seqs = self.build(tmp_path, spec)
        reader = CacheReader(tmp_path, max_open_shards=2)  # forces shards in and out of the cache
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(reader.get, [i % 7 for i in range(60)]))
        for i, got in enumerate(results):
            self.assert_same(got, expected(spec, seqs[i % 7]))

    def test_bitround_error_within_recorded_bound(self, tmp_path):
        spec = self.spec(bitround=4, logits="full", attention_layers=(1,))
        seqs = self.build(tmp_path, spec)
        reader = CacheReader(tmp_path)
        for name in ("hidden/0", "hidden/2", "attention/1", "logits/full"):
            bound = reader.manifest.arrays[name]["lossy"]
            assert bound["keepbits"] == 4 and 0 < bound["max_abs_error"] and 0 < bound["max_rel_error"] < 2 ** -4
            for i, item in enumerate(seqs):
                got = to_float32(reader[i][name], spec.dtype)
                want = item[name] if not name.startswith("attention/") else item[name]
                err = np.abs(got - want)
                assert err.max() <= bound["max_abs_error"]
                normal = np.abs(want) >= np.finfo(np.float16).tiny  # relative error is defined on normals
                assert (err[normal] / np.abs(want[normal])).max() <= bound["max_rel_error"]
        assert "lossy" not in reader.manifest.arrays["input_ids"]

    # ---- fingerprints and mismatches -----------------------------------------------------------------
    def test_mismatch_is_explained(self, tmp_path):
        spec = self.spec()
        self.build(tmp_path, spec)
        other = json.loads(json.dumps(FINGERPRINTS))
        other["tokenizer"].update(vocab_size=50257, vocab_hash="sha256:2222")
        with pytest.raises(CacheMismatchError) as caught:
            CacheWriter(tmp_path, spec, other)
        assert "vocabulary of 300 tokens" in str(caught.value) and "50257" in str(caught.value)
        with pytest.raises(CacheMismatchError, match=r"spec hidden_layers differs: the cache has \[0, 2\]"):
            CacheWriter(tmp_path, self.spec(hidden_layers=(0, 3)), FINGERPRINTS)
        from kdcache.storage import compare_fingerprints

        problems = compare_fingerprints(CacheReader(tmp_path).fingerprints, {"tokenizer": other["tokenizer"]})
        assert len(problems) == 1 and problems[0].startswith("tokenizer vocab differs")

    # ---- plain tools ---------------------------------------------------------------------------------
    def read_plainly(self, root: Path, shard: int, name: str, local: int) -> np.ndarray:
        """Sequence ``local`` of ``shard``'s array ``name`` using only zarr or pyarrow."""
        raise NotImplementedError

    def test_plain_library_opens_the_data(self, tmp_path):
        spec = self.spec(attention_triangle=True)
        seqs = self.build(tmp_path, spec)
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["shards"][1]["path"].startswith("shards/shard-000001")
        want = expected(spec, seqs[4])
        for name in ("input_ids", "hidden/2", "logits/topk_values", "logits/topk_ids", "logits/lse"):
            np.testing.assert_array_equal(self.read_plainly(tmp_path, 1, name, 1), want[name], err_msg=name)
        rows = self.read_plainly(tmp_path, 1, "attention/1", 1)  # [L(L+1)/2, H]
        q, k = np.tril_indices(len(seqs[4]["input_ids"]))
        np.testing.assert_array_equal(rows.T, want["attention/1"][:, q, k])

    def test_quantised_logprobs_record_their_error_and_refuse_logits(self, tmp_path):
        spec = self.spec(logits="topk", topk_values="logprob", logprob_step=0.02)
        assert "logits/lse" not in spec.sequence_names() and spec.array_dtype("logits/topk_values") == np.uint16
        seqs = self.build(tmp_path, spec)
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        for shard in manifest["shards"]:
            error = shard["lossy"]["logits/topk_values"]
            assert error["step"] == 0.02 and 0 < error["max_abs_error"] <= 0.01 and error["clipped"] == 0
        got = CacheReader(tmp_path)[2]["logits/topk_values"]
        assert np.abs(got - seqs[2]["logits/topk_values"]).max() <= 0.01 + 1e-6
        assert "topk_values" not in self.spec(logits="topk").to_dict()  # fp16 manifests stay as they were
        code, out = run_cli("inspect", str(tmp_path))
        assert code == 0 and "step 0.02, clipped 0" in out, out
        item = make_sequences(spec, [3])[0]
        item["logits/topk_values"] = item["logits/topk_values"] + 5.0  # logits, not log-probs
        one = self.spec(num_sequences=1, logits="topk", topk_values="logprob", logprob_step=0.02)
        with pytest.raises(InvalidSequenceError, match="expected log-probabilities"), \
                CacheWriter(tmp_path / "logits", one, FINGERPRINTS) as writer:
            writer.write_shard(0, [item])
        with pytest.raises(SpecError, match="topk_values 'logprob'"):
            self.spec(logits="full", topk_values="logprob", logprob_step=0.02)

    # ---- typed errors --------------------------------------------------------------------------------
    def test_typed_errors_for_bad_input(self, tmp_path):
        with pytest.raises(UnknownCodecError, match="unknown codec 'snappy2'.*known codecs: .*zstd"):
            self.spec(codec="snappy2")
        with pytest.raises(SpecError, match=r"token_arrays \['labels'\].*'loss_mask', 'position_ids'"):
            self.spec(token_arrays=("labels",))
        sampled = self.spec(num_sequences=1, logits="sampled", samples=3)
        item = make_sequences(sampled, [2])[0]
        item["logits/sample_ids"] = np.array([[5, 9, 9], [7, 3, 3]])
        with pytest.raises(InvalidSequenceError, match="sample_ids: each token's ids must be non-decreasing"), \
                CacheWriter(tmp_path / "bad-samples", sampled, FINGERPRINTS) as writer:
            writer.write_shard(0, [item])
        masked = self.spec(num_sequences=1, token_arrays=("loss_mask",))
        item = make_sequences(masked, [4])[0]
        item["loss_mask"] = np.array([0, 1, 2, 1])
        with pytest.raises(InvalidSequenceError, match=r"loss_mask: expected integers in 0\.\.1, got int64 values 0\.\.2"), \
                CacheWriter(tmp_path / "bad-mask", masked, FINGERPRINTS) as writer:
            writer.write_shard(0, [item])
        spec = self.spec()
        self.build(tmp_path, spec)
        reader = CacheReader(tmp_path)
        with pytest.raises(UnknownFeatureError, match="'logits/full'.*holds: input_ids"):
            reader.get(0, names=["logits/full"])
        with pytest.raises(LayerNotInCacheError, match=r"hidden layer 7 is not in this cache; cached hidden layers: \[0, 2\]"):
            reader.get(0, names=["hidden/7"])
        manifest_path = tmp_path / "manifest.json"
        good = manifest_path.read_text()
        manifest_path.write_text(good.replace('"format_version": 4', '"format_version": 5', 1))
        with pytest.raises(FormatVersionError, match="format_version 5.*up to 4"):
            CacheReader(tmp_path)
        manifest_path.write_text(good[: len(good) // 2])
        with pytest.raises(ManifestError, match="corrupt"):
            CacheReader(tmp_path)
        manifest_path.unlink()
        with pytest.raises(ManifestError, match="no manifest.json"):
            CacheReader(tmp_path)
        manifest_path.mkdir()  # something unreadable in its place: a typed error too, never an OSError
        with pytest.raises(ManifestError, match="cannot be read"):
            CacheReader(tmp_path)

    def test_fp16_overflow_is_refused_and_writes_nothing(self, tmp_path):
        spec = self.spec()
        seqs = make_sequences(spec, [2, 3, 4])
        seqs[1]["hidden/2"][1, 3] = -1.5e5
        with CacheWriter(tmp_path, spec, FINGERPRINTS) as writer:
            with pytest.raises(Fp16OverflowError, match=r"hidden/2: largest \|value\| is 150000.*bf16") as caught:
                writer.write_shard(0, seqs)
            assert caught.value.name == "hidden/2" and caught.value.max_abs == 1.5e5
            assert writer.committed_shards() == set()
        assert sorted(p.name for p in (tmp_path / "shards").glob("*")) == []
        bf16 = self.spec(dtype="bf16")
        with CacheWriter(tmp_path / "bf16", bf16, FINGERPRINTS) as writer:
            writer.write_shard(0, seqs)  # bf16 has float32's range

    # ---- CLI -----------------------------------------------------------------------------------------
    def test_inspect_and_verify_cli(self, tmp_path):
        spec = self.spec()
        seqs = self.build(tmp_path, spec)
        code, out = run_cli("inspect", str(tmp_path), "--json")
        info = json.loads(out)
        assert code == 0 and info["status"] == "complete" and info["backend"] == self.backend
        assert isinstance(info["num_tokens"], int) and info["num_tokens"] == sum(len(s["input_ids"]) for s in seqs)
        assert info["features"] == ["hidden", "attention", "logits/topk"] and info["hidden_layers"] == [0, 2]
        assert info["arrays"]["hidden/2"]["decoded_bytes_per_token"] == 2 * D
        assert info["arrays"]["logits/topk_ids"]["dtype"] == "uint16" and info["compression_ratio"] > 0
        assert info["fingerprints"]["tokenizer"]["vocab_size"] == 300
        code, text = run_cli("inspect", str(tmp_path))
        assert code == 0 and "status       complete" in text and "hidden/2" in text and "B/token" in text
        assert run_cli("verify", str(tmp_path))[0] == 0
        code, out = run_cli("verify", str(tmp_path / "nowhere"))
        assert code == 1 and "no manifest.json" in out
        code, out = run_cli("inspect", str(tmp_path / "nowhere"))
        assert code == 2 and out.startswith("error: no manifest.json")


class TestZarrBackend(StorageSuite):
    backend = "zarr"

    def read_plainly(self, root, shard, name, local):
        import zarr

        group = zarr.open_group(str(root / "shards" / f"shard-{shard:06d}"), mode="r")
        offsets_name = "attention_offsets" if name.startswith("attention/") else "offsets"
        start, stop = group[offsets_name][local:local + 2]
        return zarr.open_array(str(root / "shards" / f"shard-{shard:06d}" / name), mode="r")[start:stop]


class TestArrowBackend(StorageSuite):
    backend = "arrow"

    def read_plainly(self, root, shard, name, local):
        import pyarrow as pa

        with pa.memory_map(str(root / "shards" / f"shard-{shard:06d}.arrow")) as source:
            table = pa.ipc.open_stream(source).read_all()
        values = table.column(name)[local].values  # one row = one sequence
        if pa.types.is_fixed_size_list(values.type):  # [L, d] targets: list of fixed-size lists
            return values.flatten().to_numpy(zero_copy_only=False).reshape(-1, values.type.list_size)
        return values.to_numpy(zero_copy_only=False)
