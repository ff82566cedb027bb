"""The target service over real gRPC on loopback: streaming, errors, cancellation, health,
and the `specwire target` / `specwire generate` commands as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import free_port, running_service, wait_until

from specwire.common.client import GenerationClient, build_request
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]


@pytest.fixture(scope="module")
def server(tiny):
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    srv.attach(
        build_engine(
            TargetConfig(
                model="tiny-random",
                drafter="ngram",
                max_draft_len=4,
                progress=False,
                max_context_len=512,
            ),
            loaded=tiny,
        )
    )
    yield srv
    srv.stop(0)


@pytest.fixture()
def client(server):
    with GenerationClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


def test_generate_streams_chunks_then_completion(client):
    res = client.generate("the cat sat on the mat. the cat sat on the", max_new_tokens=20)
    assert res.finish_reason in ("length", "eos")
    assert res.usage["completion_tokens"] == len(res.token_ids) <= 20
    assert res.chunks and all(
        len(c.token_ids) == c.num_steps + c.accepted_tokens or res.finish_reason != "length"
        for c in res.chunks[:-1]
    )
    spec = res.speculation
    assert all(c.num_steps >= 1 for c in res.chunks)
    assert spec["steps"] == sum(c.num_steps for c in res.chunks)
    assert sum(c.accepted_tokens for c in res.chunks) == spec["accepted_tokens"]
    assert sum(spec["histogram"]) == spec["steps"]
    assert res.text == "".join(c.text for c in res.chunks)


def test_spec_and_no_spec_agree_over_grpc(client):
    for prompt in ("a b c a b c a b", "def f(x):\n    return f(x", "hello"):
        a = client.generate(prompt, max_new_tokens=16)
        b = client.generate(prompt, max_new_tokens=16, speculate=False)
        assert a.token_ids == b.token_ids
        assert b.speculation["draft_tokens"] == 0


def test_token_ids_and_chat_inputs(client):
    by_ids = client.generate(token_ids=[0, 70, 71, 72], max_new_tokens=5)
    assert len(by_ids.token_ids) == 5
    chat = client.generate(chat=[{"role": "user", "content": "hi"}], max_new_tokens=5)
    assert len(chat.token_ids) == 5


def test_stop_string_is_honoured_and_not_returned(client):
    full = client.generate("x y z x y z", max_new_tokens=30, stop=[])
    assert len(full.text) > 4
    stop = full.text[2:4]
    res = client.generate("x y z x y z", max_new_tokens=30, stop=[stop])
    assert res.finish_reason == "stop"
    assert stop not in res.text and full.text.startswith(res.text)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt": "hi", "max_new_tokens": 100000}, "exceeds the context"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature must be in [0, 100]"),
        ({"prompt": "hi", "temperature": 1.0, "top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"prompt": "hi", "temperature": 1.0, "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"token_ids": [1, 99999]}, "outside the vocabulary"),
        ({"prompt": "word " * 600}, "the context holds 512"),
    ],
)
def test_bad_requests_are_invalid_argument(client, kwargs, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(build_request(**kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


def test_client_disconnect_frees_blocks_and_others_keep_running(server, client):
    info = client.model_info()
    total = info.kv_blocks_total
    # A long generation that we abandon after the first chunk.
    call = client.stub.Generate(
        build_request("abandon me " * 10, max_new_tokens=400, speculate=False)
    )
    next(iter(call))
    other = {}
    t = threading.Thread(
        target=lambda: other.update(r=client.generate("keep going", max_new_tokens=30))
    )
    t.start()
    call.cancel()
    t.join(60)
    assert other["r"].usage["completion_tokens"] == 30
    wait_until(
        lambda: client.model_info().kv_blocks_free == total - 1,
        timeout=20,
        what="all KV blocks back in the pool",
    )
    server.servicer.engine.kv.check_integrity()


def test_seeded_sampling_is_reproducible(client):
    a = client.generate("once upon", max_new_tokens=12, temperature=0.9, seed=123)
    b = client.generate("once upon", max_new_tokens=12, temperature=0.9, seed=123)
    assert a.token_ids == b.token_ids


def test_a_finished_request_is_already_counted_when_its_client_hears(client):
    """A synchronous step's records (acceptance, metrics) wait until the next launch, but are
    made before its rendering is handed over: the moment a response completes, the engine's
    counters already hold every one of its steps."""
    for i in range(3):
        before = client.model_info().speculation
        res = client.generate(f"the cat sat on the mat. the cat sat on the {i}", max_new_tokens=24)
        after = client.model_info().speculation
        mine = res.speculation
        assert mine["steps"] > 0 and mine["draft_tokens"] > 0  # it speculated
        assert after.steps - before.steps >= mine["steps"]
        assert after.draft_tokens - before.draft_tokens >= mine["draft_tokens"]
        assert after.accepted_tokens - before.accepted_tokens >= mine["accepted_tokens"]


def test_model_info_and_health(server, client):
    info = client.model_info()
    assert info.drafter == "ngram" and info.max_draft_len == 4
    assert info.vocab_size == 512 and info.tokenizer_fingerprint
    assert info.speculation.steps > 0
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    resp = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service="specwire.v1.GenerationService")
    )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    ch.close()


def test_not_ready_server_is_not_serving_and_unavailable():
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with GenerationClient(f"127.0.0.1:{srv.port}") as c, pytest.raises(grpc.RpcError) as err:
            c.generate("hi", max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()
    finally:
        srv.stop(0)


def test_cli_target_and_generate_json():
    metrics_port = free_port()
    cmd = SPECWIRE + [
        "target",
        "--model",
        "tiny-random",
        "--port",
        "0",
        "--no-progress",
        "--max-context-len",
        "512",
        "--metrics-port",
        str(metrics_port),
    ]
    with running_service(cmd, None, r"listening on ([\d.]+:\d+)", timeout=120) as (_, m):
        addr = m.group(1)
        out = {}
        for flag in ([], ["--no-speculation"]):
            proc = subprocess.run(
                SPECWIRE
                + [
                    "generate",
                    "--target",
                    addr,
                    "--prompt",
                    "a b a b a b",
                    "--max-new-tokens",
                    "12",
                    "--json",
                    *flag,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr
            out[bool(flag)] = json.loads(proc.stdout)
        assert out[False]["token_ids"] == out[True]["token_ids"]
        for key in (
            "steps",
            "draft_tokens",
            "accepted_tokens",
            "acceptance_rate",
            "mean_accepted_length",
            "histogram",
        ):
            assert key in out[False]["speculation"]
        bad = subprocess.run(
            SPECWIRE + ["generate", "--target", addr, "--prompt", "hi", "--max-new-tokens", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0
        assert bad.stderr.count("\n") == 1 and "max_new_tokens must be >= 1" in bad.stderr
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        generated = [
            ln for ln in text.splitlines() if ln.startswith("specwire_generated_tokens_total")
        ]
        assert generated and float(generated[0].split()[-1]) >= 24


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--model", "tiny-random", "--drafter", "bogus"], "unknown drafter"),
        (["--model", "tiny-random", "--drafter", "nosuchmodule:X"], "cannot import drafter"),
        (["--model", "tiny-random", "--max-draft-len", "-2"], "--max-draft-len must be >= 0"),
        (["--model", "tiny-random", "--two-batch-rows", "-2"], "--two-batch-rows must be >= 0"),
    ],
)
def test_cli_target_bad_flags_one_line_error(args, needle):
    proc = subprocess.run(
        SPECWIRE + ["target", "--port", "0", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("specwire: error")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_chunks_waiting_to_be_sent_go_out_together():
    """When the servicer falls behind the executor (a loaded server), the chunks waiting in a
    stream's queue go out as one message with their counts summed; a completion never merges
    and the other completions' chunks keep their own messages."""
    from specwire.target_service.events import Chunk, Complete, EventQueue, next_message
    from specwire.target_service.request import SpecStats

    events = EventQueue()
    for step, (toks, drafted, acc) in enumerate([([1, 2], 3, 1), ([3], 0, 0), ([4, 5, 6], 4, 2)]):
        events.put(Chunk(toks, f"t{step}", drafted, acc, step))
    other = Chunk([9], "other", 0, 0, 3, index=1)
    events.put(other)
    done = Complete("length", 3, 6, SpecStats(), "t0t1t2", 0.1, 0.2)
    events.put(done)

    merged, pending = next_message(events, events.get_nowait())
    assert merged.token_ids == [1, 2, 3, 4, 5, 6] and merged.text == "t0t1t2"
    assert (merged.num_steps, merged.draft_tokens, merged.accepted_tokens) == (3, 7, 3)
    assert len(merged.token_ids) == merged.num_steps + merged.accepted_tokens
    assert merged.step == 2 and pending is other  # another completion's chunk: not merged
    assert next_message(events, pending) == (other, done)  # a completion never merges
    assert next_message(events, done) == (done, None)


@pytest.fixture(scope="module")
def sparse_server(tiny):
    """The same engine streaming one chunk per 4 steps (--stream-interval 4)."""
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    cfg = TargetConfig(
        model="tiny-random",
        drafter="ngram",
        max_draft_len=4,
        progress=False,
        max_context_len=512,
        stream_interval=4,
    )
    srv.attach(build_engine(cfg, loaded=tiny))
    yield srv
    srv.stop(0)


@pytest.mark.parametrize("speculate", [True, False])
def test_stream_interval_sends_fewer_chunks_with_the_same_output(client, sparse_server, speculate):
    """--stream-interval N: the first chunk goes out at once (time to first token), the rest
    once they span N steps, the last whatever it spans; tokens, text and counts are those of
    a server streaming every step."""
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    every = client.generate(prompt, max_new_tokens=40, speculate=speculate)
    with GenerationClient(f"127.0.0.1:{sparse_server.port}", timeout=60) as c:
        sparse = c.generate(prompt, max_new_tokens=40, speculate=speculate)
    assert sparse.token_ids == every.token_ids and sparse.text == every.text
    assert sparse.text == "".join(ch.text for ch in sparse.chunks)
    assert sum(len(ch.token_ids) for ch in sparse.chunks) == len(sparse.token_ids)
    steps = sparse.speculation["steps"]
    assert steps == sum(ch.num_steps for ch in sparse.chunks) > 4
    # the first chunk is never held (it may still merge with the next one if the servicer
    # was slow to send it; the unit test below checks the holding itself)
    assert sparse.chunks[0].num_steps == 1 or sparse.chunks[0].num_steps >= 5
    assert all(ch.num_steps >= 4 for ch in sparse.chunks[1:-1])
    # (the interval-1 stream may merge chunks too when its servicer falls behind: compare
    # with the steps, not with its chunk count)
    assert len(sparse.chunks) <= 2 + (steps - 1) // 4 < steps


def test_stream_interval_below_one_is_refused() -> None:
    from specwire.common.errors import UserError

    with pytest.raises(UserError, match="--stream-interval must be >= 1, got 0"):
        TargetConfig(stream_interval=0)


@pytest.mark.parametrize("end", ["cancelled", "failed"])
def test_held_tokens_go_out_before_a_cancel_and_not_after_a_failure(tiny, end) -> None:
    """A stream ended from outside while it holds rendered tokens (--stream-interval): a
    cancel sends them before its completion (completion_tokens counts them); a failure ends
    the stream with the error alone."""
    from specwire.target_service.events import Chunk, Complete, Failed
    from specwire.target_service.output import OutputStream
    from specwire.target_service.request import Request

    req = Request("r", [1, 2, 3], max_new_tokens=100)
    stream = OutputStream(req, tiny.tokenizer, set(), 512, interval=8)
    for step, tok in enumerate([40, 41, 42]):
        stream.commit([tok], 0, 0, step)
    if end == "cancelled":
        stream.finish("cancelled")
    else:
        stream.fail("INTERNAL", "step failed")
    events = []
    while (ev := stream.events.get_nowait()) is not None:
        events.append(ev)
    assert isinstance(events[0], Chunk) and events[0].token_ids == [40]  # never held
    if end == "cancelled":
        assert [type(e) for e in events] == [Chunk, Chunk, Complete]
        assert events[1].token_ids == [41, 42] and events[1].num_steps == 2
        assert events[2].completion_tokens == 3 and events[2].token_ids == [40, 41, 42]
    else:
        assert [type(e) for e in events] == [Chunk, Failed]


@pytest.mark.parametrize("batched_itls", [False, True])
def test_appending_a_chunk_applies_the_finish_rules_token_by_token(tiny, batched_itls) -> None:
    """`OutputStream.append` keeps the tokens up to the first that ends the request (EOS
    unless ignored, the context, the length) whether or not it takes its shortcut for chunks
    that cannot end it: against the rules applied one token at a time. With `itls` (the
    executor's step-at-once latencies) one latency per chunk after the first is collected."""
    import random

    from specwire.target_service.output import OutputStream
    from specwire.target_service.request import Request

    rng = random.Random(5)
    for _ in range(300):
        prompt = [1] * rng.randint(1, 6)
        req = Request("r", prompt, max_new_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.2)
        eos, context = {rng.randint(0, 9)}, len(prompt) + rng.randint(1, 14)
        stream = OutputStream(req, tiny.tokenizer, eos, context)
        expected: list[int] = []
        itls: list[float] | None = [] if batched_itls else None
        chunks = 0
        while True:
            chunk = [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]
            want, why = [], None
            for tok in chunk:
                want.append(tok)
                n = len(expected) + len(want)
                if tok in eos and not req.ignore_eos:
                    why = "eos"
                elif len(prompt) + n >= context:
                    why = "context"
                elif n >= req.max_new_tokens:
                    why = "length"
                if why:
                    break
            kept, reason = stream.append(chunk, itls)
            chunks += 1
            expected += want
            assert (kept, reason) == (want, why)
            assert req.output_ids == expected
            if reason:
                break
        if itls is not None:
            assert len(itls) == chunks - 1
