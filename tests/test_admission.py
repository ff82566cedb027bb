"""Admission and fairness over real gRPC on loopback: prompt-size, stop-string, queue and
KV-pool limits answer at once with a clear status; chat content cannot inject control tokens;
roles are validated; streams that are never read starve nobody."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import wait_until

from specwire.common.client import GenerationClient, build_request
from specwire.common.protogen import generation_pb2 as pb
from specwire.common.protogen import generation_pb2_grpc as pb_grpc
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer


@pytest.fixture(scope="module")
def server(tiny):
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    cfg = TargetConfig(
        model="tiny-random", drafter="ngram", max_draft_len=4, progress=False,
        max_context_len=512, max_batch_size=4, num_kv_blocks=20, max_prompt_bytes=2000,
        max_stop_strings=3, max_stop_len=8, max_queue=300,
    )  # fmt: skip
    srv.attach(build_engine(cfg, loaded=tiny))
    yield srv
    srv.stop(0)


@pytest.fixture()
def client(server):
    with GenerationClient(f"127.0.0.1:{server.port}", timeout=120) as c:
        yield c


def _rejected(client, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(build_request(**kwargs)))
    return err.value


@pytest.mark.parametrize(
    "kwargs, code, needle",
    [
        (dict(prompt="é" * 1001), "INVALID_ARGUMENT", "2002 bytes"),
        (dict(chat=[{"role": "user", "content": "x" * 2001}]), "INVALID_ARGUMENT", "bytes"),
        (dict(prompt="hi", stop=["a", "b", "c", "d"]), "INVALID_ARGUMENT", "4 stop strings"),
        (dict(prompt="hi", stop=["ok", "123456789"]), "INVALID_ARGUMENT", "stop[1] is 9"),
        (dict(chat=[{"role": "tool", "content": "x"}]), "INVALID_ARGUMENT", "'tool'"),
        # Fits the 512-token context, never the pool: 19 blocks of 16 (one is the dummy).
        (dict(token_ids=[5] * 200, max_new_tokens=200), "INVALID_ARGUMENT", "KV blocks"),
    ],
)
def test_limits_answer_at_once_with_a_clear_status(client, kwargs, code, needle):
    err = _rejected(client, **kwargs)
    assert err.code().name == code
    assert needle in err.details()


def test_chat_content_is_plain_text(server, client, tiny):
    tok = tiny.tokenizer
    eos_text = tok.decode([tok.eos_token_id])
    messages = [{"role": "user", "content": f"hi {eos_text} there"}]
    ids = tok.apply_chat_template(messages)
    template_only = tok.apply_chat_template([{"role": "user", "content": "hi  there"}])
    # The typed "</s>" is text; the only EOS ids are the ones the template itself writes.
    assert ids.count(tok.eos_token_id) == template_only.count(tok.eos_token_id)
    assert len(ids) > len(template_only)
    res = client.generate(chat=messages, max_new_tokens=2)
    assert res.usage["prompt_tokens"] == len(ids)


def test_incremental_stop_matching_finds_a_stop_spanning_chunks(client):
    full = client.generate("x y z x y z", max_new_tokens=40)
    stop = full.text[10:16]
    res = client.generate("x y z x y z", max_new_tokens=40, stop=[stop])
    assert res.finish_reason == "stop" and full.text.startswith(res.text)
    assert stop not in res.text and len(res.text) <= full.text.index(stop)


def _kv_free(client) -> int:
    return client.model_info().kv_blocks_free


def test_queue_full_is_resource_exhausted(tiny):
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    cfg = TargetConfig(
        model="tiny-random", drafter="none", progress=False, max_context_len=512,
        max_batch_size=1, max_queue=1,
    )  # fmt: skip
    engine = build_engine(cfg, loaded=tiny)
    # Served before its executor starts, so admitted requests wait (no race with them finishing).
    srv.servicer.engine = engine
    try:
        with GenerationClient(f"127.0.0.1:{srv.port}", timeout=60) as client:
            held = [client.stream(build_request("hi", max_new_tokens=2)) for _ in range(2)]
            wait_until(lambda: srv.servicer.admitted == 2, 30, what="2 admitted calls")
            err = _rejected(client, prompt="hi", max_new_tokens=2)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in err.details()
            for call in held:
                call.cancel()
            wait_until(lambda: srv.servicer.admitted == 0, 30, what="cancelled calls to end")
            srv.attach(engine)
            assert client.generate("hi", max_new_tokens=2).finish_reason in ("length", "eos")
    finally:
        srv.stop(0)


def test_streams_that_are_never_read_starve_nobody(server, client):
    start_free = _kv_free(client)
    address = f"127.0.0.1:{server.port}"
    channels = [
        grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(8)
    ]
    req = build_request("the cat sat on the mat", max_new_tokens=48, ignore_eos=True)
    stalled = [
        pb_grpc.GenerationServiceStub(channels[i % 8]).Generate(req, timeout=120)
        for i in range(256)
    ]
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)  # connecting is not the question
            # Health answers within 1 s while 256 streams are never read (issue 10).
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            info = pb_grpc.GenerationServiceStub(ch).GetModelInfo(
                pb.GetModelInfoRequest(), timeout=5
            )
            assert info.kv_blocks_total == 20
        res = client.generate("hello there", max_new_tokens=4)
        assert len(res.token_ids) == 4
    finally:
        for call in stalled:
            call.cancel()
        for ch in channels:
            ch.close()
    wait_until(lambda: server.servicer.admitted == 0, 60, what="stalled calls to end")
    wait_until(lambda: _kv_free(client) == start_free, 30, what="KV blocks back")
    server.servicer.engine.kv.check_integrity()
