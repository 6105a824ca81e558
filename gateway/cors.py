"""Cross-origin requests: which web pages may call the gateway from a browser.

As vLLM's server, by default any origin may call it with any method and header, without
credentials (cookies). With client auth on (``--auth-tokens-file``, ``gateway.auth``) a page's
requests need an API key like any other client's; with it off, any page a browser opens can call a
gateway that browser reaches, as it can call vLLM's: the model's answers are all it can read, as
Baton keeps no responses, but it spends the server's time. ``baton gateway --allowed-origins``
narrows it, with vLLM's flags and their JSON list values.
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
