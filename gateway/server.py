"""``baton gateway``: serve the OpenAI-compatible HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

# Open SSE streams would otherwise hold a shutdown until every generation ends.
_GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="HTTP port to listen on (default 8000)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="Baton scheduler gRPC HOST:PORT to forward to (default 127.0.0.1:50051)",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--tracing", action="store_true", help="emit OpenTelemetry spans and propagate trace context")
    parser.add_argument(
        "--otlp-endpoint", default="", help="OTLP endpoint for spans (needs opentelemetry-exporter-otlp)"
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so that `baton --help` and the other subcommands do not pay for the web stack.
    import uvicorn

    from common.gc_heap import freeze_startup_heap
    from common.service import setup_logging
    from common.tracing import setup_tracing
    from gateway.app import create_app

    setup_logging(args.log_level)
    tracing = setup_tracing("baton-gateway", args.tracing, args.otlp_endpoint)
    log.info("gateway on %s:%d forwarding to %s", args.host, args.port, args.target)
    app = create_app(args.target, tracing)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    return 0
