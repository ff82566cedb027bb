"""Generated gRPC stubs (made by `make protos` from protos/, never committed).

protoc writes modules that import each other as `specwire.v1.*`, so this folder goes on
sys.path and the stubs are re-exported from here.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

try:
    from specwire.v1 import (  # noqa: E402
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
