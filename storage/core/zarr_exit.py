"""zarr's IO thread stopped at exit before zarr closes its event loop.

zarr v3 runs its async IO on an event loop in a daemon thread (``zarr.core.sync``). Its exit handler stops the loop,
waits 0.2 s for the thread and then closes the loop. On a loaded machine the thread may not run within 0.2 s, and
closing a loop that is still running raises ``RuntimeError: Cannot close a running event loop`` inside the handler:
printed after a finished precompute's summary, though the run succeeded. ``stop_zarr_io_at_exit`` registers a
handler after zarr's; exit handlers run last-registered first, so it stops the loop and waits for the thread (up to
``STOP_SECONDS``) before zarr's own handler runs, which then closes a stopped loop.

zarr is read from ``sys.modules``: this module never imports it (a cache without zarr arrays never loads zarr).
"""

from __future__ import annotations

import atexit
import sys

STOP_SECONDS = 30.0  # longer than any IO zarr has in flight at exit; the thread is a daemon, so exit is not blocked
_registered: list[bool] = []


def stop_zarr_io_at_exit() -> None:
    """Register ``stop_zarr_io`` to run at exit before zarr's own handler; call it after importing zarr. Once."""
    if not _registered and "zarr.core.sync" in sys.modules:
        atexit.register(stop_zarr_io)
        _registered.append(True)


def stop_zarr_io(timeout: float = STOP_SECONDS) -> None:
    """Stop zarr's IO event loop and wait for its thread; nothing when zarr never started one."""
    sync = sys.modules.get("zarr.core.sync")
    loop, thread = (getattr(sync, "loop", [None])[0], getattr(sync, "iothread", [None])[0]) if sync else (None, None)
    if loop is None or thread is None or not thread.is_alive() or loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)
