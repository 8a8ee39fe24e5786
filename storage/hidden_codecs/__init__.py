"""Hidden-state codecs: a class per codec (a module per family), registered by name (``base.register``), each
encoding and decoding once against the array API (``arrays``): storage's numpy and the devices' torch run one code.

A codec is recorded in the spec as ``{"name": ..., "configuration": {...}}`` (like a zarr v3 codec) and
configured by its typed dataclass (``spec.hidden_codec.config``). Two kinds:

* float codecs (``fp16``, ``bf16``): the layer is stored as that float type, as before this registry existed;
* quantised codecs (``fp8``, ``int8``, ``int7``, ``int4``, ``pca8``; ``quantised``): the layer ``x [T, d]`` is
  stored as plain arrays

  - ``hidden/{j}``: codes ``[T, d]`` (int8 and int7 as int8; fp8 e4m3 bit patterns as uint8) or ``[T, d/2]``
    (int4: two codes per uint8, the even channel in the low nibble, each stored as ``q + 8``);
  - ``hidden_scale/{j}``: fp16 scales ``[T, G]``, one per row (G = 1) or per group of ``group`` channels (int4);
  - ``hidden_outliers/{j}`` (fp16) and ``hidden_outlier_ids/{j}`` (uint16) ``[T, m]`` when ``outliers`` m > 0:
    each row's m largest |values|, kept aside exactly (fp16) and subtracted before quantising.

  Decoding (docs/cache-format.md): ``y = dequant(codes) * scale``; ``x = signs * H(y)`` per block of ``b``
  channels when ``rotation`` is a seed (``H`` the orthonormal Sylvester-Hadamard matrix, ``b`` the largest power
  of two dividing d but at most 256, ``signs`` = ``default_rng(seed).integers(0, 2, d) * 2 - 1``); then
  ``x[ids] += outliers``; with a ``rank``, ``coef @ basis + mean`` (``coding``).

Importing this package imports every codec module beside the shared ones, and each registers its codecs: a new
codec is one new module here (or anywhere that calls ``register``; tests/stages/targets/hidden/test_codec_plugin.py
does).
"""

from __future__ import annotations

from typing import Any

from kdcache.storage.core.registry import import_members
from kdcache.storage.hidden_codecs.arrays import (
    FP8_MAX as FP8_MAX,
    fp8_table as fp8_table,
    namespace as namespace,
    register_ops as register_ops,
    row_errors as row_errors,
)
from kdcache.storage.hidden_codecs.base import (
    HIDDEN_CODECS as HIDDEN_CODECS,
    HiddenCodec as HiddenCodec,
    get as get,
    listing as listing,
    names as names,
    register as register,
    usage as usage,
)
from kdcache.storage.hidden_codecs.coding import (
    CODED_KINDS as CODED_KINDS,
    ERROR_FIELDS as ERROR_FIELDS,
    PARTS as PARTS,
    applies_to as applies_to,
    decode as decode,
    encode as encode,
    error_record as error_record,
    hidden_codec_of as hidden_codec_of,
    is_part as is_part,
    part_name as part_name,
    part_of as part_of,
    projected as projected,
    resolve_hidden_codec as resolve_hidden_codec,
)
from kdcache.storage.hidden_codecs.quantised import QuantisedCodec as QuantisedCodec

import_members(__name__, __path__, but=("arrays", "base", "coding", "quantised"))

# Codes are near-Gaussian bytes: zstd's entropy coding shrinks them (int8 by ~7%, int7 by ~20%), and bit-shuffling
# them first, which helps fp16, hides that (measured in benchmarks/RESULTS.md). Zarr caches compress them so.
# Each compressor is chosen by bytes saved per CPU-second on the codec's real output (MiniLM's layers 2, 4, 6;
# RESULTS.md, "Compressors that keep up"): zstd level 1 over 1 MiB blocks saves what level 5 saved on int8 codes
# (ratio 1.078 both) at 1.0 GB/s a core against 0.7-0.8. Caches written before keep theirs (zarr reads each
# array's codecs from its own metadata), and the codes' compressor is no part of the fingerprints.
CODES_CODEC: dict[str, Any] = {"id": "blosc", "cname": "zstd", "clevel": 1, "shuffle": 0, "blocksize": 1 << 20}
# A column-major codec's codes (after the row shuffle each zstd block holds a few directions of one variance each)
# take the same: level 9 reached 2.33x on pca8's codes at 3.6 MB/s a core (a teacher writing 2 GB/s of codes would
# need hundreds of cores: the 0.037x of benchmarks/RESULTS.md run 4); level 1 keeps 2.25x (97% of it) at 474 MB/s.
COLUMN_CODES_CODEC = CODES_CODEC
