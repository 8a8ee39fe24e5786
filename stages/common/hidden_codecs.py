"""The torch twin of ``storage.hidden_codecs``: encode on the teacher's device, decode on the training device.

Stage one calls ``encode`` on a padded ``[B, L, d]`` activation before anything crosses to the host, so the host,
the disk and the object store carry only codes and scales. Stage two calls ``decode_batch`` right after the copy
to its device (``streaming.to_device``), the way fp16 becomes fp32 there. The arrays and the formulas are those
of ``storage.hidden_codecs`` (the numpy reference ``verify`` and docs/cache-format.md use); the random signs
come from the same numpy generator, so both sides rotate alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kdcache.storage import (
    FP8_MAX,
    applies_to,
    block_size,
    check_width,
    codec_of,
    group_count,
    hadamard_matrix,
    is_part,
    part_name,
    projected,
    rank_of,
    rotation_signs,
)

if TYPE_CHECKING:
    from kdcache.storage import CacheReader

Record = dict[str, Any]  # a resolved {"name", "configuration"} codec record (spec.hidden_codec)


@dataclass
class Projection:
    """A rank codec's bases as torch tensors (``storage.projection``), copied to each device once.

    Attributes:
        bases: array name -> (basis ``[R, d]``, mean ``[d]``) float32, on the host.
        fitting: stage one's fit mode: no bases yet, and projected layers come out of ``encode``'s caller as
            float32 states for the fit to read (``capture.hidden_targets``), never for storage.
    """

    bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    fitting: bool = False
    _on: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_arrays(cls, bases: dict[str, tuple[Any, Any]]) -> Projection:
        """From ``storage.projection.read_projection``'s numpy pairs."""
        return cls({name: (torch.from_numpy(b.copy()), torch.from_numpy(m.copy())) for name, (b, m) in bases.items()})

    def on(self, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(basis ``[R, d]``, mean ``[d]``) of ``name`` on ``device``."""
        key = (name, str(device))
        if key not in self._on:
            if name not in self.bases:
                raise KeyError(f"{name}: no projection basis for it (the cache's projection/ holds "
                               f"{sorted(self.bases)})")
            self._on[key] = tuple(t.to(device) for t in self.bases[name])  # type: ignore[assignment]
        return self._on[key]

    def width(self, name: str) -> int:
        """The hidden size d that ``name``'s basis maps back to."""
        return int(self.on(name, torch.device("cpu"))[0].shape[1])


def quantised(record: Record) -> bool:
    """Whether the codec stores codes (fp8, int8, int4) rather than floats."""
    return codec_of(record).float_dtype is None


def _signs(record: Record, d: int, device: torch.device) -> torch.Tensor:
    return _signs_on(record["configuration"]["rotation"], d, device)


@functools.lru_cache(maxsize=32)
def _signs_on(seed: int, d: int, device: torch.device) -> torch.Tensor:
    """The rotation's ``[d]`` signs on ``device``, made once: a copy from pageable host memory at every layer of
    every batch made the host wait for the device each time (CUDA syncs the stream before such a copy), so the
    GPU's queue of batches ahead ran dry in stage one and in stage two's decode."""
    return torch.from_numpy(rotation_signs(seed, d)).to(device)


@functools.lru_cache(maxsize=8)
def _hadamard_on(b: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(hadamard_matrix(b)).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard transform of ``x [N, d]`` (float32) in blocks of ``block_size(d)``: one dense
    ``[b, b]`` matmul, which a GPU runs on its matrix units (a butterfly would take log2(b) passes over memory)."""
    n, d = x.shape
    b = block_size(d)
    return (x.reshape(n, d // b, b) @ _hadamard_on(b, x.device)).reshape(n, d)


def _scale_up(scale: torch.Tensor) -> torch.Tensor:
    """float32 -> fp16, never below the float32 value (so no scaled value passes the codec's maximum)."""
    half = scale.to(torch.float16)
    return torch.where(half.float() < scale, torch.nextafter(half, half.new_tensor(float("inf"))), half)


def _quantize(record: Record, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated rows ``[N, d]`` -> (codes ``[N, d']``, fp16 scales ``[N, G]``)."""
    codec, n = codec_of(record), y.shape[0]
    blocks = y.reshape(n, group_count(record, y.shape[1]), -1)
    if codec.rms_step:  # ``storage.hidden_codecs._quantize``'s uniform step, clipped at qmax steps
        scale = (record["configuration"]["step"] * blocks.square().mean(-1).sqrt()).to(torch.float16)
    else:
        scale = _scale_up(blocks.abs().amax(-1) / codec.qmax)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32)).unsqueeze(-1)
    scaled = (blocks / safe).clamp(-codec.qmax, codec.qmax).reshape(n, -1)
    if codec.name == "fp8":  # clamped to +-448 first: the cast never makes NaN
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale
    q = torch.round(scaled).to(torch.int16)
    if codec.name == "int4":
        nibbles = (q + 8).to(torch.uint8).reshape(n, -1, 2)
        return nibbles[..., 0] | (nibbles[..., 1] << 4), scale
    return q.to(torch.int8), scale


def _dequantize(record: Record, codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, d']`` -> values before the scale ``[N, d]`` float32."""
    if record["name"] == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    if record["name"] == "int4":
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1)
        return nibbles.float() - 8
    return codes.float()


def decode_rows(record: Record, codes: torch.Tensor, scale: torch.Tensor, outliers: torch.Tensor | None = None,
                outlier_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows: codes ``[N, d']``, scales ``[N, G]``, outliers and their ids ``[N, m]`` -> ``[N, d]`` float32."""
    y = _dequantize(record, codes)
    n, d = y.shape
    y = (y.reshape(n, scale.shape[1], -1) * scale.float().unsqueeze(-1)).reshape(n, d)
    if record["configuration"]["rotation"] is not None:
        y = hadamard(y) * _signs(record, d, y.device)
    if outliers is not None and outlier_ids is not None and outliers.numel():
        y = y.scatter_add(1, outlier_ids.long(), outliers.float())
    return y


def encode(record: Record, name: str, x: torch.Tensor, projection: Projection | None = None
           ) -> dict[str, torch.Tensor]:
    """Encode ``x [..., d]`` on its device -> ``name``'s codes and companions ``[..., w]`` and per-row errors
    ``[..., 5]`` (``storage.hidden_codecs.row_errors``'s columns), all still on the device.

    With a rank codec, ``name``'s rows are projected first, ``(x - mean) @ basis.T`` ``[..., R]``, and the errors
    are measured against the unprojected rows, so the projection's loss shows in them.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.detach().reshape(-1, d).float()
    coded = rows
    if projected(record, name):
        if projection is None:
            raise ValueError(f"{name}: a rank-{rank_of(record)} codec needs its projection basis to encode")
        basis, mean = projection.on(name, rows.device)
        coded = (rows - mean) @ basis.T
    out, decoded = _encode_rows(record, name, coded)
    if projected(record, name):
        decoded = decoded @ basis + mean
    out[part_name(name, "error")] = row_errors(rows, decoded)
    return {key: value.reshape(*lead, value.shape[-1]) for key, value in out.items()}


def _encode_rows(record: Record, name: str, rows: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rows ``[N, w]`` float32 -> (codes and companions of ``name``, their decode ``[N, w]``).

    The outliers are kept aside in fp16 and subtracted before the rotation, so the fp16 rounding of each stays in
    the quantised residual.
    """
    d = rows.shape[1]
    check_width(record, name, d)
    residual, out = rows, {}
    m = min(record["configuration"]["outliers"], d)
    outliers = ids = None
    if m:
        ids = rows.abs().topk(m, dim=1).indices.sort(dim=1).values
        outliers = rows.gather(1, ids).to(torch.float16)
        residual = rows.scatter_add(1, ids, -outliers.float())
        out[part_name(name, "outliers")] = outliers
        out[part_name(name, "outlier_ids")] = ids.to(torch.int16)  # uint16 on the host (d <= 32767 here)
    if record["configuration"]["rotation"] is not None:
        residual = hadamard(residual * _signs(record, d, rows.device))
    codes, scale = _quantize(record, residual)
    out[name], out[part_name(name, "scale")] = codes, scale
    return out, decode_rows(record, codes, scale, outliers, ids)


def row_errors(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """Per row ``[N, 5]``: squared error, squared norm, cosine (1 for two zero rows), max |error|, decoded norm²."""
    err = decoded - x
    ref_sq, decoded_sq = x.square().sum(1), decoded.square().sum(1)  # each pass once: the norms reuse them
    norms = (ref_sq * decoded_sq).sqrt()
    cosine = torch.where(norms > 0, (x * decoded).sum(1) / norms.clamp_min(1e-30), torch.ones_like(norms))
    return torch.stack([err.square().sum(1), ref_sq, cosine, err.abs().amax(1), decoded_sq], dim=1)


def decode_batch(record: Record, batch: dict[str, Any], projection: Projection | None = None) -> dict[str, Any]:
    """Replace each coded ``[B, L, d']`` target of a batch on its device by its float32 ``[B, L, d]`` decode, and
    drop the companions; a rank codec's coefficients ``[B, L, R]`` are mapped back through ``projection``
    (``coef @ basis + mean``). A float codec's batch is returned as it is."""
    if not quantised(record):
        return batch
    out = {k: v for k, v in batch.items() if not is_part(k)}
    for name in [k for k in batch if applies_to(k)]:
        rows = [_rows(batch, part_name(name, part)) for part in ("scale", "outliers", "outlier_ids")]
        decoded = decode_rows(record, _rows(batch, name), *rows)
        if projected(record, name):
            if projection is None:
                raise ValueError(f"{name}: a rank-{rank_of(record)} cache decodes through its projection bases")
            basis, mean = projection.on(name, decoded.device)
            decoded = decoded @ basis + mean
        out[name] = decoded.reshape(*batch[name].shape[:-1], decoded.shape[-1])
    return out


def _rows(batch: dict[str, Any], name: str) -> Any:
    """``batch[name]`` ``[..., w]`` as rows ``[N, w]``, or None when the batch has no such array."""
    return batch[name].reshape(-1, batch[name].shape[-1]) if name in batch else None


def load_projection(reader: CacheReader) -> Projection | None:
    """The bases of a rank cache (``storage.projection``) from a ``CacheReader``; None without a projection."""
    from kdcache.storage import read_projection

    record, rank = reader.spec.hidden_codec, rank_of(reader.spec.hidden_codec)
    if rank is None:
        return None
    names = [n for n in reader.spec.sequence_names() if projected(record, n)]
    return Projection.from_arrays(read_projection(reader.store, names, rank))


def stored_width(record: Record, d: int) -> int:
    """Columns of a coded array for hidden size d (int4 packs two channels per byte)."""
    return d // codec_of(record).per_code


def hidden_width(record: Record, stored: int, projected_width: int | None = None) -> int:
    """Hidden size d of a coded array with ``stored`` columns (the inverse of ``stored_width``); a projected
    array's is its basis's width, ``projected_width``."""
    if rank_of(record) is not None and projected_width is not None:
        return projected_width
    return stored * codec_of(record).per_code


__all__ = ["FP8_MAX", "Projection", "decode_batch", "decode_rows", "encode", "hidden_width", "load_projection",
           "quantised", "row_errors", "stored_width"]
