"""Which model the gateway serves, and so which ``model`` names a request may use.

The name is the scheduler's (``ModelInfo``: the model path or hub id the executors registered),
plus any aliases the operator gives the gateway. It is cached: a request naming the served model
costs no extra call. A request naming another is checked against a fresh ``ModelInfo`` (at most
once per ``refresh_s``), as a scheduler behind a balancer may have been restarted on another model.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.pb import generate_pb2 as pb
from gateway.errors import ModelNotFound, from_rpc_error

_REFRESH_S = 5.0


@dataclass(frozen=True)
class ServedModel:
    name: str  # as the executors registered it
    max_model_len: int
    aliases: tuple[str, ...] = ()  # other names the operator lets clients use
    # What the model's generation_config recommends; applied to what a request leaves out.
    sampling_defaults: pb.SamplingDefaults = field(default_factory=pb.SamplingDefaults)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def card(self, name: str) -> dict[str, Any]:
        """``name``'s entry in ``/v1/models``; ``root`` is the model it stands for."""
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),  # as vLLM's cards: when they are listed
            "owned_by": "baton",
            "root": self.name,
            "max_model_len": self.max_model_len,
        }


Metadata = tuple[tuple[str, str], ...]


class ServedModels:
    """The served model's names, fetched with ``model_info`` (a ``ModelInfo`` call made with the
    caller's metadata, so a scheduler with auth on checks the caller's own credential)."""

    def __init__(
        self,
        model_info: Callable[[Metadata], Awaitable[pb.ModelInfoResponse]],
        aliases: Sequence[str] = (),
        refresh_s: float = _REFRESH_S,
    ) -> None:
        self._model_info = model_info
        self._aliases = tuple(aliases)
        self._refresh_s = refresh_s
        self._cached: ServedModel | None = None
        self._fetched_at = 0.0

    async def current(self, metadata: Metadata) -> ServedModel:
        """The served model as the scheduler describes it now."""
        try:
            info = await self._model_info(metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        self._cached = ServedModel(info.model, info.max_model_len, self._aliases, info.sampling_defaults)
        self._fetched_at = time.monotonic()
        return self._cached

    @property
    def latest(self) -> ServedModel | None:
        """The served model as last fetched (None before the first fetch)."""
        return self._cached

    async def resolve(self, requested: str, metadata: Metadata) -> str:
        """The name to answer ``requested`` with: itself when served here, the served model's name
        when empty; else ModelNotFound (404)."""
        served = self._cached or await self.current(metadata)
        if requested and requested not in served.names and time.monotonic() - self._fetched_at >= self._refresh_s:
            served = await self.current(metadata)
        if not requested:
            return served.name
        if requested not in served.names:
            raise ModelNotFound(requested)
        return requested
