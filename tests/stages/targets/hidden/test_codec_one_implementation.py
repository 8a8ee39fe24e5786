"""The hidden codecs are one implementation: ``storage.hidden_codecs`` encodes and decodes numpy arrays and torch
tensors with the same functions, so the same rows give the same stored bytes on either library.

The only library-specific pieces are the operations the array API lacks (``ArrayOps``: top-k, scatter-add, the
float8 rounding), checked here against each other value by value, and each library's own matmul and sums. A
matmul rounds in its BLAS's own order (which changes with the CPU's vector width), so the rows below are integers
whose rotations are exact in float32 (|values| <= d, blocks of 256: every Hadamard entry is +-1/16; decoding
rotates integer codes before a row's scale, and int4's and fp8's products of codes and scales need at most 24
bits here); the error sums are accumulated in float64, so they come out alike too. Any difference left is the
codecs'. The last two tests feed rows on which float32 sums do depend on their order.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kdcache.storage
from kdcache.stages.targets.hidden.device_codecs import TorchOps, decode_batch
from kdcache.storage.hidden_codecs import (
    FP8_MAX,
    HIDDEN_CODECS,
    decode,
    encode,
    fp8_table,
    hidden_codec_of,
    names,
    row_errors,
)
from kdcache.storage.hidden_codecs.arrays import NumpyOps, hadamard_matrix, rotation_signs

QUANTISED = [n for n in names() if not HIDDEN_CODECS[n].float_dtype]
VARIANTS = [{}, {"rotation": None}, {"outliers": 0}, {"rotation": 7, "outliers": 3}, {"group": 16}]


def _configurations() -> list[tuple[str, dict]]:
    """Every quantised codec with each configuration it accepts (pca8 takes its step only)."""
    out = []
    for name in QUANTISED:
        variants = [{}, {"step": 0.5}] if HIDDEN_CODECS[name].full_rank else VARIANTS
        out += [(name, v) for v in variants]
    return out


def _integer_rows(n: int = 40, d: int = 256, seed: int = 0, zeros: bool = False) -> np.ndarray:
    """``[n, d]`` float32: each row a signed permutation of 1..d (distinct magnitudes, so the top-m outliers have
    no ties: each library breaks those its own way); with ``zeros``, an all-zero row and one of a single value
    (where the rotation makes -0.0)."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(d) + 1 for _ in range(n)]) * rng.choice([-1, 1], (n, d))
    if zeros:
        rows[3] = 0
        rows[5, :] = 0
        rows[5, 17] = -d
    return rows.astype(np.float32)


@pytest.mark.parametrize(("name", "configuration"), _configurations())
def test_numpy_and_torch_store_the_same_bytes(name: str, configuration: dict) -> None:
    record = hidden_codec_of({"name": name, "configuration": configuration}, "fp16")
    x = _integer_rows(zeros=not record.config.outliers)
    on_numpy = encode(record, "hidden/1", x)
    on_torch = {k: v.numpy() for k, v in encode(record, "hidden/1", torch.from_numpy(x)).items()}
    assert set(on_numpy) == set(on_torch)
    for key in on_numpy:  # the error record too: it is what verify and inspect read back
        got, want = on_torch[key], on_numpy[key]
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), key  # int16 ids read as uint16
    stored = {k: v for k, v in on_numpy.items() if "error" not in k}
    from_numpy = decode(record, stored, "hidden/1")
    batch = {k: torch.from_numpy(v.view(np.int16) if v.dtype == np.uint16 else v) for k, v in stored.items()}
    from_torch = decode_batch(record, batch)["hidden/1"].numpy()
    assert from_torch.tobytes() == from_numpy.tobytes()



def _offset_rows(n: int = 16, d: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a large offset and a small spread, and a decode of them off by a little: float32 sums of their
    squares round differently in every order (numpy's pairwise blocks, torch's vector lanes)."""
    rng = np.random.default_rng(3)
    x = (1000 + rng.standard_normal((n, d))).astype(np.float32)
    return x, (x + 0.01 * rng.standard_normal((n, d))).astype(np.float32)


def test_the_error_sums_do_not_depend_on_either_librarys_order() -> None:
    """The row sums are accumulated in float64: numpy, torch and numpy on reordered columns store the same bytes,
    those of the float64 sums of the float32 products rounded once."""
    x, decoded = _offset_rows()
    on_numpy = row_errors(x, decoded)
    assert row_errors(torch.from_numpy(x), torch.from_numpy(decoded)).numpy().tobytes() == on_numpy.tobytes()
    order = np.random.default_rng(4).permutation(x.shape[1])
    assert row_errors(x[:, order], decoded[:, order]).tobytes() == on_numpy.tobytes()
    err = decoded - x
    assert (on_numpy[:, 0] == (err * err).sum(axis=1, dtype=np.float64).astype(np.float32)).all()


def test_a_row_scale_is_applied_after_the_rotation() -> None:
    """int8 keeps one scale per row: decoding rotates the integer codes (exact in float32) and then scales, so
    both libraries give each value correctly rounded, whatever their matmul's order. Scaled first, the sums of
    code * scale rounded in each BLAS's order: one ulp at |x| = 256, 0.4% of a row that decodes almost exactly."""
    record = hidden_codec_of({"name": "int8", "configuration": {"outliers": 0}}, "fp16")
    x = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32) * 100
    x[0] = 0
    x[0, 17] = -256  # the row of the report: one value, decoded to within 0.23
    stored = {k: v for k, v in encode(record, "hidden/1", x).items() if "error" not in k}
    codes, scale = stored["hidden/1"].astype(np.float64), stored["hidden_scale/1"].astype(np.float64)
    signs = rotation_signs(0, 256).astype(np.float64)
    exact = ((codes @ hadamard_matrix(256).astype(np.float64)) * scale * signs).astype(np.float32)
    assert decode(record, stored, "hidden/1").tobytes() == exact.tobytes()
    batch = {k: torch.from_numpy(v) for k, v in stored.items()}
    assert decode_batch(record, batch)["hidden/1"].numpy().tobytes() == exact.tobytes()


@pytest.mark.parametrize("d", [384, 640])
def test_a_row_scale_decodes_alike_where_the_blocks_are_not_256(d: int) -> None:
    """Blocks of 128 (d = 384, MiniLM's width) or 128 again (640): 1/sqrt(b) is no power of two, so a matmul by the
    normalised matrix rounds in each BLAS's order. Decoding sums the codes against the +-1 matrix (exact) and
    applies scale / sqrt(b) once, elementwise: both libraries decode numpy's stored codes to the same bytes, each
    value within a rounding or two of the float64 decode."""
    record = hidden_codec_of({"name": "int8", "configuration": {"outliers": 0}}, "fp16")
    x = np.random.default_rng(6).standard_normal((64, d)).astype(np.float32) * 100
    stored = {k: v for k, v in encode(record, "hidden/1", x).items() if "error" not in k}
    on_numpy = decode(record, stored, "hidden/1")
    batch = {k: torch.from_numpy(v) for k, v in stored.items()}
    assert decode_batch(record, batch)["hidden/1"].numpy().tobytes() == on_numpy.tobytes()
    b = d & -d
    codes, scale = stored["hidden/1"].astype(np.float64), stored["hidden_scale/1"].astype(np.float64)
    blocks = codes.reshape(64, d // b, b) @ hadamard_matrix(b).astype(np.float64)
    exact = blocks.reshape(64, d) * scale * rotation_signs(0, d).astype(np.float64)
    np.testing.assert_allclose(on_numpy, exact, rtol=3e-7, atol=0)


def _fp8_probe_values() -> np.ndarray:
    """Every finite e4m3fn value, every midpoint between neighbours (the ties) and the float32 values next to
    each, signed zeros, subnormals and random values within +-448."""
    table = fp8_table()[:127].astype(np.float64)
    mids = (table[:-1] + table[1:]) / 2
    near = np.concatenate([np.nextafter(mids.astype(np.float32), np.float32(0)),
                           np.nextafter(mids.astype(np.float32), np.float32(np.inf))])
    rng = np.random.default_rng(1)
    rand = rng.uniform(-FP8_MAX, FP8_MAX, 20000) * 2.0 ** rng.integers(-20, 1, 20000)
    positive = np.concatenate([table, mids, near, [0.0, 1e-30, 2.0 ** -10, FP8_MAX]]).astype(np.float32)
    return np.concatenate([positive, -positive, rand.astype(np.float32), np.float32([-0.0])])


def test_float8_rounding_is_the_same_on_both_libraries() -> None:
    values = _fp8_probe_values()
    got = TorchOps().fp8_bits(torch.from_numpy(values)).numpy()
    want = NumpyOps().fp8_bits(values)
    assert (got == want).all(), values[got != want][:10]
    assert want[-1] == 0x80  # -0.0 keeps its sign, as a float8 cast does
    table = fp8_table()
    mids = (table[1:126].astype(np.float64) + table[2:127]) / 2  # a tie rounds to the even mantissa
    codes = NumpyOps().fp8_bits(mids.astype(np.float32))
    assert (codes % 2 == 0).all()
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    assert (TorchOps().fp8_values(torch.from_numpy(finite)).numpy() == NumpyOps().fp8_values(finite)).all()


def test_the_added_operations_agree() -> None:
    a = np.abs(_integer_rows())
    ids = NumpyOps().top_ids(a, 5)
    assert (TorchOps().top_ids(torch.from_numpy(a), 5).numpy() == ids).all()
    assert (ids == np.sort(np.argsort(-a, axis=1)[:, :5], axis=1)).all()
    values = np.random.default_rng(2).standard_normal(ids.shape).astype(np.float32)
    want = a.copy()
    for row in range(len(a)):
        want[row, ids[row]] += values[row]
    assert (NumpyOps().add_at_rows(a, ids, values) == want).all()
    got = TorchOps().add_at_rows(torch.from_numpy(a), torch.from_numpy(ids).to(torch.int16), torch.from_numpy(values))
    assert (got.numpy() == want).all()


def _compares_a_codec_name(source: str) -> list[str]:
    """The lines of ``source`` that compare a quantised codec's name (``== "int8"``, ``in ("fp8", ...``)."""
    quantised = "|".join(QUANTISED)
    pattern = re.compile(rf"""(==|!=|\bin\s*[(\[{{])\s*['"]({quantised})['"]|['"]({quantised})['"]\s*(==|!=)""")
    return [line for line in source.splitlines() if pattern.search(line)]


def test_no_file_compares_a_codec_name() -> None:
    """What a codec does is its class's business: no module of the package compares a codec's name (fp16 and
    bf16 are dtype names too, and stay out of this check)."""
    root = Path(kdcache.storage.__file__).parent.parent
    paths = [p for top in ("storage", "stages", "pipeline") for p in (root / top).rglob("*.py")
             if p.parent != root / "storage" / "hidden_codecs"]
    assert len(paths) > 100
    found = {str(p): lines for p in paths for lines in [_compares_a_codec_name(p.read_text())] if lines}
    assert not found
    assert _compares_a_codec_name('    if record["name"] == "fp8":\n    x = 1\n    if name in ("int4", "int8"):') == [
        '    if record["name"] == "fp8":', '    if name in ("int4", "int8"):']  # a planted example is caught


def test_the_codecs_are_written_once() -> None:
    """No codec module, and neither side, compares a codec name or names an array library."""
    import inspect

    import kdcache.stages.targets.hidden.device_codecs as device_side
    import kdcache.storage.hidden_codecs.coding as coding
    import kdcache.storage.hidden_codecs.quantised as quantised

    sources = [inspect.getsource(m) for m in (device_side, coding, quantised)]
    sources += [inspect.getsource(inspect.getmodule(cls)) for cls in HIDDEN_CODECS.values()]  # type: ignore[arg-type]
    for source in sources:
        for name in HIDDEN_CODECS:
            assert f'== "{name}"' not in source and f"'{name}' ==" not in source, name
    for cls in HIDDEN_CODECS.values():
        module = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        assert "import numpy" not in module and "import torch" not in module, cls.name
