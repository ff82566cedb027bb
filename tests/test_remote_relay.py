"""The remote drafter's stream through a relay process (`--drafter-mode relay`) against real
drafter services on loopback: what only the relay has, a process of its own that can die and
must not outlive its target. (The drafting behaviour it shares with the other modes is run in
relay mode too: `MODES` in remote_harness.py.)"""

from __future__ import annotations

import glob
import os
import signal
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest
from procs import free_port, wait_until
from remote_harness import REPETITIVE, Harness, make_request

from specwire.common.drafting import PROTOCOL_VERSION
from specwire.common.errors import UserError
from specwire.common.protogen import drafter_pb2
from specwire.common.security import ClientSecurity
from specwire.target_service.drafters.remote_relay import SPIN_ENV, QuestionFrames, RelayStreamCall


def children() -> set[int]:
    """This process's child processes (Linux: /proc/self/task/*/children)."""
    pids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path, encoding="ascii") as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # that thread ended since the listing (its children: none)
            continue
    return pids


def gone(pid: int) -> bool:
    """`pid` has exited (reaped, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_relay_fails_open_and_a_new_one_resumes_drafting(servers):
    server = servers()
    before = children()
    h = servers.harness(f"grpc://{server.address}", mode="relay", deadline_ms=5000)
    (relay,) = children() - before
    a = make_request("a", REPETITIVE)
    assert h.step([a]) == [[3, 4, 1, 2]]

    os.kill(relay, signal.SIGKILL)
    wait_until(lambda: gone(relay), timeout=5, what="the relay to die")
    # One token committed: the kept proposal (4 drafts, no room for a look-ahead at the
    # service's max_draft_len 4) no longer holds a full next draft, so the step must ask.
    a.output_ids += [3]
    t0 = time.monotonic()
    assert h.step([a]) == [[]]  # fails open, at once: not after the 5 s deadline
    assert time.monotonic() - t0 < 2.5
    assert h.counters()["failed"] >= 1

    # Reconnected in the background through a new relay, which the service sees as a new
    # caller (sessions belong to their connection): every sequence is re-sent whole.
    wait_until(lambda: h.step([a]) == [[4, 1, 2, 3]], timeout=15, what="drafts to resume")
    assert h.counters()["reconnects"] >= 2
    (new,) = children() - before
    assert new != relay


def test_closing_the_drafter_ends_its_relay(servers):
    server = servers()
    before = children()
    h = servers.harness(f"grpc://{server.address}", mode="relay")
    (relay,) = children() - before
    assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]
    h.drafter.close()  # returns at once; the relay ends and is reaped, not left behind
    wait_until(lambda: relay not in children(), timeout=5, what="the relay reaped")


def test_a_relay_that_cannot_reach_its_drafter_is_one_clear_error_and_leaves_nothing():
    port = free_port()  # nobody listens there
    before = children()
    with pytest.raises(UserError, match=f"drafter relay for 127.0.0.1:{port} "):
        RelayStreamCall(f"127.0.0.1:{port}", ClientSecurity(), timeout_s=0.5)
    wait_until(lambda: children() == before, timeout=5, what="the relay reaped")


def _garbage_server() -> tuple[grpc.Server, int]:
    """A drafter whose stream replies are bytes that do not parse (the relay passes bytes
    through unread, so the target is the first to parse them)."""
    info = drafter_pb2.GetInfoResponse(
        protocol_version=PROTOCOL_VERSION, name="garbage", capabilities=["stream"]
    )
    handler = grpc.method_handlers_generic_handler(
        drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name,
        {
            "GetInfo": grpc.unary_unary_rpc_method_handler(
                lambda request, context: info,
                request_deserializer=drafter_pb2.GetInfoRequest.FromString,
                response_serializer=drafter_pb2.GetInfoResponse.SerializeToString,
            ),
            # Field 1 as a length-delimited field longer than the message: a DecodeError.
            "DraftStream": grpc.stream_stream_rpc_method_handler(
                lambda requests, context: (b"\x0a\xff" for _ in requests)
            ),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.parametrize("mode", ["stream", "relay"])
def test_a_reply_that_does_not_parse_drops_the_connection_not_the_step(mode):
    """The relay's executor parses what gRPC's deserialiser parses on the stream: either way
    the step goes without drafts and the connection is re-opened."""
    server, port = _garbage_server()
    h = Harness(f"127.0.0.1:{port}", mode=mode, deadline_ms=1000)
    try:
        a = make_request("a", REPETITIVE)
        assert h.step([a]) == [[]]  # no drafts, no exception into the executor
        assert h.counters()["failed"] == 1
        wait_until(lambda: h.counters()["reconnects"] >= 2, timeout=10, what="a reconnect")
    finally:
        h.drafter.close()
        server.stop(None)


@pytest.mark.parametrize("spin", ["20", "0"])
def test_the_relay_drafts_whether_its_ends_poll_the_pipe_or_sleep_on_it(servers, monkeypatch, spin):
    """$SPECWIRE_RELAY_SPIN_MS: 20 makes the relay poll its stdin for 20 ms after a question
    and a waiting step poll the relay's stdout (no wake-up on the write); 0 (the default)
    makes both sleep in select(2). Either way the steps draft, across a pause longer than the
    poll window."""
    monkeypatch.setenv(SPIN_ENV, spin)
    server = servers()
    h = servers.harness(f"grpc://{server.address}", mode="relay", deadline_ms=5000)
    a = make_request("a", REPETITIVE)
    assert h.step([a]) == [[3, 4, 1, 2]]
    time.sleep(0.05)  # past the relay's 20 ms of polling: it sleeps until the next question
    a.output_ids += [3, 4, 1, 2, 3]
    assert h.step([a]) == [[4, 1, 2, 3]]
    assert h.counters()["failed"] == 0


def test_the_relays_reader_takes_frames_split_across_writes_and_ends_with_the_pipe():
    """`QuestionFrames`: a frame arrives in pieces, one after the poll window has passed (so it
    is waited for asleep), and the end of the pipe ends the frames."""
    rfd, wfd = os.pipe()
    questions = QuestionFrames(rfd, spin_s=0.005)
    frame = struct.pack("<I", 5) + b"hello"

    def write_later() -> None:
        os.write(wfd, frame[:3])
        time.sleep(0.02)
        os.write(wfd, frame[3:] + frame)
        os.close(wfd)

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        assert questions.frame() == b"hello"
        assert questions.frame() == b"hello"
        assert questions.frame() is None
    finally:
        writer.join()
        os.close(rfd)
