"""The thin `specwire.v1.Generation` servicer, plus health and reflection.

Per RPC: protobuf -> domain request (validated by the engine), one call into the executor,
events -> protobuf. The server listens (health NOT_SERVING) while the engine loads and warms
up; Generate answers UNAVAILABLE until then.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import UserError
from common.grpc_errors import ErrorInterceptor
from common.protogen import generation_pb2 as pb
from common.protogen import generation_pb2_grpc as pb_grpc
from common.reflection import enable_reflection
from target_service.engine import Engine
from target_service.output import Chunk, Complete, Failed
from target_service.request import SamplingConfig, SpecStats

log = logging.getLogger(__name__)

FINISH = {
    "eos": pb.FINISH_REASON_EOS,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}
SERVICE_NAME = "specwire.v1.Generation"


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


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None

    def _engine(self) -> Engine:
        if self.engine is None:
            raise NotReady("the target is still loading and warming up; retry shortly")
        return self.engine

    def _to_request(self, msg: pb.GenerateRequest, engine: Engine):
        tok = engine.loaded.tokenizer
        which = msg.WhichOneof("input")
        if which == "prompt":
            if not msg.prompt:
                raise UserError("prompt is empty")
            ids = tok.encode(msg.prompt)
        elif which == "prompt_token_ids":
            ids = list(msg.prompt_token_ids.ids)
        elif which == "chat":
            if not msg.chat.messages:
                raise UserError("chat has no messages")
            gen = (
                msg.chat.add_generation_prompt
                if msg.chat.HasField("add_generation_prompt")
                else True
            )
            ids = tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msg.chat.messages], gen
            )
        else:
            raise UserError("request has no input: set prompt, prompt_token_ids or chat")
        s = msg.sampling
        try:
            sampling = SamplingConfig(
                temperature=s.temperature if s.HasField("temperature") else 0.0,
                top_k=s.top_k if s.HasField("top_k") else 0,
                top_p=s.top_p if s.HasField("top_p") else 1.0,
                seed=s.seed if s.HasField("seed") else None,
            )
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        spec = msg.speculation
        return engine.new_request(
            ids,
            max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else None,
            sampling=sampling,
            stop=tuple(msg.stop),
            ignore_eos=msg.ignore_eos,
            speculate=not spec.disable,
            max_draft_len=spec.max_draft_len if spec.HasField("max_draft_len") else None,
            request_id=msg.request_id,
        )

    def Generate(self, request, context):
        engine = self._engine()
        req = self._to_request(request, engine)
        stream = engine.executor.submit(req)
        # Fires when the RPC ends for any reason; a client that went away frees its blocks.
        context.add_callback(lambda: engine.executor.cancel(req.request_id))
        rid = req.request_id
        while True:
            ev = stream.events.get()
            if isinstance(ev, Chunk):
                yield pb.GenerateResponse(
                    request_id=rid,
                    chunk=pb.GenerateChunk(
                        token_ids=ev.token_ids,
                        text=ev.text,
                        draft_tokens=ev.draft_tokens,
                        accepted_tokens=ev.accepted_tokens,
                        step=ev.step,
                    ),
                )
            elif isinstance(ev, Complete):
                yield pb.GenerateResponse(
                    request_id=rid,
                    complete=pb.GenerateComplete(
                        finish_reason=FINISH[ev.finish_reason],
                        usage=pb.Usage(
                            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens
                        ),
                        speculation=stats_to_proto(ev.stats),
                        text=ev.text,
                        time_to_first_token_s=ev.time_to_first_token_s,
                        total_time_s=ev.total_time_s,
                    ),
                )
                return
            elif isinstance(ev, Failed):
                yield pb.GenerateResponse(
                    request_id=rid, error=pb.GenerateError(code=ev.code, message=ev.message)
                )
                return

    def GetModelInfo(self, request, context):
        e = self._engine()
        cfg, loaded = e.config, e.loaded
        counters = e.drafter.counters() if hasattr(e.drafter, "counters") else {}
        return pb.ModelInfo(
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
    """A gRPC server that is up (health NOT_SERVING) before the engine is ready."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_workers: int = 64) -> None:
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=[ErrorInterceptor()],
            options=[("grpc.so_reuseport", 0)],
        )
        self.servicer = GenerationServicer()
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise UserError(f"cannot listen on {host}:{port} (address in use?)")
        self.host = host
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._done = threading.Event()

    def _set(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        self.server.start()

    def attach(self, engine: Engine) -> None:
        """The engine is warm: serve it."""
        self.servicer.engine = engine
        engine.executor.start()
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 2.0) -> None:
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace).wait()
        if self.servicer.engine is not None:
            self.servicer.engine.shutdown()
        self._done.set()

    def wait(self) -> None:
        self.server.wait_for_termination()
