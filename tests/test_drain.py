"""Graceful drain: SIGTERM -> NOT_SERVING and UNAVAILABLE for new calls; in-flight streams
finish or end with a CANCELLED completion (never a transport error); exit code 0."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import output_tail, running_service, wait_until

from specwire.common.client import FINISH_NAMES, GenerationClient, build_request

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _consume(
    client: GenerationClient, out: list, started: threading.Event, any_started: threading.Event
) -> None:
    req = build_request(token_ids=[5, 6, 7, 8], max_new_tokens=4000, ignore_eos=True)
    try:
        for resp in client.stream(req):
            started.set()
            any_started.set()
            if resp.WhichOneof("response") == "complete":
                out.append(FINISH_NAMES[resp.complete.finish_reason])
            elif resp.WhichOneof("response") == "error":
                out.append(f"error {resp.error.code}")
    except grpc.RpcError as exc:
        out.append(f"rpc {exc.code().name}")


@pytest.mark.parametrize(
    "where", [[], ["--engine-process", "on"]], ids=["in-process", "engine-process"]
)
def test_sigterm_drains_then_cancels_with_a_completion_and_exits_zero(where):
    cmd = SPECWIRE + [
        "target", "--model", "tiny-random", "--port", "0", "--no-progress", "--drafter", "none",
        "--max-context-len", "4096", "--max-batch-size", "2", "--drain-timeout", "1", *where,
    ]  # fmt: skip
    with running_service(cmd, ENV, r"listening on 127\.0\.0\.1:(\d+)", timeout=120) as (p, m):
        address = f"127.0.0.1:{m.group(1)}"
        with GenerationClient(address, timeout=60) as client:
            outcomes: list[str] = []
            started = [threading.Event() for _ in range(6)]
            any_started = threading.Event()
            threads = [
                threading.Thread(target=_consume, args=(client, outcomes, ev, any_started))
                for ev in started
            ]
            for t in threads:
                t.start()
            # Generation is under way for two of them (which two is up to the scheduler); the
            # rest wait for a batch slot.
            assert any_started.wait(60), output_tail(p)
            os.kill(p.pid, signal.SIGTERM)
            with grpc.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                try:
                    wait_until(
                        lambda: _status(health) != health_pb2.HealthCheckResponse.SERVING,
                        20,
                        0.05,
                        what="health to leave SERVING",
                    )
                except TimeoutError:
                    os.kill(p.pid, signal.SIGUSR1)  # its threads' stacks, for the report
                    time.sleep(1)
                    raise AssertionError(output_tail(p)) from None
            late = client.stream(build_request("hi", max_new_tokens=2))
            try:
                list(late)
                late_code = "OK"
            except grpc.RpcError as exc:
                late_code = exc.code().name
            for t in threads:
                t.join(60)
            assert p.wait(30) == 0
    assert late_code == "UNAVAILABLE"
    assert len(outcomes) == 6
    # A request still on its way in when SIGTERM lands is refused like any late one; every
    # request the server had admitted finishes or gets its CANCELLED completion.
    refused = outcomes.count("rpc UNAVAILABLE")
    assert refused <= sum(not ev.is_set() for ev in started), outcomes
    assert set(outcomes) <= {"length", "cancelled", "rpc UNAVAILABLE"}, outcomes
    assert "cancelled" in outcomes  # 6 x 4000 tokens, 2 at a time, cannot finish in 1 s


def _status(health) -> int:
    try:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return -1  # already gone


def test_sigusr1_prints_the_stacks_and_the_service_keeps_serving():
    cmd = SPECWIRE + ["drafter", "--host", "127.0.0.1", "--port", "0", "--drafter", "ngram"]
    with running_service(cmd, ENV, r"listening on 127\.0\.0\.1:(\d+)", timeout=60) as (p, m):
        os.kill(p.pid, signal.SIGUSR1)
        # The main thread's frames: it may be caught in StopSignal.wait or just before it
        # (the signal can come as soon as "listening" is printed), so any of our frames.
        our_frame = re.compile(r'File ".*specwire[/\\].*\.py", line \d+ in ')
        wait_until(lambda: our_frame.search(output_tail(p)), 10, what="a stack dump")
        assert p.poll() is None
        with grpc.insecure_channel(f"127.0.0.1:{m.group(1)}") as ch:
            assert _status(health_pb2_grpc.HealthStub(ch)) == health_pb2.HealthCheckResponse.SERVING
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
