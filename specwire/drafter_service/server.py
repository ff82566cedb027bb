"""The drafter gRPC service: a thin servicer over `DraftEngine`, plus health and reflection.

`serve(config)` starts listening at once with health NOT_SERVING, builds the drafter (a model
drafter loads weights), then flips health to SERVING. Calls before that get UNAVAILABLE.

The server is a `grpc.aio` server (specwire/common/transport.py): an idle DraftStream is a waiting
coroutine, not a pinned thread, so idle streams cannot starve GetInfo or health. Draft steps run
on a pool of `max_workers` threads. Each caller (token, certificate or IP address) may hold at
most `max_streams_per_peer` DraftStreams; sessions are the caller's own (sessions.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent import futures
from dataclasses import dataclass, field

from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specwire.common.drafting import PROTOCOL_VERSION
from specwire.common.errors import UserError
from specwire.common.hoptrace import DRAFTER as TRACE
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.common.reflection import enable_reflection
from specwire.common.security import peer_identity
from specwire.common.transport import LoopThread, build_server
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.drafters import SessionDrafter, build_drafter
from specwire.drafter_service.engine import DraftEngine, SeqDraft, SeqUpdate
from specwire.drafter_service.frames import FrameServer
from specwire.drafter_service.sessions import SessionStore

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class NotReady(UserError):
    code = "UNAVAILABLE"


class TooManyStreams(UserError):
    code = "RESOURCE_EXHAUSTED"


def stream_group(identity: str) -> str:
    """Whom a stream limit counts against: a token or certificate as is, a plain connection by
    its IP address (so opening more connections does not raise the limit)."""
    if identity.startswith("peer:"):
        return identity.rsplit(":", 1)[0]
    return identity


DraftMessage = drafter_pb2.DraftRequest | drafter_pb2.DraftStreamRequest
DraftReply = drafter_pb2.DraftResponse | drafter_pb2.DraftStreamResponse


def updates_from_proto(request: DraftMessage) -> list[SeqUpdate]:
    return [
        SeqUpdate(
            s.request_id,
            s.base_len,
            list(s.new_tokens),
            s.max_draft_tokens,
            s.finished,
            s.max_branches,
            s.branch_positions,
        )
        for s in request.sequences
    ]


def response_to_proto(
    step: int,
    drafts: list[SeqDraft],
    kind: type[DraftReply] = drafter_pb2.DraftResponse,
    branches_only: bool = False,
) -> DraftReply:
    out = kind(step=step, branches_only=branches_only)
    for d in drafts:
        msg = out.drafts.add(
            request_id=d.request_id, base_len=d.base_len, tokens=d.tokens, resync=d.resync
        )
        for ids, probs in d.probs or ():
            msg.probs.add(ids=ids, probs=probs)
        for position, token, tokens in d.branches or ():
            msg.branches.add(position=position, token=token, tokens=tokens)
    return out


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    """protobuf -> SeqUpdates -> engine.draft (on the worker pool) -> protobuf. `engine` is None
    until ready.

    Errors are raised, not handled: `ErrorInterceptor` maps UserError to its status code.
    """

    def __init__(self, config: DrafterServiceConfig) -> None:
        self.max_draft_len = config.max_draft_len
        self.max_streams_per_peer = config.max_streams_per_peer
        self.socket = config.socket  # frames on a unix socket too (frames.py), or ""
        self.engine: DraftEngine | None = None
        self.draining = False
        self.pool = futures.ThreadPoolExecutor(config.max_workers, "specwire-draft")
        self.streams: collections.Counter[str] = collections.Counter()
        # Streams open per caller known only by its connection ("peer:..."): when the last one
        # ends, nobody can reach that caller's sessions again (a new connection is a new
        # caller, and a target re-sends every sequence whole after any reconnect), so they are
        # freed then instead of after the TTL. Callers with a token or certificate keep theirs.
        self.connection_streams: collections.Counter[str] = collections.Counter()

    async def GetInfo(self, request, context):
        return self.info()

    def info(self) -> drafter_pb2.GetInfoResponse:
        """GetInfo's reply (raises NotReady): "socket" is among the capabilities when the
        service also serves frames on a unix socket."""
        engine = self._ready()
        d = engine.drafter
        caps = ["stream", *(["socket"] if self.socket else []), *d.capabilities]
        caps = list(dict.fromkeys(caps))  # once each, in that order
        return drafter_pb2.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION,
            name=d.name,
            vocab_size=d.vocab_size,
            tokenizer_fingerprint=d.tokenizer_fingerprint,
            max_draft_len=self.max_draft_len,
            capabilities=caps,
        )

    async def Draft(self, request, context):
        self._ready()
        return await self._draft(request, peer_identity(context), drafter_pb2.DraftResponse)

    async def DraftStream(self, request_iterator, context):
        async for reply in self.stream(request_iterator, peer_identity(context)):
            yield reply

    async def stream(self, requests, owner: str):
        """One DraftStream's replies to `requests` (an async iterator of DraftStreamRequests)
        for caller `owner`, within the caller's stream limit: the gRPC call's, and the unix
        socket's (frames.py). Raises UserError (TooManyStreams, NotReady)."""
        self._ready()
        group = stream_group(owner)
        if self.streams[group] >= self.max_streams_per_peer:
            raise TooManyStreams(
                f"{self.streams[group]} DraftStreams already open for this caller "
                f"(--max-streams-per-peer {self.max_streams_per_peer})"
            )
        self.streams[group] += 1
        by_connection = owner.startswith("peer:")
        if by_connection:
            self.connection_streams[owner] += 1
        try:
            kind = drafter_pb2.DraftStreamResponse
            async for request in requests:
                TRACE.mark("in", request.step)
                later = [] if request.branches_later else None
                reply = await self._draft(request, owner, kind, later)
                TRACE.mark("out", request.step)
                yield reply
                if later:  # the drafts are on their way: now the branches they left (sent
                    # even when none were found: the target then knows none are coming)
                    branches = await self._on_engine("find_branches", later)
                    yield response_to_proto(request.step, branches, kind, branches_only=True)
        finally:
            self.streams[group] -= 1
            if not self.streams[group]:
                del self.streams[group]
            if by_connection:
                self.connection_streams[owner] -= 1
                if not self.connection_streams[owner]:
                    del self.connection_streams[owner]
                    if self.engine is not None:
                        self.engine.store.drop_owner(owner)

    async def _draft(
        self, request: DraftMessage, owner: str, kind: type[DraftReply], later: list | None = None
    ) -> DraftReply:
        """The reply to `request`; with `later` (a stream's `branches_later`), the branches
        asked for are left in it for `DraftEngine.find_branches`."""
        updates = updates_from_proto(request)
        drafts = await self._on_engine("draft", updates, request.want_probs, owner, later)
        return response_to_proto(request.step, drafts, kind)

    async def _on_engine(self, method: str, *args):
        """`engine.<method>(*args)`: on the event loop for a cheap drafter, else on the pool.
        An open stream keeps drafting while the service drains."""
        engine = self._ready(new_call=False)
        if engine.inline:
            return getattr(engine, method)(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, getattr(engine, method), *args)

    def _ready(self, new_call: bool = True) -> DraftEngine:
        if self.engine is None:
            raise NotReady("drafter is still starting")
        if new_call and self.draining:
            raise NotReady("drafter is shutting down")
        return self.engine


@dataclass
class DrafterServer:
    """A running drafter service. `port` is the bound port (useful when asked for port 0)."""

    server: object  # grpc.aio.Server, run on `loop`
    servicer: DrafterServicer
    health: aio_health.HealthServicer
    port: int
    config: DrafterServiceConfig
    loop: LoopThread
    frames: FrameServer | None = None  # the unix socket (`--socket`), if any
    _stopped: bool = field(default=False, repr=False)

    @property
    def engine(self) -> DraftEngine:
        assert self.servicer.engine is not None
        return self.servicer.engine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self) -> None:
        self.loop.run(self.server.wait_for_termination())

    def drain(self, timeout: float) -> None:
        """SIGTERM: NOT_SERVING and UNAVAILABLE for new calls, open calls get `timeout` s."""
        self.servicer.draining = True
        self.stop(grace=timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls, let in-flight ones finish for `grace` seconds, free sessions."""
        if self._stopped:
            return
        self._stopped = True
        self.loop.run(self.health.enter_graceful_shutdown())

        async def stop_both() -> None:  # the socket's streams get the same grace, meanwhile
            stops = [self.server.stop(grace)]
            if self.frames is not None:
                stops.append(self.frames.stop(grace or 0.0))
            await asyncio.gather(*stops)

        self.loop.run(stop_both())
        self.loop.close()
        self.servicer.pool.shutdown(wait=True, cancel_futures=True)
        engine = self.servicer.engine
        if engine is not None:
            engine.store.clear()
            engine.drafter.close()
        TRACE.flush()


def serve(config: DrafterServiceConfig, drafter: SessionDrafter | None = None) -> DrafterServer:
    """Start the service; `drafter` overrides `config.drafter` (tests inject their own)."""
    loop = LoopThread("specwire-drafter-grpc", max(0.0, config.spin_ms) / 1000)
    servicer = DrafterServicer(config)

    async def start():
        server, port = build_server(config.host, config.port, config.security)
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
        health_servicer = aio_health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        return server, port, health_servicer

    try:
        server, port, health_servicer = loop.run(start())
    except BaseException:
        loop.close()
        raise
    running = DrafterServer(server, servicer, health_servicer, port, config, loop)
    if config.socket:
        running.frames = FrameServer(servicer, config.socket, config.security.tokens, loop.selector)
        try:
            loop.run(running.frames.start())
        except BaseException:
            running.frames = None
            running.stop(None)
            raise
    try:
        drafter = drafter or build_drafter(config)
    except BaseException:
        running.stop(None)
        raise
    store = SessionStore(
        drafter,
        config.session_ttl_s,
        max_sessions=config.max_sessions,
        max_tokens=config.max_session_tokens,
    )
    servicer.engine = DraftEngine(drafter, store, config.max_draft_len, config.delay_ms)

    async def ready():
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    loop.run(ready())
    also = f" and {config.socket}" if config.socket else ""
    log.info("drafter %s serving on %s:%d%s", drafter.name, config.host, port, also)

    return running
