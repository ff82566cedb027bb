"""Reflection v1 and v1alpha, and unknown methods, on both services (real servers on loopback).

The target is served without an engine (health NOT_SERVING): reflection and health answer
before the model is loaded, which is also what a probe sees during start-up.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as alpha

from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.server import SERVICE_NAME as DRAFTER_SERVICE
from specwire.drafter_service.server import serve
from specwire.target_service.server import SERVICE_NAME as TARGET_SERVICE
from specwire.target_service.server import TargetServer


@pytest.fixture(params=["target", "drafter"])
def server(request) -> Iterator[tuple[str, str]]:
    """(address, the service's own name) of a running target or drafter server."""
    if request.param == "target":
        target = TargetServer("127.0.0.1", 0)
        target.start()
        yield f"127.0.0.1:{target.port}", TARGET_SERVICE
        target.stop(0)
    else:
        drafter = serve(DrafterServiceConfig(host="127.0.0.1", port=0))
        yield drafter.address, DRAFTER_SERVICE
        drafter.stop(0)


def _reflect(address: str, version: str, request: alpha.ServerReflectionRequest):
    """One ServerReflectionInfo exchange under `grpc.reflection.<version>` (the v1 and v1alpha
    messages are the same on the wire, so the v1alpha classes encode both)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=alpha.ServerReflectionRequest.SerializeToString,
            response_deserializer=alpha.ServerReflectionResponse.FromString,
        )
        (reply,) = list(call(iter([request]), timeout=10))
    return reply


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_services(server, version: str) -> None:
    address, own = server
    listed = _reflect(address, version, alpha.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        own,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names

    # Every listed service can be described: its file holds the service.
    for name in sorted(names):
        ask = alpha.ServerReflectionRequest(file_containing_symbol=name)
        reply = _reflect(address, version, ask)
        assert reply.WhichOneof("message_response") == "file_descriptor_response", (name, reply)
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto
        ]
        package, _, service = name.rpartition(".")
        assert any(
            f.package == package and service in {s.name for s in f.service} for f in files
        ), name


def test_unknown_methods_are_unimplemented(server) -> None:
    address, _ = server
    with grpc.insecure_channel(address) as channel:
        # Health/List is in the health proto but not implemented by grpcio-health-checking.
        with pytest.raises(grpc.RpcError) as listed:
            health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
        assert listed.value.code() == grpc.StatusCode.UNIMPLEMENTED, listed.value.details()
        # A method no service has.
        missing = channel.unary_unary("/specwire.v1.Nope/Nothing")
        with pytest.raises(grpc.RpcError) as nope:
            missing(b"", timeout=10)
        assert nope.value.code() == grpc.StatusCode.UNIMPLEMENTED
