"""A bounded hypothesis fuzz against a real target on loopback: every request, however odd,
gets a clean answer (a completion, or a status naming the problem; never INTERNAL, UNKNOWN or
a hang), and afterwards the server is healthy with every KV block back in the pool.

Sampling values are kept finite here: non-finite and subnormal values are the executor's
boundary validation (tested with it)."""

from __future__ import annotations

import contextlib
import string
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import wait_until

from specwire.common.protogen import generation_pb2 as pb
from specwire.common.protogen import generation_pb2_grpc as pb_grpc
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.server import serve
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer

VOCAB = 512  # tiny-random's, checked in the fixture
CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}

texts = st.text(max_size=80)
LETTERS = string.ascii_lowercase + " "
messages = st.lists(
    st.builds(
        pb.ChatMessage,
        role=st.sampled_from(["system", "user", "assistant", "tool", "", "USER"]),
        content=texts,
    ),
    max_size=4,
)


@st.composite
def requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=draw(st.sampled_from(["", "a", "b"])))
    kind = draw(st.sampled_from(["prompt", "long", "ids", "chat", "none"]))
    if kind == "prompt":
        req.prompt = draw(texts)
    elif kind == "long":  # over a step's token budget (--max-num-tokens 64): prefilled in
        # chunks, and mostly within the context (~40-340 tokens, two in three 65-199)
        req.prompt = draw(st.text(LETTERS, min_size=20, max_size=60)) * draw(st.integers(2, 6))
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.lists(st.integers(-3, VOCAB + 3), max_size=40)))
    elif kind == "chat":
        req.chat.messages.extend(draw(messages))
        if draw(st.booleans()):
            req.chat.add_generation_prompt = draw(st.booleans())
    if draw(st.booleans()):
        req.max_new_tokens = draw(st.integers(-2, 600))
    if draw(st.booleans()):
        # NaN, infinities and tiny values too: validated at the boundary (issue 10).
        req.sampling.temperature = draw(
            st.one_of(st.floats(-1, 3), st.floats(allow_nan=True), st.sampled_from([1e-39, 1e9]))
        )
    if draw(st.booleans()):
        req.sampling.top_k = draw(st.integers(-2, 700))
    if draw(st.booleans()):
        req.sampling.top_p = draw(st.one_of(st.floats(-0.5, 1.5), st.floats(allow_nan=True)))
    if draw(st.booleans()):
        req.sampling.seed = draw(st.integers(0, 2**64 - 1))
    req.stop.extend(draw(st.lists(st.text(max_size=6), max_size=5)))
    req.ignore_eos = draw(st.booleans())
    req.speculation.disable = draw(st.booleans())
    if draw(st.booleans()):
        req.speculation.max_draft_len = draw(st.integers(-2, 12))
    return req


@pytest.fixture(scope="module", params=["synchronous", "pipelined", "remote-pipelined"])
def target(tiny, request):
    """A target on loopback: the in-process n-gram drafter's synchronous steps, drafting on
    the device in pipelined steps (`--pipeline-drafts`: a step launched before the step
    before it is read; the CPU runs the same executor path), or a drafter service's n-gram
    drafter in pipelined steps (drafts on the hypothesis that the target follows its
    proposal)."""
    assert tiny.config.vocab_size == VOCAB
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    pipelined = request.param != "synchronous"
    drafter = "ngram"
    service = None
    if request.param == "remote-pipelined":
        service = serve(DrafterServiceConfig(host="127.0.0.1", port=0, drafter="ngram"))
        drafter = f"grpc://{service.address}"
    cfg = TargetConfig(
        model="tiny-random", drafter=drafter, max_draft_len=4, progress=False,
        max_context_len=256, max_batch_size=4, max_stop_strings=4, max_num_tokens=64,
        draft_on_device=request.param == "pipelined", pipeline_drafts=pipelined,
    )  # fmt: skip
    srv.attach(build_engine(cfg, loaded=tiny))
    srv.pipelined = pipelined
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, channel
    channel.close()
    srv.stop(0)
    if service is not None:
        service.stop(None)


def _info(channel) -> pb.GetModelInfoResponse:
    return pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def fuzz_generate(target, request):
    _, channel = target
    try:
        replies = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    except grpc.RpcError as exc:
        assert exc.code() in CLEAN, f"{exc.code().name}: {exc.details()} for {request}"
        return
    assert replies and replies[-1].WhichOneof("response") == "complete", replies[-1:]


def test_fuzzed_requests_get_clean_answers_and_leave_the_server_whole(target):
    fuzz_generate(target)
    srv, channel = target
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    wait_until(
        lambda: (i := _info(channel)).kv_blocks_free == i.kv_blocks_total - 1,
        30,
        what="every KV block back in the pool",
    )
    srv.servicer.engine.kv.check_integrity()


BYSTANDERS = ["the cat sat on the mat. the cat sat on the", "def f(x):\n    return f(x", "a b c a"]


def _bystander(channel, prompt: str) -> list[int]:
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=24, ignore_eos=True)
    replies = list(pb_grpc.GenerationServiceStub(channel).Generate(req, timeout=120))
    assert replies[-1].WhichOneof("response") == "complete", replies[-1:]
    return [t for r in replies if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(requests(), min_size=4, max_size=8))
def fuzz_beside_bystanders(target, alone, batch):
    """Fuzzed requests sent at once with greedy bystanders: the bystanders' tokens are exactly
    what they get alone, whatever the fuzzed requests do to their own steps."""
    _, channel = target
    results: dict[str, list[int]] = {}

    def fuzz(req):
        with contextlib.suppress(grpc.RpcError):  # clean statuses are checked by the test above
            list(pb_grpc.GenerationServiceStub(channel).Generate(req, timeout=60))

    def bystand(prompt):
        results[prompt] = _bystander(channel, prompt)

    threads = [threading.Thread(target=fuzz, args=(r,)) for r in batch]
    threads += [threading.Thread(target=bystand, args=(p,)) for p in BYSTANDERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == alone


def test_bystanders_finish_as_if_alone_beside_concurrent_fuzz(target):
    srv, channel = target
    alone = {p: _bystander(channel, p) for p in BYSTANDERS}
    fuzz_beside_bystanders(target, alone)
    metrics = srv.servicer.engine.executor.metrics
    pipelined = metrics.registry.get_sample_value(
        "specwire_pipelined_steps_total", {"model": metrics.model}
    )
    assert (pipelined > 0) == srv.pipelined  # the pipelined path really ran
    wait_until(
        lambda: (i := _info(channel)).kv_blocks_free == i.kv_blocks_total - 1,
        30,
        what="every KV block back in the pool",
    )
