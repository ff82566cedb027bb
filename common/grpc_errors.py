"""One server interceptor that maps errors to gRPC status codes.

`UserError` (bad input) -> its `code` (INVALID_ARGUMENT by default) with the error's message;
`NotImplementedError` -> UNIMPLEMENTED (what generated servicer bases raise for a method the
library does not implement, e.g. `grpc.health.v1.Health/List` in grpcio-health-checking 1.85);
anything else -> INTERNAL, logged with its traceback. Servicers just raise.
"""

from __future__ import annotations

import logging

import grpc

from common.errors import UserError

log = logging.getLogger(__name__)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UserError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc)
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "method not implemented"
    log.exception("internal error in a gRPC handler")
    return grpc.StatusCode.INTERNAL, f"internal error: {exc}"


def _wrap_unary(behavior):
    def handler(request, context):
        try:
            return behavior(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError):
                raise
            code, msg = _status(exc)
            context.abort(code, msg)

    return handler


def _wrap_stream(behavior):
    def handler(request, context):
        try:
            yield from behavior(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError):
                raise
            code, msg = _status(exc)
            context.abort(code, msg)

    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler
