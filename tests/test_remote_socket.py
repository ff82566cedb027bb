"""The remote drafter's DraftStream on the drafter service's unix socket (`specwire drafter
--socket PATH`, `--drafter-mode socket --drafter-socket PATH`): what only the socket has, its
setup, who may connect, its file, and the CLI end to end with real processes. (The drafting
behaviour it shares with the other modes runs in socket mode too: `MODES` in
remote_harness.py, and test_remote_e2e.py's lossless, held-back, gain and kill/restart tests.)"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from procs import free_port, running_service, wait_until
from remote_harness import REPETITIVE, make_request

from specwire.common.client import GenerationClient
from specwire.common.errors import UserError
from specwire.common.frames import FAILED, MAX_FRAME, QUESTION, REPLY
from specwire.common.security import ClientSecurity, ServerSecurity, token_identity
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.drafters import NGramDrafter
from specwire.target_service.drafters.remote_frames import SocketStreamCall

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]


def frame(payload: bytes) -> bytes:
    return QUESTION.pack(len(payload)) + payload


def read_reply(sock: socket.socket) -> tuple[bytes, float]:
    """One reply frame (payload, time) off a blocking socket."""
    head = b""
    while len(head) < REPLY.size:
        chunk = sock.recv(REPLY.size - len(head))
        assert chunk, "the socket closed before a whole reply"
        head += chunk
    n, at = REPLY.unpack(head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return body, at


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_the_socket_drafts_as_the_stream_does_and_frees_its_sessions_when_closed(servers):
    server = servers()
    h = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0)
    a = make_request("a", REPETITIVE)
    assert h.step([a]) == [[3, 4, 1, 2]]
    a.output_ids += [3, 4]
    assert h.step([a]) == [[1, 2, 3, 4]]
    store = server.engine.store
    assert store.get("a").tokens == a.token_ids
    # The sessions of a caller without a token are its connection's: gone when it closes.
    h.drafter.close()
    wait_until(lambda: len(store) == 0, timeout=10, what="the connection's sessions freed")
    assert h.counters()["failed"] == 0


def test_the_socket_file_is_the_services_users_alone_and_goes_with_the_service(servers):
    server = servers()
    path = server.config.socket
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert "socket" in server.servicer.info().capabilities
    server.stop(None)
    assert not os.path.exists(path)


def test_a_stale_socket_is_replaced_and_a_live_one_or_a_file_refused(servers, tmp_path):
    stale = str(tmp_path / "stale.sock")
    left = socket.socket(socket.AF_UNIX)
    left.bind(stale)  # a socket file nobody serves (a service that died)
    left.close()
    server = servers(socket=stale)
    h = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0)
    assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]
    with pytest.raises(UserError, match="another process serves it"):
        servers(socket=stale)  # the first service's, live: never taken over
    assert h.step([make_request("b", REPETITIVE)]) == [[3, 4, 1, 2]]
    taken = tmp_path / "file"
    taken.write_text("not a socket")
    with pytest.raises(UserError, match="--socket .*file: cannot listen"):
        servers(socket=str(taken))
    assert taken.read_text() == "not a socket"  # never removed
    with pytest.raises(UserError, match="longer than 107 bytes"):
        DrafterServiceConfig(socket="/tmp/" + "x" * 120)


def test_a_target_needs_the_token_and_the_right_drafters_socket(servers):
    secured = servers(security=ServerSecurity(tokens=("s3cret",)))
    address = f"grpc://{secured.address}"
    good = servers.harness(address, mode="socket", security=ClientSecurity(token="s3cret"))
    a = make_request("a", REPETITIVE)
    assert good.step([a]) == [[3, 4, 1, 2]]
    # The token's sessions, as on gRPC (not the connection's).
    assert secured.engine.store.get("a", token_identity("s3cret")) is not None
    # The socket checks the token itself (gRPC's handshake would refuse a wrong one first).
    info = good.drafter.connection.info
    with pytest.raises(UserError, match="refused \\(missing or invalid token\\)"):
        SocketStreamCall(secured.config.socket, "guess", info, timeout_s=5)

    # A socket speaks for its own service alone: the setup's answer must be the handshake's.
    other = servers(instance=type("OtherNGram", (NGramDrafter,), {"name": "other-ngram"})())
    plain = servers()
    with pytest.raises(UserError, match="is another drafter's than --drafter's .*name"):
        servers.harness(f"grpc://{plain.address}", mode="socket", socket=other.config.socket)
    with pytest.raises(UserError, match="cannot connect"):
        servers.harness(f"grpc://{plain.address}", mode="socket", socket="/nonexistent/d.sock")
    bare = servers(socket="")
    with pytest.raises(UserError, match="serves no socket: start it with --socket"):
        servers.harness(f"grpc://{bare.address}", mode="socket", socket="/x.sock")


def test_a_wrong_token_on_the_socket_is_refused_in_one_frame(servers):
    secured = servers(security=ServerSecurity(tokens=("s3cret",)))
    for token in (None, "guess"):
        with connect(secured.config.socket) as sock:
            sock.sendall(frame(json.dumps({"token": token}).encode()))
            body, _ = read_reply(sock)
            assert json.loads(body) == {"error": "missing or invalid token"}
            assert sock.recv(1) == b""  # and closed
    with connect(secured.config.socket) as sock:
        sock.sendall(frame(json.dumps({"token": "s3cret"}).encode()))
        info = json.loads(read_reply(sock)[0])["info"]
        assert info["name"] == "ngram" and info["vocab_size"] == secured.engine.drafter.vocab_size


def test_a_question_that_does_not_parse_ends_that_stream_alone_and_says_why(servers):
    server = servers()
    h = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0)
    with connect(server.config.socket) as sock:
        sock.sendall(frame(json.dumps({"token": None}).encode()))
        assert "info" in json.loads(read_reply(sock)[0])
        sock.sendall(frame(b"\xff\xff\xff garbage"))
        why, at = read_reply(sock)
        assert at == FAILED and why.startswith(b"INVALID_ARGUMENT: a question that does not parse")
        assert sock.recv(1) == b""
    with connect(server.config.socket) as sock:  # a length past gRPC's limit: refused unread
        sock.sendall(frame(json.dumps({"token": None}).encode()))
        read_reply(sock)
        sock.sendall(QUESTION.pack(MAX_FRAME + 1))
        why, at = read_reply(sock)
        assert at == FAILED and b"at most 4194304" in why
    # The service and the other connection keep drafting.
    assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]


def test_the_cli_pair_over_the_socket_matches_plain_decoding(tmp_path):
    """`specwire drafter --socket`, `specwire target --drafter-socket` (the mode, auto, becomes
    socket with a path: the listening line says so), real processes: output equal to the same
    target without speculation, drafts accepted; a socket mode without its path, or a path with
    another mode, is one line on stderr."""
    sock = str(tmp_path / "d.sock")
    dport, tport, pport = free_port(), free_port(), free_port()
    drafter = SPECWIRE + ["drafter", "--port", str(dport), "--socket", sock]
    target = SPECWIRE + ["target", "--model", "tiny-random", "--no-progress"]
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    with running_service(drafter, None, f"listening on 127.0.0.1:{dport} and {sock}", 60):
        spec = target + ["--port", str(tport), "--drafter", f"grpc://127.0.0.1:{dport}"]
        spec += ["--drafter-socket", sock]
        line = re.escape(f"drafter=grpc://127.0.0.1:{dport} (socket {sock}) ")
        with running_service(spec, None, line, timeout=120):
            with GenerationClient(f"127.0.0.1:{tport}", timeout=60) as client:
                out = client.generate(prompt, max_new_tokens=40)
                c = client.model_info().drafter_counters
        with running_service(target + ["--port", str(pport)], None, r"listening on", 120):
            with GenerationClient(f"127.0.0.1:{pport}", timeout=60) as client:
                plain = client.generate(prompt, max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    assert out.speculation["accepted_tokens"] > 0 and c.failed == 0
    remote = target + ["--drafter", f"grpc://127.0.0.1:{dport}"]
    for args, error in (
        (["--drafter-mode", "socket"], "--drafter-mode socket needs --drafter-socket PATH"),
        (["--drafter-mode", "stream", "--drafter-socket", sock], "--drafter-socket is for"
         " --drafter-mode socket"),
    ):  # fmt: skip
        bad = subprocess.run(remote + args, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0
        errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("specwire: error:")]
        assert errors == [f"specwire: error: {error}"]


@pytest.mark.parametrize("mode", ["socket", "relay"])
def test_replies_that_come_while_the_device_runs_are_taken_then(servers, mode):
    """`Drafter.device_running` (framed modes): while the executor waits for the device, the
    reply to the question on its way is read and kept then, not by the next commit; the
    hook returns as soon as nothing is left to take, and at once when the device is done."""
    server = servers(max_draft_len=16, delay_ms=30)
    h = servers.harness(f"grpc://{server.address}", mode=mode, patience_ms=0)
    a = make_request("a", REPETITIVE)
    h.drafter.submit([a])  # a question on its way, its reply ~30 ms off
    h.drafter.device_running(lambda: True)  # the device is done: nothing waits
    assert h.counters()["prefetched"] == 0
    t0 = time.monotonic()
    h.drafter.device_running(lambda: time.monotonic() - t0 > 5)  # a 5 s "step"
    took = time.monotonic() - t0
    assert h.counters()["prefetched"] == 1 and 0.02 < took < 2, took  # kept; back at once
    assert h.step([a]) == [[3, 4, 1, 2]]  # the kept proposal drafts, unasked
    assert h.counters()["deferred"] == 0


def test_the_stream_takes_its_replies_on_its_own_thread_not_in_the_device_wait(servers):
    server = servers(max_draft_len=16, delay_ms=30)
    h = servers.harness(f"grpc://{server.address}", mode="stream", patience_ms=0)
    h.drafter.submit([make_request("a", REPETITIVE)])
    t0 = time.monotonic()
    h.drafter.device_running(lambda: time.monotonic() - t0 > 5)
    assert time.monotonic() - t0 < 0.02  # returned at once: the reader thread's job


def test_a_draining_drafter_keeps_its_open_socket_streams_for_the_grace(servers):
    """SIGTERM's drain (`DrafterServer.drain`): the socket file goes at once, so nobody new
    connects, while an open socket stream keeps drafting for the grace, as gRPC's streams do;
    then it ends, and the target's next step goes without drafts (fail-open)."""
    server = servers()
    h = servers.harness(f"grpc://{server.address}", mode="socket", lookahead=0)
    assert h.step([make_request("a", REPETITIVE)]) == [[3, 4, 1, 2]]
    t0 = time.monotonic()
    drain = threading.Thread(target=server.drain, args=(2.0,))
    drain.start()
    wait_until(lambda: not os.path.exists(server.config.socket), 5, what="the socket file gone")
    with pytest.raises(OSError):
        connect(server.config.socket)
    assert h.step([make_request("b", REPETITIVE)]) == [[3, 4, 1, 2]]  # still drafting
    drain.join(timeout=15)
    assert not drain.is_alive()
    assert time.monotonic() - t0 >= 1.5  # the open stream held the drain for its grace
    assert h.step([make_request("c", REPETITIVE)]) == [[]]  # ended: no drafts, no error
