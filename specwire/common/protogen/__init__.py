"""The gRPC stubs, re-exported: `make protos` generates them from protos/ into `specwire/v1/`
(never committed)."""

try:
    from specwire.v1 import (
        drafter_pb2,
        drafter_pb2_grpc,
        generation_pb2,
        generation_pb2_grpc,
    )
except ImportError as exc:  # pragma: no cover - only when the stubs were never generated
    raise ImportError(
        "specwire's gRPC stubs are missing or stale: run `make protos` (or `make setup`)"
    ) from exc

__all__ = ["drafter_pb2", "drafter_pb2_grpc", "generation_pb2", "generation_pb2_grpc"]
