"""The gateway's HTTP app: OpenAI routes over the target's gRPC Generate stream.

    POST /v1/completions, /v1/chat/completions   (JSON, or SSE with `stream: true`)
    GET  /v1/models, /health, /metrics

Per request: body -> GenerateRequest (`convert`), one Generate call, messages -> OpenAI objects
(`formats`). The first gRPC message is awaited before answering, so a request the target
refuses (INVALID_ARGUMENT, ...) gets a proper HTTP error status even when streaming; an error
after that arrives as an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from specwire.common.protogen import generation_pb2 as pb
from specwire.gateway import convert
from specwire.gateway.backend import TargetClient
from specwire.gateway.config import GatewayConfig
from specwire.gateway.errors import error_body, error_response, from_grpc
from specwire.gateway.formats import ChatFormat, CompletionFormat, Format
from specwire.gateway.metrics import GatewayMetrics
from specwire.gateway.schemas import ChatCompletionRequest, CompletionRequest

ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def create_app(cfg: GatewayConfig) -> FastAPI:
    api_key = cfg.api_key()
    metrics = GatewayMetrics()
    state: dict = {}  # "target": TargetClient (made inside the server's event loop), "model"

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["target"] = TargetClient(cfg.target, cfg.timeout_s)
        yield
        await state["target"].close()

    app = FastAPI(title="specwire gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    # -- errors ----------------------------------------------------------------------------------
    @app.exception_handler(GatewayError)
    async def _gateway_error(_r: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code)

    @app.exception_handler(convert.BadRequest)
    async def _bad_request(_r: Request, exc: convert.BadRequest) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _grpc_error(_r: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return error_response(*from_grpc(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(HTTPException)
    async def _http(_r: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    # -- metrics: every request, streams timed to their last byte --------------------------------
    @app.middleware("http")
    async def _observe(request: Request, call_next):
        t0 = time.perf_counter()
        route = request.url.path if request.url.path in ROUTES else "other"
        response = await call_next(request)
        inner = response.body_iterator

        async def timed() -> AsyncIterator[bytes]:
            try:
                async for part in inner:
                    yield part
            finally:
                metrics.requests.labels(route, str(response.status_code)).inc()
                metrics.latency.labels(route).observe(time.perf_counter() - t0)

        response.body_iterator = timed()
        return response

    # -- helpers ---------------------------------------------------------------------------------
    def authorization(request: Request) -> str | None:
        """Check the gateway's own key (when configured); return the header to forward."""
        header = request.headers.get("authorization")
        if api_key is not None:
            given = header[7:] if header and header[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise GatewayError(401, "missing or wrong API key", "invalid_api_key")
        return header if header and header[:7].lower() == "bearer " else None

    async def model_name(auth: str | None) -> str:
        if cfg.model_name:
            return cfg.model_name
        if "model" not in state:
            state["model"] = (await state["target"].model_info(auth)).model
        return state["model"]

    async def run(body, grpc_req: pb.GenerateRequest, fmt: Format, auth: str | None) -> Response:
        call = state["target"].generate(grpc_req, auth)
        stream = call.__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise GatewayError(502, "the target ended the stream without a message") from None
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _events(call, first, stream, fmt, usage), media_type="text/event-stream"
            )
        return JSONResponse(await _collect(call, first, stream, fmt))

    async def _messages(first, stream) -> AsyncIterator[pb.GenerateResponse]:
        yield first
        async for msg in stream:
            yield msg

    async def _collect(call, first, stream, fmt: Format) -> dict:
        chunks: dict[int, list[pb.GenerateChunk]] = {}
        completes: list[pb.GenerateComplete] = []
        async for msg in _messages(first, stream):
            kind = msg.WhichOneof("response")
            if kind == "chunk":
                chunks.setdefault(msg.chunk.index, []).append(msg.chunk)
            elif kind == "complete":
                completes.append(msg.complete)
            else:
                raise GatewayError(500, msg.error.message, msg.error.code)
        return fmt.response(chunks, completes)

    async def _events(call, first, stream, fmt: Format, include_usage: bool):
        completes: list[pb.GenerateComplete] = []
        try:
            async for msg in _messages(first, stream):
                kind = msg.WhichOneof("response")
                if kind == "chunk":
                    out = fmt.delta(msg.chunk)
                    if out is not None:
                        yield _sse(out)
                elif kind == "complete":
                    completes.append(msg.complete)
                    yield _sse(fmt.finished(msg.complete))
                else:
                    yield _sse(error_body(500, msg.error.message, msg.error.code))
                    break
            if include_usage and completes:
                yield _sse(fmt.usage_chunk(completes))
        except grpc.aio.AioRpcError as exc:
            status, message, code = from_grpc(exc)
            yield _sse(error_body(status, message, code))
        finally:
            call.cancel()  # a client that went away stops the generation (no-op when done)
        yield _sse("[DONE]")

    # -- routes ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        auth = authorization(request)
        rid = f"cmpl-{uuid.uuid4().hex}"
        grpc_req = convert.completion_to_grpc(body, rid)
        fmt = CompletionFormat(rid, body.model or await model_name(auth), body.logprobs is not None)
        return await run(body, grpc_req, fmt, auth)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        auth = authorization(request)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        grpc_req = convert.chat_to_grpc(body, rid)
        fmt = ChatFormat(rid, body.model or await model_name(auth), body.logprobs)
        return await run(body, grpc_req, fmt, auth)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        auth = authorization(request)
        name = await model_name(auth)
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "specwire"}
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await state["target"].serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
