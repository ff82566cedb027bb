"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1` and
`grpc.reflection.v1alpha`.

grpcio-reflection (1.85) serves only v1alpha, while current clients (grpcurl, Postman, grpcui)
ask for v1 first. The two protos are the same messages under another package, so the v1alpha
servicer answers v1 calls byte for byte; we register it under the v1 name too, and add the v1
file to the descriptor pool so that reflection can describe itself under either name.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as aio_reflection
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """The v1alpha file descriptor renamed to package grpc.reflection.v1 (once per pool)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in fdp.message_type:  # the reflection messages have no nested types
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(fdp.SerializeToString())


def enable_reflection(service_names: tuple[str, ...], server) -> None:
    """Serve reflection v1 and v1alpha for `service_names` (plus the reflection services)."""
    pool = descriptor_pool.Default()
    _add_v1_file(pool)
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    # An aio server needs the async servicer (a sync handler would need a thread pool).
    if isinstance(server, grpc.aio.Server):
        servicer = aio_reflection.ReflectionServicer(names, pool=pool)
    else:
        servicer = reflection.ReflectionServicer(names, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha.ServerReflectionRequest.FromString,
        response_serializer=alpha.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
