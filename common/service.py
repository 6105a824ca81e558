"""What both services' entrypoints share: logging setup, gRPC server options, signal-driven shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import grpc

from common.grpc_errors import ErrorMappingInterceptor


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def make_server(max_message_bytes: int) -> grpc.aio.Server:
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    return grpc.aio.server(interceptors=[ErrorMappingInterceptor()], options=options)


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop``; the service then shuts down gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (e.g. tests)
            return


def advertise_address(host: str, port: int, configured: str) -> str:
    """The address other services dial: configured, else this host's name when bound to all interfaces."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return f"{host}:{port}"
