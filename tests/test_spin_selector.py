"""transport.SpinSelector (`specwire drafter --spin-ms`): after an event the loop polls
instead of sleeping for the spin window, then sleeps as before; a loop run on it serves the
drafter service over gRPC and the unix socket alike."""

from __future__ import annotations

import os
import selectors
import time

from remote_harness import REPETITIVE, make_request

from specwire.common.transport import LoopThread, SpinSelector


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
        assert isinstance(loop.loop._selector, SpinSelector)  # noqa: SLF001
    finally:
        loop.close()


def test_a_drafter_service_with_spin_drafts_on_the_socket_and_the_stream(servers):
    for mode in ("socket", "stream"):
        server = servers(spin_ms=20)
        h = servers.harness(f"grpc://{server.address}", mode=mode, lookahead=0)
        assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]], mode
