"""One server interceptor (grpc.aio) that maps errors to gRPC status codes.

`UserError` (bad input) -> its `code` (INVALID_ARGUMENT by default) with the error's message;
`NotImplementedError` -> UNIMPLEMENTED (what generated servicer bases raise for a method that
is not implemented); anything else -> INTERNAL, logged with its traceback. Servicers just raise.
Only specwire's own services are wrapped (health and reflection handle their own errors).
"""

from __future__ import annotations

import logging

import grpc

from specwire.common.errors import UserError

log = logging.getLogger(__name__)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UserError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc)
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "method not implemented"
    log.exception("internal error in a gRPC handler")
    return grpc.StatusCode.INTERNAL, f"internal error: {exc}"


def _wrap_unary(behavior):
    async def handler(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*_status(exc))

    return handler


def _wrap_stream(behavior):
    async def handler(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*_status(exc))

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/specwire."):
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler
