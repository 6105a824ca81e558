"""What both services' entrypoints share: logging setup, gRPC server options, signal-driven shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping

import grpc

from common.config import SecurityConfig
from common.grpc_errors import ErrorMappingInterceptor
from common.netaddr import host_port, reachable_host
from common.security import BearerAuthInterceptor, FleetSecretInterceptor, server_credentials
from common.tracing import server_interceptors


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def make_server(
    max_message_bytes: int,
    auth_tokens: dict[str, str] | None = None,
    tracing: bool = False,
    checked_streams: tuple[str, ...] = (),
    fleet_secret: str = "",
) -> grpc.aio.Server:
    """A grpc.aio server with Baton's interceptors: auth first (bearer tokens on a scheduler's
    public port when given, the fleet secret on an executor's port when given), then error
    mapping (``checked_streams``: see ``ErrorMappingInterceptor``)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Schedulers keep their Run streams alive with pings every 10 s, even while no step runs;
        # grpc's default policy would answer those with GOAWAY "too_many_pings" and cut the link.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor(checked_streams)]
    if auth_tokens:
        interceptors.insert(0, BearerAuthInterceptor(auth_tokens))
    if fleet_secret:
        interceptors.insert(0, FleetSecretInterceptor(fleet_secret))
    interceptors[:0] = server_interceptors(tracing)
    return grpc.aio.server(interceptors=interceptors, options=options)


def add_port(server: grpc.aio.Server, address: str, security: SecurityConfig) -> int:
    """Bind ``address`` with TLS when configured, plaintext otherwise; return the bound port."""
    credentials = server_credentials(security)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop``; the service then shuts down gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (e.g. tests)
            return


def advertise_address(host: str, port: int, configured: str, environ: Mapping[str, str] | None = None) -> str:
    """The address other services dial: configured; else, when bound to all interfaces, this pod's
    or container's IP (``common.netaddr.reachable_host``); else the bound host."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", ""):
        return host_port(reachable_host(environ), port)
    return host_port(host, port)
