"""Response metadata of Baton's public API that clients may read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# A Generate call's response headers, sent once its request is accepted and before its first
# token: the request's id (the client's own, or the one Baton gave it). A refused call ends with
# its status and no headers.
REQUEST_ID_METADATA = "x-baton-request-id"


def accepted(initial_metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether a Generate call's initial metadata says its request was accepted."""
    return any(key == REQUEST_ID_METADATA for key, _ in initial_metadata or ())
