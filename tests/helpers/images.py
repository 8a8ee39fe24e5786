"""Checks on the pictures reports draw."""

from __future__ import annotations

from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """The file exists, starts with the PNG signature, and decodes to an RGB(A) image."""
    import matplotlib.image

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4) and min(pixels.shape[:2]) > 50
