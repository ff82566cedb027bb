"""The thin `specwire.v1.GenerationService` servicer, plus health and reflection.

Per RPC: protobuf -> GenerationParams, `Engine.normalize` (tokenise, template, validate, fan
out n) and `Engine.submit`, events -> protobuf. The server listens (health NOT_SERVING) while
the engine loads and warms up; Generate answers UNAVAILABLE until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from concurrent import futures

from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specwire.common.errors import UserError
from specwire.common.protogen import generation_pb2 as pb
from specwire.common.protogen import generation_pb2_grpc as pb_grpc
from specwire.common.reflection import enable_reflection
from specwire.common.security import ServerSecurity
from specwire.common.transport import LoopThread, build_server
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import Engine
from specwire.target_service.engine_process import EngineProcess
from specwire.target_service.events import (
    Chunk,
    Complete,
    Event,
    EventQueue,
    Failed,
    TokenLogprobs,
    next_message,
)
from specwire.target_service.output import OutputStream
from specwire.target_service.params import GenerationParams
from specwire.target_service.request import SpecStats

log = logging.getLogger(__name__)

FINISH = {
    "eos": pb.FINISH_REASON_EOS,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}
SERVICE_NAME = "specwire.v1.GenerationService"


class NotReady(UserError):
    code = "UNAVAILABLE"


def stats_to_proto(s: SpecStats) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        steps=s.steps,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        acceptance_rate=s.acceptance_rate,
        mean_accepted_length=s.mean_accepted_length,
        accepted_length_histogram=s.histogram,
        truncated_draft_tokens=s.truncated_draft_tokens,
        refused_draft_tokens=s.refused_draft_tokens,
    )


class QueueFull(UserError):
    code = "RESOURCE_EXHAUSTED"


CHAT_ROLES = ("system", "user", "assistant")


def check_admission(msg: pb.GenerateRequest, cfg: TargetConfig) -> None:
    """Cheap checks before any tokenising: prompt bytes, stop strings, chat roles."""
    which = msg.WhichOneof("input")
    if which == "prompt":
        size = len(msg.prompt.encode("utf-8", "surrogatepass"))
    elif which == "chat":
        size = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in msg.chat.messages)
        for i, m in enumerate(msg.chat.messages):
            if m.role not in CHAT_ROLES:
                raise UserError(
                    f"chat.messages[{i}].role {m.role!r} is not one of {', '.join(CHAT_ROLES)}"
                )
    else:
        size = 0
    if size > cfg.max_prompt_bytes:
        raise UserError(f"prompt is {size} bytes; this server accepts {cfg.max_prompt_bytes}")
    if len(msg.stop) > cfg.max_stop_strings:
        raise UserError(f"{len(msg.stop)} stop strings; this server accepts {cfg.max_stop_strings}")
    for i, stop in enumerate(msg.stop):
        if len(stop) > cfg.max_stop_len:
            raise UserError(
                f"stop[{i}] is {len(stop)} characters; this server accepts {cfg.max_stop_len}"
            )


def to_params(msg: pb.GenerateRequest) -> GenerationParams:
    which = msg.WhichOneof("input")
    s, spec = msg.sampling, msg.speculation
    return GenerationParams(
        prompt=msg.prompt if which == "prompt" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        chat=tuple({"role": m.role, "content": m.content} for m in msg.chat.messages)
        if which == "chat"
        else None,
        add_generation_prompt=msg.chat.add_generation_prompt
        if msg.chat.HasField("add_generation_prompt")
        else True,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        speculate=not spec.disable,
        max_draft_len=spec.max_draft_len if spec.HasField("max_draft_len") else None,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        n=msg.n if msg.HasField("n") else 1,
        request_id=msg.request_id or uuid.uuid4().hex,
    )


def _logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    t = lp.token
    return pb.TokenLogprob(
        token_id=t.token_id,
        token=t.token,
        logprob=t.logprob,
        top_logprobs=[
            pb.TopLogprob(token_id=a.token_id, token=a.token, logprob=a.logprob) for a in lp.top
        ],
    )


def chunk_to_proto(ev: Chunk) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        token_ids=ev.token_ids,
        text=ev.text,
        draft_tokens=ev.draft_tokens,
        accepted_tokens=ev.accepted_tokens,
        step=ev.step,
        logprobs=[_logprob_to_proto(lp) for lp in ev.logprobs or ()],
        index=ev.index,
        num_steps=ev.num_steps,
    )


def complete_to_proto(ev: Complete) -> pb.GenerateComplete:
    return pb.GenerateComplete(
        finish_reason=FINISH[ev.finish_reason],
        usage=pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
        speculation=stats_to_proto(ev.stats),
        text=ev.text,
        time_to_first_token_s=ev.time_to_first_token_s,
        total_time_s=ev.total_time_s,
        index=ev.index,
    )


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """Async handlers: a waiting call holds a coroutine, never a thread. Tokenising runs on a
    small thread pool (`tokenize_pool`), off the event loop and off the executor's thread."""

    def __init__(self, tokenize_workers: int = 4) -> None:
        self.engine: Engine | EngineProcess | None = None
        self.draining = False  # no new calls (health is NOT_SERVING)
        self.closed = False  # the executor is stopped
        self.tokenize_pool = futures.ThreadPoolExecutor(tokenize_workers, "specwire-tokenize")
        self.admitted = 0  # Generate calls past admission and not yet ended
        self.streams: set[OutputStream] = set()  # submitted to the executor, not yet ended
        self.idle = asyncio.Event()  # set while admitted == 0
        self.idle.set()

    def _engine(self) -> Engine | EngineProcess:
        if self.engine is None:
            raise NotReady("the target is still loading and warming up; retry shortly")
        return self.engine

    async def Generate(self, request, context):
        engine = self._engine()
        if self.draining:
            raise NotReady("the target is shutting down; retry on another replica")
        if self.admitted >= engine.config.max_in_flight:
            raise QueueFull(
                f"queue full: {self.admitted} requests in flight (limit "
                f"{engine.config.max_in_flight}); retry later"
            )
        check_admission(request, engine.config)
        self.admitted += 1
        self.idle.clear()
        streams: list[OutputStream] = []
        try:
            params = to_params(request)
            loop = asyncio.get_running_loop()
            # Tokenising runs on a small pool: off the event loop and off the executor.
            requests = await loop.run_in_executor(self.tokenize_pool, engine.normalize, params)
            if self.closed:
                raise NotReady("the target is shutting down; retry on another replica")
            events, streams = engine.submit(requests)
            self.streams.update(streams)
            async for response in self._responses(events, len(streams), params.request_id):
                yield response
        finally:
            for stream in streams:
                self.streams.discard(stream)
                if stream.request.finish_reason is None:  # the client went away: free blocks
                    engine.cancel(stream.request.request_id)
            self.admitted -= 1
            if self.admitted == 0:
                self.idle.set()

    async def _responses(self, events: EventQueue, running: int, rid: str):
        """The n completions' events, multiplexed (each carries its `index`), until every
        completion is done; a failure ends the whole stream (the rest are cancelled)."""
        pending: Event | None = None
        while running:
            first = pending if pending is not None else await events.aget()
            ev, pending = next_message(events, first)
            if isinstance(ev, Chunk):
                yield pb.GenerateResponse(request_id=rid, chunk=chunk_to_proto(ev))
            elif isinstance(ev, Complete):
                running -= 1
                yield pb.GenerateResponse(request_id=rid, complete=complete_to_proto(ev))
            elif isinstance(ev, Failed):
                yield pb.GenerateResponse(
                    request_id=rid, error=pb.GenerateError(code=ev.code, message=ev.message)
                )
                return

    async def GetModelInfo(self, request, context):
        engine = self._engine()
        if isinstance(engine, EngineProcess):  # asks the engine process: off the loop
            data = await asyncio.to_thread(engine.model_info_bytes)
            return pb.GetModelInfoResponse.FromString(data)
        return engine_info(engine)


def engine_info(e: Engine) -> pb.GetModelInfoResponse:
    """GetModelInfo's answer for an engine in this process."""
    cfg, loaded = e.config, e.loaded
    counters = e.drafter.counters() if hasattr(e.drafter, "counters") else {}
    return pb.GetModelInfoResponse(
        model=cfg.model,
        architecture=loaded.config.architecture,
        vocab_size=loaded.config.vocab_size,
        max_context_len=cfg.max_context_len,
        dtype=cfg.dtype,
        device=str(e.runner.device),
        drafter=cfg.drafter if e.drafter is not None else "none",
        max_draft_len=e.executor.max_draft_len,
        cuda_graphs=e.runner.graphs is not None,
        tokenizer_fingerprint=loaded.tokenizer.fingerprint,
        eos_token_id=loaded.tokenizer.eos_token_id or 0,
        speculation=stats_to_proto(e.executor.stats),
        drafter_counters=pb.DrafterCounters(
            **{
                k: v
                for k, v in counters.items()
                if k in pb.DrafterCounters.DESCRIPTOR.fields_by_name
            }
        ),
        kv_blocks_total=e.kv.num_blocks,
        kv_blocks_free=e.kv.num_free_blocks,
        kv_block_size=e.kv.block_size,
    )


class TargetServer:
    """A gRPC (aio) server that is up (health NOT_SERVING) before the engine is ready.

    Its event loop runs in a background thread; these methods are called from ordinary threads.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        security: ServerSecurity | None = None,
    ) -> None:
        self.host = host
        self.security = security or ServerSecurity()
        self.port_arg = port
        self._loop = LoopThread("specwire-target-grpc")
        self.servicer = GenerationServicer()
        try:
            self.server, self.port = self._loop.run(self._build())
        except BaseException:
            self._loop.close()
            raise
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()

    async def _build(self):
        server, port = build_server(self.host, self.port_arg, self.security)
        self.health = aio_health.HealthServicer()
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
        return server, port

    def _set(self, status) -> None:
        async def go():
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

        self._loop.run(go())

    def start(self) -> None:
        self._loop.run(self.server.start())

    def attach(self, engine: Engine | EngineProcess) -> None:
        """The engine is warm: serve it."""
        self.servicer.engine = engine
        engine.start()
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def mark_dead(self, exc: BaseException) -> None:
        """The executor died: stop looking healthy at once."""
        log.critical("target is NOT_SERVING: the executor stopped (%r)", exc)
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def drain(self, timeout: float) -> None:
        """Graceful shutdown: NOT_SERVING and UNAVAILABLE for new calls at once; in-flight
        requests get `timeout` seconds to finish, the rest a CANCELLED completion; then stop."""
        self.servicer.draining = True
        self._loop.run(self.health.enter_graceful_shutdown())
        self._loop.run(self._wait_idle(timeout))
        self._shutdown_engine()
        self._loop.run(self._wait_idle(5.0))  # let the CANCELLED completions reach the clients
        self._stop_server(1.0)

    async def _wait_idle(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.idle.wait(), timeout)

    def _shutdown_engine(self) -> None:
        engine = self.servicer.engine
        if engine is None:
            return
        self.servicer.closed = True
        engine.shutdown()  # the executor stops and cancels the requests it holds
        self._loop.run(self._cancel_leftovers())

    async def _cancel_leftovers(self) -> None:
        """Requests the executor had not taken in yet get their CANCELLED completion too."""
        for stream in list(self.servicer.streams):
            if stream.request.finish_reason is None:
                stream.finish("cancelled")

    def _stop_server(self, grace: float | None) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._loop.run(self.server.stop(grace))
        self._loop.close()
        self.servicer.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def stop(self, grace: float = 2.0) -> None:
        """Stop now: NOT_SERVING, in-flight requests cancelled, the server stopped."""
        if self._stopped.is_set():
            return
        self.servicer.draining = True
        self._loop.run(self.health.enter_graceful_shutdown())
        self._shutdown_engine()
        self._loop.run(self._wait_idle(min(grace, 2.0)))
        self._stop_server(grace)

    def wait(self) -> None:
        self._stopped.wait()
