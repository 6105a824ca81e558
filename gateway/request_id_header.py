"""``X-Request-Id`` on every response, as vLLM's server sets it (``--enable-request-id-headers``):
the client's own where it sent one (a proxy's trace id), else the id Baton gave the request
(``x-baton-request-id``), else a new one. It only labels the response: Baton's request id, an
idempotency key, stays its own, so a proxy that retries with the same header is never refused as a
duplicate.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
BATON_HEADER = b"x-baton-request-id"
_VALID = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII without spaces, as a header value may hold


class RequestIdHeader:
    """ASGI middleware adding ``X-Request-Id`` to each HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope["headers"] if name == HEADER), b"")
        given = sent if _VALID.fullmatch(sent) else b""

        async def labelled(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != HEADER]
                baton = next((v for n, v in headers if n.lower() == BATON_HEADER), b"")
                headers.append((HEADER, given or baton or uuid.uuid4().hex.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, labelled)
