"""Seq2seq caches (two token streams plus cross-attention), mixed into the shared backend suite.

Each test runs once per backend through ``StorageSuite`` (tests/storage/test_storage_backends.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kdcache.storage import CacheReader, CacheSpec, CacheWriter, verify_cache
from kdcache.storage.core.errors import CacheMismatchError, InvalidSequenceError, LayerNotInCacheError, SpecError

D_ENC, D_DEC, HEADS = 6, 8, 4
FINGERPRINTS = {"teacher": {"name_or_path": "tiny-t5"}, "tokenizer": {"vocab_hash": "h", "vocab_size": 300}}


def _probs(rng: np.random.Generator, queries: int, keys: int) -> np.ndarray:
    scores = rng.random((HEADS, queries, keys)).astype(np.float32)
    return scores / scores.sum(-1, keepdims=True)


def make_seq2seq_sequences(spec: CacheSpec, lengths: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """Random float32 teacher outputs for (L_enc, L_dec) pairs, in the writer's input format."""
    rng = np.random.default_rng(seed)
    out = []
    for l_enc, l_dec in lengths:
        item = {"encoder/input_ids": rng.integers(0, spec.vocab_size, l_enc),
                "decoder/input_ids": rng.integers(0, spec.vocab_size, l_dec)}
        for stream, size, n in (("encoder", D_ENC, l_enc), ("decoder", D_DEC, l_dec)):
            for j in spec.layers_of("hidden", stream):
                item[f"{stream}/hidden/{j}"] = (rng.normal(size=(n, size)) * 3).astype(np.float32)
            for j in spec.layers_of("attention", stream):
                item[f"{stream}/attention/{j}"] = _probs(rng, n, n)
        for j in spec.layers_of("cross_attention", "decoder"):
            item[f"cross_attention/{j}"] = _probs(rng, l_dec, l_enc)
        if spec.logits == "full":
            item["logits/full"] = (rng.normal(size=(l_dec, spec.vocab_size)) * 5).astype(np.float32)
        else:
            item["logits/topk_values"] = -np.sort(-rng.normal(size=(l_dec, spec.top_k)).astype(np.float32), axis=1)
            item["logits/topk_ids"] = rng.integers(0, spec.vocab_size, (l_dec, spec.top_k))
            item["logits/lse"] = rng.normal(size=l_dec).astype(np.float32)
        out.append(item)
    return out


def stored(spec: CacheSpec, x: np.ndarray) -> np.ndarray:
    """Float values as the cache keeps them: fp16, or bf16 bits in uint16."""
    from kdcache.storage.core.dtypes import float32_to_bf16_bits

    return float32_to_bf16_bits(x) if spec.dtype == "bf16" else x.astype(np.float16)


def expected_seq2seq(spec: CacheSpec, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the reader must return, computed without storage's own encoding code."""
    out = {}
    for name, value in item.items():
        if name.endswith("input_ids"):
            out[name] = value.astype(np.int32)
        elif name in ("logits/topk_ids", "logits/lse"):
            out[name] = value
        elif "attention" in name:
            kept = value if spec.attention_heads is None else value[list(spec.attention_heads)]
            triangle = spec.attention_triangle and name.startswith("decoder/")  # only causal self-attention
            out[name] = stored(spec, np.tril(kept) if triangle else kept)
        else:
            out[name] = stored(spec, value)
    return out


class Seq2SeqSuite:
    """Seq2seq round trips; ``backend`` and ``build``-style helpers come from StorageSuite."""

    backend = ""
    LENGTHS = [(5, 3), (1, 1), (7, 4), (2, 6), (3, 2)]

    def seq2seq_spec(self, **kwargs) -> CacheSpec:
        base = dict(num_sequences=5, backend=self.backend, layout="seq2seq", encoder_hidden_layers=(0, 2),
                    encoder_attention_layers=(1,), decoder_hidden_layers=(2,), decoder_attention_layers=(1, 2),
                    cross_attention_layers=(2,), logits="topk", top_k=4, vocab_size=300, sequences_per_shard=2)
        return CacheSpec.from_dict({**base, **kwargs})  # the manifest's keys, translated to the layer mapping

    def write_seq2seq(self, path: Path, spec: CacheSpec) -> list[dict]:
        seqs = make_seq2seq_sequences(spec, self.LENGTHS)
        with CacheWriter(path, spec, FINGERPRINTS) as writer:
            for k in range(spec.num_shards):
                writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
            writer.finalize()
        return seqs

    @pytest.mark.parametrize("options", [
        dict(logits="full"),
        dict(dtype="bf16", attention_triangle=True, attention_heads=(1, 3)),
    ], ids=["full-fp16", "topk-bf16-triangle-heads"])
    def test_seq2seq_round_trips_bit_exact(self, tmp_path, options):
        spec = self.seq2seq_spec(**options)
        seqs = self.write_seq2seq(tmp_path, spec)
        reader = CacheReader(tmp_path)
        assert reader.manifest.format_version == 4 and reader.spec == spec
        from_shards = list(reader.iter_sequences())
        for i, item in enumerate(seqs):
            want = expected_seq2seq(spec, item)
            for got in (reader[i], from_shards[i]):
                assert set(got) == set(want)
                for name in want:
                    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        l_enc, l_dec = self.LENGTHS[3]
        assert reader[3]["cross_attention/2"].shape[1:] == (l_dec, l_enc)
        assert reader.num_tokens == sum(a + b for a, b in self.LENGTHS)
        assert verify_cache(tmp_path).ok

    def test_each_stream_is_stored_by_its_own_documents(self, tmp_path):
        """Self-attention of packed rows is kept per document of its own stream (encoder and decoder differ)."""
        spec = self.seq2seq_spec(num_sequences=1, sequences_per_shard=1, token_arrays=("position_ids",),
                                 logits=None, cross_attention_layers=())
        rng = np.random.default_rng(3)
        item = {"encoder/input_ids": np.arange(6), "decoder/input_ids": np.arange(4),
                "encoder/position_ids": np.array([0, 1, 2, 0, 1, 2]), "decoder/position_ids": np.array([0, 1, 0, 1]),
                "encoder/hidden/0": rng.random((6, 8)), "encoder/hidden/2": rng.random((6, 8)),
                "decoder/hidden/2": rng.random((4, 8)), "encoder/attention/1": _probs(rng, 6, 6),
                "decoder/attention/1": _probs(rng, 4, 4),
                "decoder/attention/2": _probs(rng, 4, 4)}
        with CacheWriter(tmp_path, spec, FINGERPRINTS) as writer:
            writer.write_shard(0, [item])
            writer.finalize()
        got = CacheReader(tmp_path)[0]
        for stream, docs in (("encoder", [3, 3]), ("decoder", [2, 2])):
            same = np.repeat(np.arange(len(docs)), docs)
            inside = same[:, None] == same[None, :]
            want = stored(spec, np.where(inside, item[f"{stream}/attention/1"], 0))
            np.testing.assert_array_equal(got[f"{stream}/attention/1"], want, err_msg=stream)

    def test_seq2seq_names_groups_and_layer_errors(self, tmp_path):
        spec = self.seq2seq_spec()
        self.write_seq2seq(tmp_path, spec)
        reader = CacheReader(tmp_path)
        assert sorted(reader.get(0, names=["encoder"])) == ["encoder/attention/1", "encoder/hidden/0",
                                                            "encoder/hidden/2", "encoder/input_ids"]
        assert list(reader.get(2, names=["cross_attention"])) == ["cross_attention/2"]
        shard = reader.read_shard(1, names=["decoder/hidden/2"])
        np.testing.assert_array_equal(shard.all_offsets["encoder/offsets"], [0, 7, 9])
        assert shard.sequence(1)["decoder/hidden/2"].shape == (6, D_DEC)
        with pytest.raises(LayerNotInCacheError, match=r"decoder/hidden layer 5 .*cached decoder/hidden layers: \[2\]"):
            reader.get(0, names=["decoder/hidden/5"])
        assert set(spec.features) == {"encoder/hidden", "encoder/attention", "decoder/hidden", "decoder/attention",
                                      "cross_attention", "logits/topk"}

    def test_single_stream_manifest_leaves_out_seq2seq_fields(self, tmp_path):
        single = CacheSpec(num_sequences=2, backend=self.backend, hidden_layers=(1,), sequences_per_shard=2)
        seqs = [{"input_ids": np.arange(3), "hidden/1": np.ones((3, 4), np.float32)},
                {"input_ids": np.arange(2), "hidden/1": np.ones((2, 4), np.float32)}]
        with CacheWriter(tmp_path, single, FINGERPRINTS) as writer:
            writer.write_shard(0, seqs)
            writer.finalize()
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert manifest["format_version"] == 4 and "layout" not in manifest["spec"]
        with pytest.raises(CacheMismatchError, match="spec layout differs"):
            CacheWriter(tmp_path, self.seq2seq_spec(num_sequences=2), FINGERPRINTS)

    def test_seq2seq_bad_inputs_are_refused(self):
        with pytest.raises(SpecError, match="per stream"):
            self.seq2seq_spec(hidden_layers=(1,))
        with pytest.raises(SpecError, match="seq2seq fields"):
            CacheSpec.from_dict({"num_sequences": 1, "encoder_hidden_layers": [1]})
        spec = self.seq2seq_spec()
        seqs = make_seq2seq_sequences(spec, self.LENGTHS[:2])
        seqs[0]["cross_attention/2"] = seqs[0]["cross_attention/2"].transpose(0, 2, 1)  # [H, L_enc, L_dec]
        from kdcache.storage import encode_shard

        with pytest.raises(InvalidSequenceError, match="cross_attention/2"):
            encode_shard(spec, 0, seqs)

    def test_seq2seq_plain_tools(self, tmp_path):
        spec = self.seq2seq_spec()
        seqs = self.write_seq2seq(tmp_path, spec)
        l_enc, l_dec = self.LENGTHS[1]  # shard 0, local sequence 1
        if self.backend == "zarr":
            import zarr

            group = zarr.open_group(str(tmp_path / "shards" / "shard-000000"), mode="r")
            e0, e1 = group["encoder/offsets"][1:3]
            d0, d1 = group["decoder/offsets"][1:3]
            c0, c1 = group["cross_attention_offsets"][1:3]
            hidden = group["encoder/hidden/2"][e0:e1]
            cross = group["cross_attention/2"][c0:c1].T.reshape(-1, d1 - d0, e1 - e0)
            ids = group["decoder/input_ids"][d0:d1]
        else:
            import pyarrow as pa
            import pyarrow.ipc

            with pa.memory_map(str(tmp_path / "shards" / "shard-000000.arrow")) as source:
                table = pa.ipc.open_stream(source).read_all()
            cell = table.column("encoder/hidden/2")[1].values
            hidden = cell.flatten().to_numpy(zero_copy_only=False).reshape(-1, cell.type.list_size)
            rows = table.column("cross_attention/2")[1].values
            flat = rows.flatten().to_numpy(zero_copy_only=False).reshape(-1, rows.type.list_size)
            cross = flat.T.reshape(-1, l_dec, l_enc)
            ids = table.column("decoder/input_ids")[1].values.to_numpy()
        np.testing.assert_array_equal(hidden, seqs[1]["encoder/hidden/2"].astype(np.float16))
        np.testing.assert_array_equal(cross, seqs[1]["cross_attention/2"].astype(np.float16))
        np.testing.assert_array_equal(ids, seqs[1]["decoder/input_ids"])
