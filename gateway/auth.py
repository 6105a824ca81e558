"""Who an HTTP call comes from: its bearer token, checked here when the gateway has the tokens file.

With ``--auth-tokens-file`` (the scheduler's file format: ``token: tenant``, ``"*"`` an admin)
every route but ``/health`` and ``/version`` needs ``Authorization: Bearer TOKEN``: a missing or
unknown token is a 401 before anything reaches Baton, and the token, not the client, names the
tenant. Either way
the client's token is forwarded to the scheduler as ``authorization`` metadata, so a scheduler
with auth on checks it again and applies the same tenant rules as for a gRPC client: the gateway
is never a way around the scheduler's auth, and a gateway without the file still works in front
of a scheduler with auth on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from common.pb import generate_pb2 as pb
from common.security import Principal, TokenTable, bearer_token
from gateway.errors import GatewayError, Unauthenticated

# gRPC metadata carries printable ASCII only; anything else could never be a valid token anyway.
_TOKEN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class Caller:
    """An HTTP caller as the gateway sees it."""

    token: str  # the bearer token presented ("" none); forwarded for the scheduler to check
    principal: Principal | None  # the token's tenant when the gateway checks tokens; None when it does not

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata for the scheduler: the caller's own credential, nothing of the gateway's."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class ClientAuth:
    """The gateway's check of its HTTP clients; off (every caller accepted) without tokens."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._tokens = TokenTable(tokens or {})

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request with these headers; a 401 when auth is on and the token is not valid."""
        # Anthropic's clients send their key as x-api-key.
        token = bearer_token(headers.get("authorization", "")) or headers.get("x-api-key", "").strip()
        if not _TOKEN.fullmatch(token):
            token = ""
        if not self.enabled:
            return Caller(token, None)
        principal = self._tokens.principal(token)
        if principal is None:
            # OpenAI's answer to a bad key: 401, type invalid_request_error, code invalid_api_key.
            raise Unauthenticated("a valid API key is required: send Authorization: Bearer KEY (or x-api-key: KEY)")
        return Caller(token, principal)

    @staticmethod
    def scope(request: pb.GenerateRequest, caller: Caller, header_tenant: str) -> None:
        """Fix the request's tenant from the caller's token (auth on); leave it alone when auth is off.

        A tenant's token runs as that tenant, and naming another in ``x-baton-tenant`` is a 403,
        not a silent switch. An admin token (``"*"``) acts for the tenant the header names. The
        body's ``user`` never picks the tenant with auth on: OpenAI defines it as an end-user id
        for the caller's own bookkeeping, and the key, not the body, says who is paying.
        """
        principal = caller.principal
        if principal is None:
            return
        if principal.is_admin:
            request.tenant = header_tenant
            return
        if header_tenant and header_tenant != principal.tenant:
            raise GatewayError(403, f"this API key may not act for tenant {header_tenant!r}", code="permission_denied")
        request.tenant = principal.tenant
