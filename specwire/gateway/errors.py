"""Errors as OpenAI-style JSON bodies with the HTTP status a gRPC status code maps to."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": None,
            "code": code,
        }
    }


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


def from_grpc(exc: grpc.aio.AioRpcError) -> tuple[int, str, str]:
    """(HTTP status, message, gRPC code name) for a failed gRPC call."""
    code = exc.code()
    return HTTP_STATUS.get(code, 500), exc.details() or code.name, code.name
