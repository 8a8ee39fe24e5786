"""pca8 (transform coding, issue 22): int8 codes of full-rank PCA coefficients at a uniform step.

A full-rank PCA (``rank`` = d, ``storage.projection``) decorrelates the channels and sorts them by variance, so
one uniform step per row, ``step`` x the row's RMS, spends ~4 bits on the leading directions and ~0 on the tail
once zstd sees each direction's codes together: zarr stores the codes column-major (``COLUMN_CODES_CODEC``).
4.05x smaller than fp16 within 1% of every hidden loss on MiniLM at step 0.24 (benchmarks/RESULTS.md; about 3.9x with
the zstd level 1 that new caches use for speed, "Compressors that keep up"). No
rotation (it would mix the sorted directions again) and no outliers (a PCA coefficient has none worth an fp16
copy).
"""

from __future__ import annotations

import dataclasses

from kdcache.storage.core.errors import SpecError
from kdcache.storage.hidden_codecs.arrays import Array, namespace
from kdcache.storage.hidden_codecs.base import register
from kdcache.storage.hidden_codecs.integers import Int8
from kdcache.storage.hidden_codecs.quantised import QuantConfig


@dataclasses.dataclass(frozen=True)
class StepConfig(QuantConfig):
    """pca8's configuration: ``QuantConfig`` with no rotation and no outliers, and the step (a fraction of each
    row's RMS, the one measured best)."""

    rotation: int | None = None
    outliers: int = 0
    step: float = 0.24

    def check(self, name: str) -> None:
        step = self.step
        if not (isinstance(step, (int, float)) and not isinstance(step, bool) and 0 < step <= 8):
            raise SpecError(f"hidden codec {name!r}: step must be a number in (0, 8] (the quantisation step as a "
                            f"fraction of each row's RMS), got {step!r}")
        if self.rotation is not None or self.outliers != 0:
            raise SpecError(f"hidden codec {name!r} takes no rotation and no outliers (expected rotation null and "
                            f"outliers 0), got rotation {self.rotation!r} and outliers {self.outliers!r}")
        super().check(name)


@register
class Pca8(Int8):
    name = "pca8"
    help = "int8 codes of full-rank PCA coefficients at a uniform step (needs --hidden-rank d)"
    order = 6
    full_rank = True
    column_major = True
    Config = StepConfig
    config: StepConfig

    def scales(self, blocks: Array) -> Array:
        """A uniform step per row, ``step`` x its RMS; the rare value past qmax steps is clipped."""
        xp = namespace(blocks)
        return xp.astype(self.config.step * xp.sqrt(xp.mean(blocks * blocks, axis=-1)), xp.float16)
