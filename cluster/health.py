"""The standard gRPC health service (`grpc.health.v1.Health`): grpc's asyncio servicer, plus the `List`
method the protocol has and that servicer lacks (it answers UNIMPLEMENTED after logging a traceback)."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]


class HealthServicer(health_aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._services = {""}  # grpc's servicer starts with the server as a whole SERVING

    async def set(self, service: str, status: Any) -> None:
        self._services.add(service)
        await super().set(service, status)

    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        """Every service's status, as Check answers it (so draining shows NOT_SERVING here too)."""
        statuses = {}
        for service in sorted(self._services):
            statuses[service] = await self.Check(health_pb2.HealthCheckRequest(service=service), context)
        return health_pb2.HealthListResponse(statuses=statuses)
