"""Hidden-state codecs, mixed into the shared backend suite (tests/storage/test_storage_backends.py), so each test
runs once per backend: every codec round-trips within the error its shards record, the stored arrays decode
with plain numpy from plain zarr / pyarrow reads, ``verify`` decodes them, and caches without a codec keep
their manifests."""

from __future__ import annotations

import numpy as np
import pytest

from kdcache.storage import CacheReader, CacheSpec, CacheWriter, to_float32, verify_cache
from kdcache.storage.encode import encode_shard
from kdcache.storage.errors import SpecError
from kdcache.storage.hidden_codecs import decode

CODECS = ("fp16", "bf16", "fp8", "int8", "int7", "int4")


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
                assert rel < {"fp16": 1e-3, "bf16": 5e-3, "fp8": 0.05, "int8": 0.01, "int7": 0.02, "int4": 0.15}[codec]
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
        assert "hidden_codec" not in plain.to_dict() and plain.hidden_codec == {"name": "fp16", "configuration": {}}
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
        assert code == 0 and "hidden codec int7 (rotation 0, outliers 4, group 64)" in text
        assert "rel RMS" in text and "worst row cos" in text and "hidden_scale/2" in text

    def test_a_rank_codec_round_trips_through_bases_plain_numpy_reads(self, tmp_path):
        """``--hidden-rank``: coefficients coded, bases stored as plain ``.npy`` in ``projection/`` (listed in
        the manifest's file table), decoded through them within the error the shard records; verify agrees."""
        from kdcache.storage.hidden_codecs import encode
        from kdcache.storage.projection import read_projection, write_projection
        from kdcache.storage.stores import open_store

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
        assert "projection/hidden.2.basis.npy" in manifest.files and manifest.spec.hidden_codec["configuration"][
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
