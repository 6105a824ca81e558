"""Cross-origin requests: which web pages may call the gateway from a browser.

As vLLM's server, by default any origin may call it with any method and header, without
credentials (cookies): a page's requests carry their API key in a header, which the gateway checks
(``gateway.auth``) whatever their origin. ``baton gateway --allowed-origins`` narrows it, with
vLLM's flags and their JSON list values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def middleware(self) -> Middleware:
        return Middleware(
            CORSMiddleware,
            allow_origins=list(self.origins),
            allow_methods=list(self.methods),
            allow_headers=list(self.headers),
            allow_credentials=self.credentials,
        )


def string_list(text: str) -> tuple[str, ...]:
    """A flag's JSON list of strings (``'["https://a.example"]'``), as vLLM's flags take them."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return tuple(value)


OPEN_TO_ANY_ORIGIN = CorsPolicy()  # vLLM's default
