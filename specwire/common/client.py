"""A small Python client for specwire.v1.GenerationService (for the CLI, tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from specwire.common.protogen import generation_pb2 as pb
from specwire.common.protogen import generation_pb2_grpc as pb_grpc
from specwire.common.security import ClientSecurity
from specwire.common.transport import make_channel

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    speculation: dict
    chunks: list[pb.GenerateChunk] = field(default_factory=list, repr=False)
    usage: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "speculation": self.speculation,
            "usage": self.usage,
        }


def spec_stats_dict(s: pb.SpeculationStats) -> dict:
    return {
        "steps": s.steps,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4),
        "mean_accepted_length": round(s.mean_accepted_length, 4),
        "histogram": list(s.accepted_length_histogram),
        "truncated_draft_tokens": s.truncated_draft_tokens,
        "refused_draft_tokens": s.refused_draft_tokens,
    }


def build_request(
    prompt: str | None = None,
    *,
    token_ids: list[int] | None = None,
    chat: list[dict] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    speculate: bool = True,
    max_draft_len: int | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    logprobs: bool = False,
    top_logprobs: int | None = None,
    n: int | None = None,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id, stop=stop or [], ignore_eos=ignore_eos, logprobs=logprobs
    )
    if top_logprobs is not None:
        req.top_logprobs = top_logprobs
    if n is not None:
        req.n = n
    if chat is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in chat)
    elif token_ids is not None:
        req.prompt_token_ids.ids.extend(token_ids)
    else:
        req.prompt = prompt or ""
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    for name, value in (
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(req.sampling, name, value)
    req.speculation.disable = not speculate
    if max_draft_len is not None:
        req.speculation.max_draft_len = max_draft_len
    return req


class GenerationClient:
    def __init__(
        self, address: str, timeout: float | None = None, security: ClientSecurity | None = None
    ) -> None:
        self.channel = make_channel(address, security)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=self.timeout)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        chunks: list[pb.GenerateChunk] = []
        for resp in self.stream(build_request(prompt, **kwargs)):
            kind = resp.WhichOneof("response")
            if kind == "chunk":
                chunks.append(resp.chunk)
            elif kind == "error":
                raise RuntimeError(f"{resp.error.code}: {resp.error.message}")
            else:
                c = resp.complete
                return GenerationResult(
                    text=c.text,
                    token_ids=[t for ch in chunks for t in ch.token_ids],
                    finish_reason=FINISH_NAMES.get(c.finish_reason, "unspecified"),
                    speculation=spec_stats_dict(c.speculation),
                    chunks=chunks,
                    usage={
                        "prompt_tokens": c.usage.prompt_tokens,
                        "completion_tokens": c.usage.completion_tokens,
                        "time_to_first_token_s": c.time_to_first_token_s,
                        "total_time_s": c.total_time_s,
                    },
                )
        raise RuntimeError("the stream ended without a completion message")

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout or 10)
