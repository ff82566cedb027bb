"""The drafter gRPC service: a thin servicer over `DraftEngine`, plus health and reflection.

`serve(config)` starts listening at once with health NOT_SERVING, builds the drafter (a model
drafter loads weights), then flips health to SERVING. Calls before that get UNAVAILABLE.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import UserError
from common.grpc_errors import ErrorInterceptor
from common.protogen import drafter_pb2, drafter_pb2_grpc
from common.reflection import enable_reflection
from drafter_service.config import DrafterServiceConfig
from drafter_service.drafters import SessionDrafter, build_drafter
from drafter_service.engine import PROTOCOL_VERSION, DraftEngine, SeqDraft, SeqUpdate
from drafter_service.sessions import SessionStore

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class NotReady(UserError):
    code = "UNAVAILABLE"


def updates_from_proto(request: drafter_pb2.DraftRequest) -> list[SeqUpdate]:
    return [
        SeqUpdate(s.request_id, s.base_len, list(s.new_tokens), s.max_draft_tokens, s.finished)
        for s in request.sequences
    ]


def response_to_proto(step: int, drafts: list[SeqDraft]) -> drafter_pb2.DraftResponse:
    out = drafter_pb2.DraftResponse(step=step)
    for d in drafts:
        msg = out.drafts.add(
            request_id=d.request_id, base_len=d.base_len, tokens=d.tokens, resync=d.resync
        )
        for ids, probs in d.probs or ():
            msg.probs.add(ids=ids, probs=probs)
    return out


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """protobuf -> SeqUpdates -> engine.draft -> protobuf. `engine` is None until ready.

    Errors are raised, not handled: `ErrorInterceptor` maps UserError to INVALID_ARGUMENT.
    """

    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len
        self.engine: DraftEngine | None = None

    def GetInfo(self, request, context):
        engine = self._ready()
        d = engine.drafter
        caps = ["stream", *(c for c in d.capabilities if c != "stream")]
        return drafter_pb2.DrafterInfo(
            protocol_version=PROTOCOL_VERSION,
            name=d.name,
            vocab_size=d.vocab_size,
            tokenizer_fingerprint=d.tokenizer_fingerprint,
            max_draft_len=self.max_draft_len,
            capabilities=caps,
        )

    def Draft(self, request, context):
        return self._draft(request, context)

    def DraftStream(self, request_iterator, context):
        for request in request_iterator:
            yield self._draft(request, context)

    def _draft(self, request, context) -> drafter_pb2.DraftResponse:
        drafts = self._ready().draft(updates_from_proto(request), request.want_probs)
        return response_to_proto(request.step, drafts)

    def _ready(self) -> DraftEngine:
        if self.engine is None:
            raise NotReady("drafter is still starting")
        return self.engine


@dataclass
class DrafterServer:
    """A running drafter service. `port` is the bound port (useful when asked for port 0)."""

    server: grpc.Server
    servicer: DrafterServicer
    health: health.HealthServicer
    port: int
    config: DrafterServiceConfig

    @property
    def engine(self) -> DraftEngine:
        assert self.servicer.engine is not None
        return self.servicer.engine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self) -> None:
        self.server.wait_for_termination()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls, let in-flight ones finish for `grace` seconds, free sessions."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        engine = self.servicer.engine
        if engine is not None:
            engine.store.clear()
            engine.drafter.close()


def serve(config: DrafterServiceConfig, drafter: SessionDrafter | None = None) -> DrafterServer:
    """Start the service; `drafter` overrides `config.drafter` (tests inject their own)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers),
        interceptors=[ErrorInterceptor()],
        options=[("grpc.so_reuseport", 0)],  # a second service on the same port must fail
    )
    servicer = DrafterServicer(config.max_draft_len)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc
    if port == 0:
        raise UserError(f"cannot listen on {config.host}:{config.port} (in use?)")
    server.start()
    try:
        drafter = drafter or build_drafter(config)
    except BaseException:
        server.stop(None)
        raise
    store = SessionStore(drafter, config.session_ttl_s)
    servicer.engine = DraftEngine(drafter, store, config.max_draft_len, config.delay_ms)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("drafter %s serving on %s:%d", drafter.name, config.host, port)
    return DrafterServer(server, servicer, health_servicer, port, config)
