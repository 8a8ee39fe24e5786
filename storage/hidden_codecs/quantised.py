"""What every quantised codec shares: outliers kept aside, a seeded rotation, one fp16 scale per row or group.

Encoding a row ``x [d]``: its m largest |values| are kept aside exactly (fp16, with their column ids) and
subtracted; the residual is rotated (``hadamard(residual * signs)``, when ``rotation`` is a seed), scaled by one
fp16 scale per row or per group, and turned into codes by the codec (``to_codes``). Decoding runs it backwards
(docs/cache-format.md). A codec module defines only its codes and, where it differs, its scales.

Why a rotation: real activations have a few channels 100-1000x larger than the rest, and one scale per row set
by those flattens every other channel to zero; a seeded random rotation spreads them over a block first. The
largest few are also kept aside, because even spread they dominate the row's scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kdcache.storage.core.errors import SpecError
from kdcache.storage.hidden_codecs.arrays import Array, hadamard, integer_hadamard, namespace, ops_for, scale_up, signs
from kdcache.storage.hidden_codecs.base import HiddenCodec, NoConfig, is_int

MAX_WIDTH = 32767  # outlier ids are stored as uint16 (int16 on a device without uint16 kernels)


@dataclasses.dataclass(frozen=True)
class QuantConfig(NoConfig):
    """A quantised codec's configuration.

    Attributes:
        rotation: the rotation's seed, or None for no rotation.
        outliers: m, the largest |values| per row kept aside (0..64).
        group: channels per scale for a grouped codec (even, >= 2; the whole row when d <= group).
        rank: R of a projection onto the teacher's principal directions (``storage.projection``), or None.
    """

    rotation: int | None = 0
    outliers: int = 4
    group: int = 64
    rank: int | None = None

    def check(self, name: str) -> None:
        """Refuse a bad value, naming it and what was expected."""
        if self.rank is not None and not (is_int(self.rank) and self.rank >= 1):
            raise SpecError(f"hidden codec {name!r}: rank must be an integer >= 1 (the projection's R), got "
                            f"{self.rank!r}")
        if self.rotation is not None and not (is_int(self.rotation) and self.rotation >= 0):
            raise SpecError(f"hidden codec rotation must be a seed >= 0 or null, got {self.rotation!r}")
        if not (is_int(self.outliers) and 0 <= self.outliers <= 64 and is_int(self.group) and self.group >= 2
                and self.group % 2 == 0):
            raise SpecError(f"hidden codec {name!r}: outliers must be an integer 0..64 and group an even integer "
                            f">= 2, got {self.outliers!r} and {self.group!r}")


class QuantisedCodec(HiddenCodec):
    """The shared encode and decode; a codec module adds ``to_codes`` / ``from_codes`` (and ``scales`` where its
    scale is not the largest |value| / qmax)."""

    Config = QuantConfig
    config: QuantConfig

    @classmethod
    def configure(cls, raw: dict[str, Any]) -> HiddenCodec:
        keys = [field.name for field in dataclasses.fields(cls.Config)]
        unknown = sorted(set(raw) - set(keys))
        if unknown:
            raise SpecError(f"hidden codec {cls.name!r}: unknown configuration {unknown}; expected keys "
                            f"{sorted(keys)}")
        config = cls.Config(**raw)
        config.check(cls.name)
        return cls(config)

    def parts(self) -> tuple[str, ...]:
        return ("scale", "outliers", "outlier_ids") if self.config.outliers else ("scale",)

    def width_expectation(self, d: int) -> str | None:
        return f"d <= {MAX_WIDTH}" if d > MAX_WIDTH else None

    def describe(self) -> str:
        """The settings it uses, for ``inspect``: ``rotation seed 0, outliers 4`` (the group only where scales
        are grouped, outliers only when kept)."""
        shown = []
        for key, value in self.record()["configuration"].items():
            if key == "rotation":
                shown.append(f"rotation seed {value}" if value is not None else "no rotation")
            elif key not in self.unused_keys() and not (key == "outliers" and not value):
                shown.append(f"{key} {value}")
        return ", ".join(shown)

    def unused_keys(self) -> frozenset[str]:
        """Configuration keys its coding ignores (a codec with one scale per row has no use for ``group``)."""
        return frozenset({"group"})

    # ---- the codes: one module per codec ----------------------------------------------------------------
    def to_codes(self, scaled: Array) -> Array:
        """Scaled values ``[N, d]`` float32 within +-qmax -> stored codes ``[N, d / per_code]``."""
        raise NotImplementedError

    def from_codes(self, codes: Array) -> Array:
        """Stored codes ``[N, d / per_code]`` -> values before the scale ``[N, d]`` float32."""
        raise NotImplementedError

    def scales(self, blocks: Array) -> Array:
        """Blocks ``[N, G, d / G]`` float32 -> fp16 scales ``[N, G]``: the largest |value| / qmax, rounded up so
        that no scaled value passes qmax (fp8 would otherwise reach NaN)."""
        xp = namespace(blocks)
        return scale_up(xp.max(xp.abs(blocks), axis=-1) / self.qmax)

    # ---- the shared pipeline ----------------------------------------------------------------------------
    def encode_rows(self, x: Array) -> dict[str, Array]:
        xp, d = namespace(x), x.shape[1]
        parts: dict[str, Array] = {}
        residual = x
        m = min(self.config.outliers, d)
        if m:
            ops = ops_for(xp)
            ids = ops.top_ids(xp.abs(x), m)
            values = xp.astype(xp.take_along_axis(x, ids, axis=1), xp.float16)
            # the fp16 rounding of each outlier stays in the quantised residual
            residual = ops.add_at_rows(x, ids, -xp.astype(values, xp.float32))
            parts["outliers"], parts["outlier_ids"] = values, xp.astype(ids, ops.id_dtype())
        if self.config.rotation is not None:
            residual = hadamard(residual * signs(x, self.config.rotation, d))
        parts["codes"], parts["scale"] = self._quantize(residual)
        return parts

    def _quantize(self, y: Array) -> tuple[Array, Array]:
        """Rotated rows ``[N, d]`` -> (codes ``[N, d']``, fp16 scales ``[N, G]``)."""
        xp, n = namespace(y), y.shape[0]
        blocks = xp.reshape(y, (n, self.group_count(y.shape[1]), -1))
        scale = self.scales(blocks)
        safe = xp.where(scale > 0, xp.astype(scale, xp.float32), xp.ones_like(scale, dtype=xp.float32))
        scaled = xp.clip(blocks / xp.expand_dims(safe, axis=-1), -self.qmax, self.qmax)
        return self.to_codes(xp.reshape(scaled, (n, -1))), scale

    def decode_rows(self, parts: dict[str, Array]) -> Array:
        y = self.from_codes(parts["codes"])
        xp, (n, d) = namespace(y), y.shape
        scale = xp.astype(parts["scale"], xp.float32)
        if self.config.rotation is not None and scale.shape[1] == 1:
            # One scale per row: rotate the integer codes by the +-1 matrix (sums exact in float32, so every
            # library's matmul gives the same bits), then one elementwise product by scale / sqrt(b), rounded
            # alike everywhere. Scaled first, the sums of code * scale rounded in each BLAS's own order (numpy's
            # and torch's kernels differ with the CPU's vector width), and one ulp of a decoded 256 is 0.4% of the
            # error of a row that decodes almost exactly: the stored error record then differed between libraries.
            # (1/sqrt(b) is exact for b = 256 only: folding it into the matrix kept d = 384's sums inexact.)
            summed, gain = integer_hadamard(y)
            y = summed * (scale * gain) * signs(y, self.config.rotation, d)
        else:
            y = xp.reshape(xp.reshape(y, (n, scale.shape[1], -1)) * xp.expand_dims(scale, axis=-1), (n, d))
            if self.config.rotation is not None:
                y = hadamard(y) * signs(y, self.config.rotation, d)
        outliers, ids = parts.get("outliers"), parts.get("outlier_ids")
        if self.config.outliers and outliers is not None and ids is not None:
            y = ops_for(xp).add_at_rows(y, ids, xp.astype(outliers, xp.float32))
        return y
