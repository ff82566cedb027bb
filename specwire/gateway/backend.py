"""The gateway's side of the target's gRPC API: one async channel, made in one place.

`make_channel` is the seam for transport security: TLS credentials (and anything else a channel
needs) get plugged in there and nowhere else.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.common.protogen import generation_pb2 as pb
from specwire.common.protogen import generation_pb2_grpc as pb_grpc


def make_channel(target: str) -> grpc.aio.Channel:
    """The one place the gateway creates its gRPC channel to the target."""
    return grpc.aio.insecure_channel(target)


class TargetClient:
    """Async calls to one target. `authorization` is forwarded as gRPC metadata when given."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.channel = make_channel(target)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self.channel.close()

    @staticmethod
    def _metadata(authorization: str | None) -> tuple[tuple[str, str], ...]:
        return (("authorization", authorization),) if authorization else ()

    def generate(
        self, request: pb.GenerateRequest, authorization: str | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The Generate stream (iterate it; `cancel()` it when the HTTP client goes away)."""
        return self.stub.Generate(
            request, timeout=self.timeout_s, metadata=self._metadata(authorization)
        )

    async def model_info(self, authorization: str | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=10, metadata=self._metadata(authorization)
        )

    async def serving(self) -> bool:
        """Whether the target's health service says SERVING."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
