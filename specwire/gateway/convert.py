"""OpenAI bodies -> GenerateRequest, and Generate's messages -> OpenAI response objects.

A request's n choices are the gRPC request's n completions; a choice's index is the completion's
`index`. Speculation statistics ride in an extension field, `speculation`, on each choice (and
summed over the choices on a non-streaming response).
"""

from __future__ import annotations

from specwire.common.client import FINISH_NAMES, build_request, spec_stats_dict
from specwire.common.protogen import generation_pb2 as pb
from specwire.gateway.schemas import ChatCompletionRequest, CompletionRequest

# specwire finish reasons -> OpenAI's: EOS and stop strings are "stop"; a full context is as
# good as running out of max_tokens.
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class BadRequest(ValueError):
    """A body the gateway refuses itself (400), before asking the target."""


def _check(body: CompletionRequest | ChatCompletionRequest) -> None:
    bad = body.unsupported()
    if bad:
        raise BadRequest(f"not supported by specwire: {', '.join(bad)}")


def _sampling(body: CompletionRequest | ChatCompletionRequest) -> dict:
    return dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_list,
        n=body.n,
        ignore_eos=body.ignore_eos,
    )


def completion_to_grpc(body: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    _check(body)
    prompt = body.prompt
    kw = _sampling(body)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        kw["token_ids"] = list(prompt)
    elif isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("specwire takes one prompt per request (send several requests)")
        kw["prompt"] = prompt[0]
    else:
        kw["prompt"] = prompt
    return build_request(
        **kw,
        max_new_tokens=body.max_tokens,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs,
        request_id=request_id,
    )


def chat_to_grpc(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    _check(body)
    return build_request(
        chat=[{"role": m.role, "content": m.text} for m in body.messages],
        **_sampling(body),
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs,
        request_id=request_id,
    )


def finish_reason(complete: pb.GenerateComplete) -> str:
    return OPENAI_FINISH.get(FINISH_NAMES.get(complete.finish_reason, ""), "stop")


def usage(completes: list[pb.GenerateComplete]) -> dict:
    """Prompt tokens are counted once (the n choices share the prompt), as OpenAI does."""
    prompt = completes[0].usage.prompt_tokens if completes else 0
    completion = sum(c.usage.completion_tokens for c in completes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def speculation(completes: list[pb.GenerateComplete]) -> dict:
    """Speculation statistics summed over the choices."""
    total = pb.SpeculationStats()
    hist: list[int] = []
    for c in completes:
        s = c.speculation
        total.steps += s.steps
        total.draft_tokens += s.draft_tokens
        total.accepted_tokens += s.accepted_tokens
        total.truncated_draft_tokens += s.truncated_draft_tokens
        total.refused_draft_tokens += s.refused_draft_tokens
        for i, n in enumerate(s.accepted_length_histogram):
            hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += n
    total.accepted_length_histogram.extend(hist)
    if total.draft_tokens:
        total.acceptance_rate = total.accepted_tokens / total.draft_tokens
    if total.steps:
        total.mean_accepted_length = (total.accepted_tokens + total.steps) / total.steps
    return spec_stats_dict(total)


# -- logprobs in OpenAI's two formats ------------------------------------------------------------


def chat_logprobs(items: list[pb.TokenLogprob]) -> list[dict]:
    """Chat style: `logprobs.content` entries."""

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {
            **one(lp.token, lp.logprob),
            "top_logprobs": [one(t.token, t.logprob) for t in lp.top_logprobs],
        }
        for lp in items
    ]


def completion_logprobs(items: list[pb.TokenLogprob], text_offset: int) -> dict:
    """Completions style: parallel lists; `text_offset` is where the first token starts."""
    offsets = []
    for lp in items:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in items],
        "text_offset": offsets,
    }
