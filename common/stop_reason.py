"""What stopped an output (vLLM's ``stop_reason``) on the wire: the ``stop_reason`` oneof that
``FinishedRequest``, ``GenerateResponse`` and ``CompleteResponse`` share, a stop string
(``stop_string``) or a stop token (``stop_token_id``)."""

from __future__ import annotations

from typing import Any

StopReason = str | int | None


def write_stop_reason(msg: Any, reason: StopReason) -> None:
    """Set ``msg``'s stop_reason oneof to ``reason`` (None: leave it unset)."""
    if isinstance(reason, str):
        msg.stop_string = reason
    elif reason is not None:
        msg.stop_token_id = reason


def read_stop_reason(msg: Any) -> StopReason:
    """``msg``'s stop string or stop token, or None where neither is set."""
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which is not None else None
