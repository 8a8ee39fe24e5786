"""Hidden codecs on the devices: torch tensors through the one implementation in ``storage.hidden_codecs``.

Every function takes the configured codec (``storage.HiddenCodec``, ``spec.hidden_codec``), resolved once where
the options or the manifest are read.

Stage one calls ``encode`` on a padded ``[B, L, d]`` activation before anything crosses to the host, so the host,
the disk and the object store carry only codes and scales. Stage two calls ``decode_batch`` right after the copy
to its device (``streaming.to_device``), the way fp16 becomes fp32 there. The codecs themselves are written once
against the array API (``storage.hidden_codecs.arrays``); this module registers the few operations torch adds to
it (``TorchOps``: a top-k, a scatter-add, the float8 cast) and reshapes the batches into rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from array_api_compat import array_namespace

from kdcache.storage import (
    PARTS,
    HiddenCodec,
    applies_to,
    hidden_codecs as storage_codecs,
    is_part,
    part_name,
    projected,
    read_projection,
    register_ops,
)

if TYPE_CHECKING:
    from kdcache.storage import CacheReader

class TorchOps:
    """torch's additions to the array API for the codecs (``storage.hidden_codecs.arrays.ArrayOps``): kernels
    that stay on the device, with no host sync."""

    def top_ids(self, a: torch.Tensor, m: int) -> torch.Tensor:
        return a.topk(m, dim=1).indices.sort(dim=1).values

    def add_at_rows(self, y: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return y.scatter_add(1, ids.long(), values)

    def fp8_bits(self, v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.float8_e4m3fn).view(torch.uint8)  # round to nearest even, as NumpyOps.fp8_bits

    def fp8_values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float()

    def id_dtype(self) -> torch.dtype:
        return torch.int16  # uint16 on the host (d <= 32767): torch has few uint16 kernels

    def sum_dtype(self, like: torch.Tensor) -> torch.dtype:
        return torch.float32 if like.device.type == "mps" else torch.float64  # MPS has no float64


register_ops(array_namespace(torch.empty(0)).__name__, TorchOps())


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


def _bases(codec: HiddenCodec, name: str, projection: Projection | None, device: torch.device, what: str
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{name: (basis, mean)}`` on ``device`` for a projected ``name``; None for one coded as it is."""
    if not projected(codec, name):
        return None
    if projection is None:
        raise ValueError(f"{name}: a rank-{codec.rank} {what}")
    return {name: projection.on(name, device)}


def quantised(codec: HiddenCodec) -> bool:
    """Whether the codec stores codes (fp8, int8, int4, ...) rather than floats."""
    return codec.float_dtype is None


def encode(codec: HiddenCodec, name: str, x: torch.Tensor, projection: Projection | None = None
           ) -> dict[str, torch.Tensor]:
    """Encode ``x [..., d]`` on its device -> ``name``'s codes and companions ``[..., w]`` and per-row errors
    ``[..., 5]`` (``storage.hidden_codecs.row_errors``'s columns), all still on the device.

    With a rank codec, ``name``'s rows are projected first, ``(x - mean) @ basis.T`` ``[..., R]``, and the errors
    are measured against the unprojected rows, so the projection's loss shows in them.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.detach().reshape(-1, d).float()
    bases = _bases(codec, name, projection, rows.device, "codec needs its projection basis to encode")
    out = storage_codecs.encode(codec, name, rows, bases)
    return {key: value.reshape(*lead, value.shape[-1]) for key, value in out.items()}


def decode_batch(codec: HiddenCodec, batch: dict[str, Any], projection: Projection | None = None) -> dict[str, Any]:
    """Replace each coded ``[B, L, d']`` target of a batch on its device by its float32 ``[B, L, d]`` decode, and
    drop the companions; a rank codec's coefficients ``[B, L, R]`` are mapped back through ``projection``
    (``coef @ basis + mean``). A float codec's batch is returned as it is."""
    if not quantised(codec):
        return batch
    out = {k: v for k, v in batch.items() if not is_part(k)}
    for name in [k for k in batch if applies_to(k)]:
        keys = [key for key in (name, *(part_name(name, p) for p in PARTS)) if key in batch]
        rows = {key: batch[key].reshape(-1, batch[key].shape[-1]) for key in keys}  # [..., w] -> [N, w]
        device = batch[name].device
        bases = _bases(codec, name, projection, device, "cache decodes through its projection bases")
        decoded = storage_codecs.decode(codec, rows, name, bases)
        out[name] = decoded.reshape(*batch[name].shape[:-1], decoded.shape[-1])
    return out


def load_projection(reader: CacheReader) -> Projection | None:
    """The bases of a rank cache (``storage.projection``) from a ``CacheReader``; None without a projection."""
    codec, rank = reader.spec.hidden_codec, reader.spec.hidden_codec.rank
    if rank is None:
        return None
    names = [n for n in reader.spec.sequence_names() if projected(codec, n)]
    return Projection.from_arrays(read_projection(reader.store, names, rank))


def hidden_width(codec: HiddenCodec, stored: int, projected_width: int | None = None) -> int:
    """Hidden size d of a coded array with ``stored`` columns (the inverse of the codec's stored width); a projected
    array's is its basis's width, ``projected_width``."""
    if codec.rank is not None and projected_width is not None:
        return projected_width
    return stored * codec.per_code
