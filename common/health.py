"""gRPC health and reflection wiring, identical for both services."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> health.aio.HealthServicer:
    """Serve grpc.health.v1 and reflection; return the health servicer so callers can flip status."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await servicer.set(name, status)
