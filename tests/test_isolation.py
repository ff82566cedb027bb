"""One bad request never hurts another (issue 10, isolation): duplicate client ids, drafts to
the end of the context, bad sampling values, malformed drafts, failing plugins, and a dead
executor that must not look healthy. Real gRPC servers on loopback, tiny-random model."""

from __future__ import annotations

import math
import sys
import threading

import grpc
import pytest
from faulty_plugins import POISON_IDS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import free_port, running_service, wait_until

from specwire.common.client import GenerationClient
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer

PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "def f(x):\n    return f(x) + f(x",
    "one two three one two three one",
    "hello world, hello",
]


def _server(tiny, drafter: str, **kw) -> TargetServer:
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    cfg = TargetConfig(model="tiny-random", drafter=drafter, max_draft_len=4, progress=False, **kw)
    srv.attach(build_engine(cfg, loaded=tiny))
    return srv


@pytest.fixture(scope="module")
def ngram_server(tiny):
    srv = _server(tiny, "ngram", max_context_len=96)
    yield srv
    srv.stop(0)


def _client(srv: TargetServer) -> GenerationClient:
    return GenerationClient(f"127.0.0.1:{srv.port}", timeout=120)


def _concurrently(fns):
    """Run callables at once; return their results (or the exception each raised)."""
    out: list = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as exc:  # reported to the caller, who asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _kv_back(srv: TargetServer) -> None:
    """Every KV block returns to the pool (the executor frees just after the last event)."""
    kv = srv.servicer.engine.kv
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks - 1, timeout=10, what="KV blocks back")
    kv.check_integrity()


def test_duplicate_request_ids_run_independently(ngram_server):
    with _client(ngram_server) as c:
        alone = [c.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
        results = _concurrently(
            [
                lambda p=p: c.generate(p, max_new_tokens=20, request_id="same-id")
                for p in PROMPTS * 2
            ]
        )
        assert [r.token_ids for r in results] == alone * 2
        # The client's id is echoed on every message of its stream.
        from specwire.common.client import build_request

        ids = {r.request_id for r in c.stream(build_request(PROMPTS[0], request_id="same-id"))}
        assert ids == {"same-id"}
        # The executor survived and is still serving new requests.
        assert c.generate(PROMPTS[0], max_new_tokens=20).token_ids == alone[0]
    _kv_back(ngram_server)


def test_speculating_to_the_end_of_the_context_finishes_with_context(ngram_server):
    """Drafts near the end of the context used to index past the position table and fail
    every request of the step. Now the draft budget stops at the context end."""
    with _client(ngram_server) as c:
        short = [c.generate(p, max_new_tokens=8).token_ids for p in PROMPTS[1:]]
        fns = [lambda: c.generate("a b a b a b a b a b a b a b a b", ignore_eos=True)]
        fns += [lambda p=p: c.generate(p, max_new_tokens=8) for p in PROMPTS[1:]]
        to_end, *others = _concurrently(fns)
        assert not isinstance(to_end, Exception), to_end
        assert to_end.finish_reason == "context"
        assert to_end.usage["prompt_tokens"] + len(to_end.token_ids) == 96
        assert to_end.speculation["accepted_tokens"] > 0  # it did speculate up to the end
        assert [r.token_ids for r in others] == short
        spec_off = c.generate("a b a b a b a b a b a b a b a b", ignore_eos=True, speculate=False)
        assert spec_off.finish_reason == "context" and spec_off.token_ids == to_end.token_ids
    _kv_back(ngram_server)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0, 1e9])
def test_bad_temperature_is_invalid_argument(ngram_server, temperature):
    with _client(ngram_server) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(PROMPTS[0], max_new_tokens=4, temperature=temperature)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in err.value.details()


def test_tiny_temperature_decodes_greedily_beside_greedy_bystanders(ngram_server):
    with _client(ngram_server) as c:
        greedy = [c.generate(p, max_new_tokens=12).token_ids for p in PROMPTS]
        fns = [lambda p=p: c.generate(p, max_new_tokens=12) for p in PROMPTS]
        fns.append(lambda: c.generate(PROMPTS[0], max_new_tokens=12, temperature=1e-39))
        *bystanders, tiny_t = _concurrently(fns)
        assert [r.token_ids for r in bystanders] == greedy
        assert tiny_t.token_ids == greedy[0]


def test_malformed_drafts_are_refused_and_output_is_unchanged(tiny):
    base = _server(tiny, "none")
    bad = _server(tiny, "faulty_plugins:BoolDrafter")
    try:
        with _client(base) as c0, _client(bad) as c1:
            want = [c0.generate(p, max_new_tokens=16).token_ids for p in PROMPTS]
            got = _concurrently([lambda p=p: c1.generate(p, max_new_tokens=16) for p in PROMPTS])
            assert [r.token_ids for r in got] == want
            refused = sum(r.speculation["refused_draft_tokens"] for r in got)
            assert refused > 0 and sum(r.speculation["draft_tokens"] for r in got) == 0
        _kv_back(bad)
    finally:
        base.stop(0)
        bad.stop(0)


def test_failing_step_fails_only_the_request_that_causes_it(tiny):
    """A plugin resource manager raises whenever a poisoned request is in the batch (and its
    free() always raises): the executor bisects the batch, fails only the poisoned request,
    the bystanders finish exactly as alone, and no KV block leaks."""
    srv = _server(tiny, "faulty_plugins:PoisonDrafter")
    try:
        with _client(srv) as c:
            alone = [c.generate(p, max_new_tokens=16).token_ids for p in PROMPTS]
            fns = [lambda p=p: c.generate(p, max_new_tokens=16) for p in PROMPTS]
            fns.insert(2, lambda: c.generate(token_ids=POISON_IDS + [1, 2], max_new_tokens=16))
            results = _concurrently(fns)
            poisoned = results.pop(2)
            assert isinstance(poisoned, RuntimeError) and "INTERNAL" in str(poisoned)
            assert "poisoned" in str(poisoned)
            assert [r.token_ids for r in results] == alone
        _kv_back(srv)
    finally:
        srv.stop(0)


def test_dead_executor_turns_not_serving_and_exits_nonzero():
    """A plugin that calls sys.exit() inside a step kills the executor thread: the process
    must stop looking healthy and exit with a non-zero code (so orchestrators restart it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specwire.common.cli", "target", "--model", "tiny-random"]
    cmd += ["--port", str(port), "--no-progress", "--drafter", "faulty_plugins:ExitingDrafter"]
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), "tests"]))
    with running_service(cmd, env, r"listening on (\S+):(\d+)", timeout=120) as (proc, _):
        with _client_at(port) as c, pytest.raises(RuntimeError, match="INTERNAL"):
            c.generate("hello hello hello", max_new_tokens=8)
        assert proc.wait(timeout=30) == 1
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.RpcError):  # the process is gone: no SERVING answer
                stub.Check(health_pb2.HealthCheckRequest(), timeout=2)


def _client_at(port: int) -> GenerationClient:
    return GenerationClient(f"127.0.0.1:{port}", timeout=60)
