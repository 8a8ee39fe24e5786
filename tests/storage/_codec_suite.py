"""Hidden-state codecs, mixed into the shared backend suite (tests/storage/test_storage_backends.py), so each test
runs once per backend: every codec round-trips within the error its shards record, the stored arrays decode
with plain numpy from plain zarr / pyarrow reads, ``verify`` decodes them, and caches without a codec keep
their manifests."""

from __future__ import annotations

import numpy as np
import pytest

from kdcache.storage import CacheReader, CacheSpec, CacheWriter, to_float32, verify_cache
from kdcache.storage.core.errors import SpecError
from kdcache.storage.encode import encode_shard
from kdcache.storage.hidden_codecs import decode

CODECS = ("fp16", "bf16", "fp8", "int8", "int7", "int4", "pca8")


def _decoded(spec: CacheSpec, arrays: dict[str, np.ndarray], name: str) -> np.ndarray:
    """float32 values of hidden array ``name`` from a reader's arrays, by the documented formulas."""
    if spec.coded(name):
        return decode(spec.hidden_codec, arrays, name)
    return to_float32(arrays[name], spec.float_dtype(name))


class HiddenCodecSuite:
    """Needs ``spec``, ``build`` and ``read_plainly`` from the suite it is mixed into."""

    @staticmethod
    def _sequences(spec: CacheSpec) -> list:
        from tests.storage.test_storage_backends import make_sequences

        return make_sequences(spec, [(i % 6) + 1 for i in range(spec.num_sequences)])

    @pytest.mark.parametrize("codec", CODECS)
    def test_every_codec_round_trips_within_its_recorded_error(self, tmp_path, codec):
        spec = self.spec(hidden_codec=codec, logits=None, attention_layers=())
        seqs = self.build(tmp_path, spec)
        reader = CacheReader(tmp_path)
        for record in reader.records:
            data = reader.read_shard(record.index)
            start, stop = spec.shard_range(record.index)
            for name in (f"hidden/{j}" for j in spec.hidden_layers):
                want = np.concatenate([seqs[i][name] for i in range(start, stop)])
                got = _decoded(spec, data.arrays, name)
                rel = np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum())
                assert rel < {"fp16": 1e-3, "bf16": 5e-3, "fp8": 0.05, "int8": 0.01, "int7": 0.02, "int4": 0.15,
                               "pca8": 0.09}[codec]  # without its basis: a uniform step of 0.24 RMS
                if spec.coded(name):  # the record is what a recomputation finds
                    err = record.lossy[name]
                    assert err["codec"] == codec and err["rel_rms_error"] == pytest.approx(rel, rel=1e-4)
                    assert err["max_abs_error"] == pytest.approx(np.abs(got - want).max(), rel=1e-5)
                    assert data.arrays[name].dtype == spec.array_dtype(name)  # codes cross, not float32
        assert verify_cache(tmp_path).ok

    @pytest.mark.parametrize("codec", ["int8", "int4"])
    def test_codes_and_scales_read_plainly_and_decode_with_numpy(self, tmp_path, codec):
        spec = self.spec(hidden_codec=codec, logits=None, attention_layers=())
        seqs = self.build(tmp_path, spec)
        local = 1
        arrays = {name: self.read_plainly(tmp_path, 0, name, local) for name in spec.with_parts("hidden/2")}
        assert sorted(arrays) == ["hidden/2", "hidden_outlier_ids/2", "hidden_outliers/2", "hidden_scale/2"]
        np.testing.assert_allclose(decode(spec.hidden_codec, arrays, "hidden/2"), seqs[local]["hidden/2"],
                                   rtol=0, atol=0.3 if codec == "int8" else 3.0)

    def test_reading_the_hidden_group_brings_each_layers_companions(self, tmp_path):
        spec = self.spec(hidden_codec="int8", logits=None, attention_layers=())
        seqs = self.build(tmp_path, spec)
        got = CacheReader(tmp_path).get(1, names=["hidden"])
        assert set(spec.with_parts("hidden/0") + spec.with_parts("hidden/2")) <= set(got)
        np.testing.assert_allclose(decode(spec.hidden_codec, got, "hidden/2"), seqs[1]["hidden/2"], rtol=0, atol=0.3)

    def test_verify_finds_codes_that_no_longer_decode_as_recorded(self, tmp_path):
        """Intact bytes whose decode differs from what the writer measured (a device encode that disagrees with
        the reference decode) are a finding."""
        spec = self.spec(hidden_codec="int8", logits=None, attention_layers=())
        seqs = self._sequences(spec)
        with CacheWriter(tmp_path, spec, self.fingerprints) as writer:
            for k in range(spec.num_shards):
                encoded = encode_shard(spec, k, seqs[slice(*spec.shard_range(k))])
                if k == 1:
                    encoded.lossy["hidden/0"]["decoded_sq"] *= 1.01
                writer.commit(encoded)
            writer.finalize()
        report = verify_cache(tmp_path)
        assert not report.ok and report.bad_arrays == [(1, "hidden/0")]
        assert "do not decode as written" in str(report.problems[0])

    def test_caches_without_a_codec_keep_their_manifests_and_bad_codecs_are_named(self, tmp_path):
        plain = self.spec()
        assert "hidden_codec" not in plain.to_dict() and plain.hidden_codec.record() == {"name": "fp16", "configuration": {}}
        assert CacheSpec.from_dict(plain.to_dict()) == plain
        bf16 = self.spec(dtype="bf16")
        assert "hidden_codec" not in bf16.to_dict() and bf16.float_dtype("hidden/0") == "bf16"
        coded = self.spec(hidden_codec={"name": "int4", "configuration": {"group": 4}})
        assert CacheSpec.from_dict(coded.to_dict()) == coded
        with pytest.raises(SpecError, match="unknown hidden codec 'int3'"):
            self.spec(hidden_codec="int3")
        with pytest.raises(SpecError, match="unknown configuration"):
            self.spec(hidden_codec={"name": "int8", "configuration": {"bits": 3}})

    def test_inspect_shows_the_codec_and_each_arrays_error(self, tmp_path):
        from tests.storage.test_storage_backends import run_cli

        self.build(tmp_path, self.spec(hidden_codec="int7", logits=None, attention_layers=()))
        code, text = run_cli("inspect", str(tmp_path))
        assert code == 0 and "hidden codec int7 (rotation seed 0, outliers 4)" in text
        assert "rel RMS" in text and "worst row cos" in text and "hidden_scale/2" in text

    def test_a_rank_codec_round_trips_through_bases_plain_numpy_reads(self, tmp_path):
        """``--hidden-rank``: coefficients coded, bases stored as plain ``.npy`` in ``projection/`` (listed in
        the manifest's file table), decoded through them within the error the shard records; verify agrees."""
        from kdcache.storage.core.stores import open_store
        from kdcache.storage.hidden_codecs import encode
        from kdcache.storage.projection import read_projection, write_projection

        spec = self.spec(hidden_codec={"name": "int8", "configuration": {"rank": 4}}, logits=None,
                         attention_layers=())
        seqs = self._sequences(spec)
        rng = np.random.default_rng(1)
        for name in ("hidden/0", "hidden/2"):  # states near a 4-dim subspace (plus noise the projection drops)
            mix = rng.normal(size=(4, seqs[0][name].shape[1])).astype(np.float32)
            for item in seqs:
                low = rng.normal(size=(len(item[name]), 4)).astype(np.float32) @ mix
                item[name] = low + 0.01 * item[name]
        flat = {name: np.concatenate([s[name] for s in seqs]) for name in ("hidden/0", "hidden/2")}
        bases = {name: (np.linalg.svd(x - x.mean(0))[2][:4].astype(np.float32), x.mean(0).astype(np.float32))
                 for name, x in flat.items()}
        write_projection(open_store(tmp_path), bases)
        coded = [{**item, **{k: v for n in bases for k, v in encode(spec.hidden_codec, n, item[n], bases).items()}}
                 for item in seqs]
        with CacheWriter(tmp_path, spec, self.fingerprints) as writer:
            for k in range(spec.num_shards):
                writer.write_shard(k, coded[slice(*spec.shard_range(k))])
            writer.finalize()
        plain = {n: (np.load(tmp_path / "projection" / f"{n.replace('/', '.')}.basis.npy"),
                     np.load(tmp_path / "projection" / f"{n.replace('/', '.')}.mean.npy")) for n in bases}
        assert all(np.array_equal(plain[n][0], bases[n][0]) and plain[n][0].shape == (4, 8) for n in bases)
        manifest = CacheReader(tmp_path).manifest
        assert "projection/hidden.2.basis.npy" in manifest.files and manifest.spec.hidden_codec.record()["configuration"][
            "rank"] == 4
        reader = CacheReader(tmp_path)
        stored = read_projection(reader.store, list(bases), 4)
        for record in reader.records:
            data = reader.read_shard(record.index)
            start, stop = spec.shard_range(record.index)
            for name in bases:
                assert data.arrays[name].shape[1] == 4  # [T, R] coefficients, not [T, d]
                got, want = decode(spec.hidden_codec, data.arrays, name, stored), flat[name][
                    sum(len(s["input_ids"]) for s in seqs[:start]):sum(len(s["input_ids"]) for s in seqs[:stop])]
                rel = np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum())
                assert rel < 0.05 and record.lossy[name]["rel_rms_error"] == pytest.approx(rel, rel=1e-4)
        assert verify_cache(tmp_path).ok

    def test_pca8_codes_full_rank_coefficients_column_major_in_zarr(self, tmp_path):
        """``pca8``: R = d coefficients coded with a step of 0.24 x each row's RMS, decoded through the stored
        bases within the recorded error; zarr shuffles each codes row (direction by direction before zstd) and a
        plain zarr read undoes it; the scales and every other codec keep their bytes' layout."""
        from kdcache.storage.core.stores import open_store
        from kdcache.storage.hidden_codecs import encode
        from kdcache.storage.projection import write_projection

        spec = self.spec(hidden_codec={"name": "pca8", "configuration": {"rank": 8}}, logits=None,
                         attention_layers=())
        assert spec.hidden_codec.record()["configuration"] == {"rotation": None, "outliers": 0, "group": 64, "step": 0.24,
                                                      "rank": 8}
        seqs = self._sequences(spec)
        flat = {n: np.concatenate([s[n] for s in seqs]) for n in ("hidden/0", "hidden/2")}
        bases = {n: (np.linalg.svd(x - x.mean(0))[2].astype(np.float32), x.mean(0).astype(np.float32))
                 for n, x in flat.items()}  # [8, 8]: every direction
        write_projection(open_store(tmp_path), bases)
        coded = [{**item, **{k: v for n in bases for k, v in encode(spec.hidden_codec, n, item[n], bases).items()}}
                 for item in seqs]
        with CacheWriter(tmp_path, spec, self.fingerprints) as writer:
            for k in range(spec.num_shards):
                writer.write_shard(k, coded[slice(*spec.shard_range(k))])
            writer.finalize()
        reader = CacheReader(tmp_path)
        for record in reader.records:
            data = reader.read_shard(record.index)
            lo, hi = (sum(len(s["input_ids"]) for s in seqs[:i]) for i in spec.shard_range(record.index))
            for name in bases:
                got, want = decode(spec.hidden_codec, data.arrays, name, bases), flat[name][lo:hi]
                rel = np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum())
                assert 0.01 < rel < 0.09 and record.lossy[name]["rel_rms_error"] == pytest.approx(rel, rel=1e-4)
                assert record.lossy[name]["codec"] == "pca8" and data.arrays[name].dtype == np.int8
        first = np.concatenate([c["hidden/2"] for c in coded[:spec.sequences_per_shard]])
        np.testing.assert_array_equal(self.read_plainly(tmp_path, 0, "hidden/2", 1), coded[1]["hidden/2"])
        assert np.array_equal(reader.read_shard(0).arrays["hidden/2"], first)
        assert verify_cache(tmp_path).ok
        if spec.backend == "zarr":
            self._assert_shuffled_only(tmp_path, spec)

    def _assert_shuffled_only(self, root, spec: CacheSpec) -> None:
        """The codes of ``pca8`` go through numcodecs.shuffle (one row per element); its scales do not."""
        import json

        def inner(name: str) -> list:
            meta = json.loads((root / "shards" / "shard-000000" / name / "zarr.json").read_text())
            return meta["codecs"][0]["configuration"]["codecs"]

        codes, scales = inner("hidden/2"), inner("hidden_scale/2")
        assert [c["name"] for c in codes] == ["bytes", "numcodecs.shuffle", "blosc", "crc32c"]
        assert codes[1]["configuration"]["elementsize"] == 8 and codes[2]["configuration"]["clevel"] == 1
        assert [c["name"] for c in scales] == ["bytes", "blosc", "crc32c"]
        assert spec.codec_for("hidden_scale/2") == self.spec(hidden_codec="int8").codec_for("hidden/2")

    def test_pca8_bad_configurations_are_named(self):
        with pytest.raises(SpecError, match="step must be a number in \\(0, 8\\].*got -1"):
            self.spec(hidden_codec={"name": "pca8", "configuration": {"step": -1}})
        with pytest.raises(SpecError, match="takes no rotation and no outliers.*rotation 0"):
            self.spec(hidden_codec={"name": "pca8", "configuration": {"rotation": 0}})
        with pytest.raises(SpecError, match="unknown configuration \\['bits'\\]"):
            self.spec(hidden_codec={"name": "pca8", "configuration": {"bits": 3}})
        with pytest.raises(SpecError, match="unknown configuration \\['step'\\]"):
            self.spec(hidden_codec={"name": "int8", "configuration": {"step": 0.2}})
