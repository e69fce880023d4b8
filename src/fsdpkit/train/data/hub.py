"""The Hugging Face hub as fsdpkit reaches it: its endpoint, one look at its host before the hub
client's retries (half a minute of them on a machine that cannot reach it), the client's retry
logging kept quiet."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Iterator


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout: float = 3.0) -> bool:
    """A connection to the hub's host opens (read before the hub client is imported: it reads
    HF_HUB_OFFLINE once, on import)."""
    url = urllib.parse.urlparse(hub_endpoint())
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def quiet_hub() -> Iterator[None]:
    """The hub client logs every retry (ten lines before an offline machine gives up); the error
    that follows says what matters. `--verbose` (fsdpkit's logger at DEBUG) lets them through."""
    from huggingface_hub.utils import logging as hub_logging  # loaded with the hub client, not before

    level = hub_logging.get_verbosity()  # importing the client first: it resets its level on import
    if not logging.getLogger("fsdpkit").isEnabledFor(logging.DEBUG):
        hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(level)
