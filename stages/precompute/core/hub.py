"""One try at the Hugging Face hub, then its local cache only: a hub name without a network fails in seconds.

huggingface_hub retries an unreachable hub five times with back-off on every file (config, tokenizer, weights),
so a teacher name typed without a network costs most of a minute before its error. ``offline_unless_reachable``
opens one connection to the hub's endpoint first; when that fails it puts the process in offline mode, where
every load reads the local cache and fails at once for what is not there.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

CONNECT_TIMEOUT = 5.0  # seconds for the one connection


def offline_unless_reachable(name: str, timeout: float = CONNECT_TIMEOUT, *,
                             local: str = "--teacher a local model folder", kind: str = "model") -> str | None:
    """For a hub id ``name`` (not a local path), check once that the hub answers; if it does not, switch this
    process to offline mode and return a sentence for the error message (None when nothing was switched).

    Args:
        local: what to give instead, flag first (``--data a local data file``): the sentence's next step.
        kind: what ``name`` names on the hub ("model", "dataset").
    """
    # order: huggingface_hub reads HF_HUB_OFFLINE and its endpoint from the environment on first import; here it
    # reads the run's, as the teacher is about to load (and the option classes' package stays without it)
    import huggingface_hub.constants as hub

    if Path(name).expanduser().exists() or hub.HF_HUB_OFFLINE:
        return None
    where = urlsplit(hub.ENDPOINT)
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname or "", port), timeout=timeout).close()
        return None
    except OSError as exc:
        os.environ["HF_HUB_OFFLINE"] = "1"  # children (torchrun ranks, dataloader workers) inherit it
        hub.HF_HUB_OFFLINE = True
        return (f"the hub ({hub.ENDPOINT}) cannot be reached ({exc.strerror or exc}), so only its local cache "
                f"was looked in; give {local}, or download {kind} {name!r} where the hub can be reached")
