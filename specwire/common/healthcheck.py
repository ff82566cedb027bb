"""A gRPC health probe for containers and tests.

    python -m specwire.common.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

Calls `grpc.health.v1.Health/Check` and exits 0 iff the status is SERVING; otherwise it prints
one line to stderr and exits 1 (2 for bad arguments). Docker health checks and tests use it, so
neither needs `grpc_health_probe` or `grpcurl` installed. Against a TLS server give --tls-ca
(and --tls-cert/--tls-key for mutual TLS); health checks need no token.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.common.errors import UserError
from specwire.common.security import ClientSecurity, add_client_flags, client_security_from_args
from specwire.common.transport import make_channel


def check(
    target: str, service: str = "", timeout: float = 3.0, security: ClientSecurity | None = None
) -> str:
    """Return the serving status name of `service` ("" = the whole server) at `target`.

    Raises grpc.RpcError when the server cannot be reached or does not know the service.
    """
    with make_channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specwire.common.healthcheck",
        description="Exit 0 iff the gRPC server at HOST:PORT reports SERVING.",
    )
    parser.add_argument("target", help="HOST:PORT of a gRPC server")
    parser.add_argument("--service", default="", help="service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    add_client_flags(parser, env="SPECWIRE_HEALTHCHECK")
    args = parser.parse_args(argv)
    try:
        security = client_security_from_args(args, token_env="SPECWIRE_HEALTHCHECK_TOKEN")
    except UserError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    try:
        status = check(args.target, args.service, args.timeout, security)
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() else "UNKNOWN"
        detail = (exc.details() or "").splitlines()[0] if exc.details() else ""
        print(f"healthcheck: {args.target}: {code}: {detail}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"healthcheck: {args.target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
