"""The most heap memory held at once while a piece of torch code runs on the CPU, read deterministically.

RSS is the wrong measure for a test on a loaded, shared machine: freed pages may or may not go back to the system,
and the high-water mark moves with what the allocator happens to keep. glibc's ``mallinfo2`` instead counts the
bytes in use right now (``uordblks`` in the arenas, ``hblkhd`` in mmapped blocks), which depends only on what the
code allocates and frees. ``LiveBytes`` reads it after every torch operator (a ``TorchDispatchMode``, which also
sees the operators autograd runs in a backward pass on this thread) and keeps the largest value above where it
started. A buffer an operator allocates and frees inside itself (a kernel's scratch space) is not seen; every
tensor an operator returns, and everything still alive when it returns, is.
"""

from __future__ import annotations

import ctypes
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (glibc 2.33 and later), or None where there is none (musl, macOS, older glibc)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


MALLINFO2 = _libc_mallinfo2()


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back, in every arena and mmapped block."""
    info = MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...`` then ``live.peak``: the most bytes in use above the start, after any
    torch operator inside."""

    def __init__(self) -> None:
        super().__init__()
        self.start = heap_in_use()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use() - self.start)
        return out
