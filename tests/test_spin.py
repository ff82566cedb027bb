"""Polling instead of sleeping, at both ends of the socket. The drafter's
`transport.SpinSelector` (`specwire drafter --spin-ms`): after an event the loop polls for the
spin window, then sleeps as before; a loop run on it serves the drafter service over gRPC and
the unix socket alike. The target's `--drafter-spin-ms`: a step waiting for a reply on the
socket polls (spends its thread's CPU) instead of sleeping."""

from __future__ import annotations

import json
import os
import selectors
import time

import pytest
from procs import wait_until
from remote_harness import REPETITIVE, make_request
from test_remote_socket import connect, frame, read_reply

from specwire.common.errors import UserError
from specwire.common.transport import LoopThread, SpinSelector
from specwire.target_service.config import TargetConfig


class CountingSelector(selectors.DefaultSelector):
    """The real selector, counting zero-timeout polls and sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = self.sleeps = 0

    def select(self, timeout=None):
        if timeout is not None and timeout <= 0:
            self.polls += 1
        else:
            self.sleeps += 1
        return super().select(timeout)


def test_it_polls_for_the_window_after_an_event_then_sleeps():
    inner = CountingSelector()
    sel = SpinSelector(inner, spin_s=0.05)
    r, w = os.pipe()
    try:
        sel.register(r, selectors.EVENT_READ)
        assert sel.select(0.01) == [] and inner.sleeps == 1 and inner.polls == 0  # idle: sleeps
        os.write(w, b"x")
        assert len(sel.select(1.0)) == 1  # an event opens the window
        os.read(r, 1)
        sleeps = inner.sleeps
        t0 = time.monotonic()
        assert sel.select(0.02) == []  # inside the window: polled for the whole timeout
        assert time.monotonic() - t0 >= 0.02
        assert inner.polls > 10 and inner.sleeps == sleeps
        os.write(w, b"y")
        assert len(sel.select(1.0)) == 1 and inner.sleeps == sleeps  # found by a poll
        os.read(r, 1)
        time.sleep(0.06)  # the window closes
        polls = inner.polls
        assert sel.select(0.01) == [] and inner.polls == polls and inner.sleeps == sleeps + 1
        assert set(sel.get_map()) == {r}
        sel.unregister(r)
        assert not sel.get_map()
    finally:
        sel.close()
        os.close(r)
        os.close(w)


def test_a_spinning_loop_runs_coroutines():
    loop = LoopThread("spin-test", spin_s=0.01)
    try:

        async def add(a, b):
            return a + b

        assert loop.run(add(2, 3), timeout=5) == 5
        # The loop runs on it: its wake-up descriptor is registered there.
        assert isinstance(loop.selector, SpinSelector) and loop.selector.get_map()
    finally:
        loop.close()


def test_a_drafter_service_with_spin_drafts_on_the_socket_and_the_stream(servers):
    # -1 (a target's auto, in the variable both read) is no polling of the service's own.
    assert servers(spin_ms=-1).frames.spin_s == 0
    for mode in ("socket", "stream"):
        server = servers(spin_ms=20)
        h = servers.harness(f"grpc://{server.address}", mode=mode, lookahead=0)
        assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]], mode


def _waiting_cpu_s(servers, spin_ms: float) -> float:
    """CPU seconds the executor's thread spends in a step that waits ~60 ms for its drafts."""
    server = servers(delay_ms=60)
    h = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0, spin_ms=spin_ms)
    assert h.step([make_request("warm", REPETITIVE)]) == [[3, 4, 1, 2]]  # sessions, connection
    t0, c0 = time.monotonic(), time.thread_time()
    assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]
    cpu, wall = time.thread_time() - c0, time.monotonic() - t0
    assert wall >= 0.05  # it did wait for the drafter's delay
    return cpu


def test_the_targets_waiting_step_polls_the_socket_only_with_drafter_spin_ms(servers):
    assert _waiting_cpu_s(servers, spin_ms=0) < 0.01  # asleep in select(2)
    assert _waiting_cpu_s(servers, spin_ms=100) > 0.02  # polling through the wait


def test_drafter_spin_ms_is_checked_and_auto_is_off_on_the_cpu():
    for bad in (-2, 101):
        with pytest.raises(UserError, match="--drafter-spin-ms must be from 0 to 100"):
            TargetConfig(drafter="grpc://127.0.0.1:1", drafter_spin_ms=bad)
    auto = TargetConfig(drafter="grpc://127.0.0.1:1", drafter_socket="/tmp/d.sock")
    assert auto.drafter_mode == "socket" and auto.drafter_spin_ms == 0  # a CPU target's cores
    assert TargetConfig(drafter_spin_ms=5).drafter_spin_ms == 5


def test_a_target_on_the_socket_has_the_drafter_poll_while_it_is_connected(servers):
    """`--drafter-spin-ms` asks the drafter service (the socket's setup) to poll as long after
    each event while that target is connected: the most any connection asked, or the
    service's own `--spin-ms`; a request past the limit is refused in the setup."""
    server = servers(spin_ms=5)
    frames = server.frames
    assert frames.spin_s == 0.005
    a = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0, spin_ms=20)
    assert a.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]
    assert frames.spin_s == 0.02
    b = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0, spin_ms=50)
    assert b.step([make_request("b", REPETITIVE)]) == [[3, 4, 1, 2]]
    assert frames.spin_s == 0.05
    b.drafter.close()
    wait_until(lambda: frames.spin_s == 0.02, 5, what="b's polling given back")
    a.drafter.close()
    wait_until(lambda: frames.spin_s == 0.005, 5, what="the service's own polling again")
    with connect(server.config.socket) as sock:
        sock.sendall(frame(json.dumps({"token": None, "spin_ms": 1000}).encode()))
        answer = json.loads(read_reply(sock)[0])
    assert answer == {"error": "spin_ms must be a number of milliseconds from 0 to 100"}
    assert frames.spin_s == 0.005
