"""What both services' entrypoints share: logging setup, gRPC server options, signal-driven shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
from collections.abc import Mapping

import grpc

from common.config import SecurityConfig
from common.grpc_errors import ErrorMappingInterceptor
from common.netaddr import host_port, reachable_host
from common.security import BearerAuthInterceptor, FleetSecretInterceptor, server_credentials
from common.tracing import server_interceptors

log = logging.getLogger(__name__)


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
        # grpc's core holds calls the server has not taken up yet in a queue it caps at 1,000 by
        # default, cancelling the rest with a bare CANCELLED that a client cannot tell from its own
        # cancel: a burst of streams while the event loop is busy (2,000 opened at once) lost a
        # tenth of them, other tenants' included. Held here, they wait their turn; the scheduler's
        # own limits (queue length, tenants' caps) answer overload with RESOURCE_EXHAUSTED.
        ("grpc.server.max_pending_requests", 65_536),
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


# Longer than any graceful step (a 2 s gRPC grace, a 10 s engine-thread join), shorter than the
# 30 s an orchestrator commonly waits before its SIGKILL.
SHUTDOWN_LIMIT_S = 20.0


def bound_shutdown(limit_s: float = SHUTDOWN_LIMIT_S) -> None:
    """Exit the process if the graceful shutdown that starts now is not over in ``limit_s``.

    A shutdown that hangs says where instead of waiting for a SIGKILL that leaves nothing behind:
    halfway, the stacks of the event loop's unfinished tasks are logged (a hang is mostly an await
    that never ends, invisible in thread stacks); at the limit, every thread's Python stack goes
    to stderr (the service's log) and the process exits.
    """
    with contextlib.suppress(ValueError, OSError, AttributeError):  # stderr not a real file
        faulthandler.dump_traceback_later(limit_s, exit=True)
    with contextlib.suppress(RuntimeError):  # no running loop: the thread stacks alone
        asyncio.get_running_loop().call_later(limit_s / 2, _log_unfinished_tasks)


def _log_unfinished_tasks() -> None:
    for task in asyncio.all_tasks():
        # Not ``task.print_stack``: it fails on the frames of compiled coroutines (grpc's
        # Cython ones have no line number), which is where a gRPC shutdown would be waiting.
        frames = [f"  {f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in task.get_stack()]
        log.warning("shutdown still waits on %r\n%s", task, "\n".join(frames))


def advertise_address(host: str, port: int, configured: str, environ: Mapping[str, str] | None = None) -> str:
    """The address other services dial: configured; else, when bound to all interfaces, this pod's
    or container's IP (``common.netaddr.reachable_host``); else the bound host."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", ""):
        return host_port(reachable_host(environ), port)
    return host_port(host, port)
