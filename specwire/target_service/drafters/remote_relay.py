"""The remote drafter's DraftStream through a relay process (`--drafter-mode relay`).

In stream mode (`remote_channel.DraftStreamCall`) two Python threads of the target carry each
question: gRPC's request-iterator thread takes it off a queue, and a reader thread parses the
reply and hands it over. Both need the GIL, which the executor holds while it builds and
launches a step, so each hand-off waits: on an H100 host they were 0.18-0.20 ms each way at
p50 (0.4-0.6 at p90) of a 0.8 ms round trip (bench/RESULTS.md, round 30's hop trace).

Here a child process owns the stream instead, and no thread of the target touches it:

    executor --frames--> relay stdin -> gRPC (bytes, no protobuf) -> drafter service
    executor <--frames-- relay stdout <- gRPC <-----------------------------'

The frames are specwire/common/frames.py's (a reply's time is when the relay read it, so a
reply the executor reads late is still timed by its arrival: the patience's round trip), and
the executor's side of them is remote_frames.py's `FramedCall`. The relay passes bytes
through: it never parses a message, except to mark the hop trace (`SPECWIRE_HOP_TRACE`: the
relay marks "taken" as it reads a question off the pipe and "recv" as it gets the reply; the
executor marks "handed" once it has read and parsed it, so that hop holds the time the reply
waited in the pipe for the executor to look). A reply that does not parse is the executor's
to find (`RemoteConnection` then drops the connection, as gRPC's deserialiser would).

Its first frame is its setup (the drafter's address and the client's security, JSON), sent
on the pipe rather than the command line so that no key or token shows in `ps`; it answers
with an empty frame once its channel is up, and `RelayStreamCall` waits for that (the relay's
start-up, ~80 ms, would otherwise count in the first round trip the patience times).

The relay ends when the stream ends or fails (one line on stderr says why) and when the
target closes its stdin or dies; the target sees the end of its stdout (`ended`) and drops
the connection as it drops a broken stream.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from specwire.common.errors import UserError
from specwire.common.frames import QUESTION, reply_frame
from specwire.common.hoptrace import TARGET as TRACE
from specwire.common.protogen import drafter_pb2
from specwire.target_service.drafters.remote_frames import SPIN_WAIT_S, FramedCall

_PIPE_BYTES = 1 << 20  # asked of the kernel for each pipe (F_SETPIPE_SZ), best effort
_F_SETPIPE_SZ = 1031
_READ_BYTES = 1 << 16
_GRACE_S = 1.0  # a closed relay's time to end its stream and exit before it is killed
_SECURITY_BYTES = ("ca", "cert", "key")  # ClientSecurity's PEM fields (base64 in the setup)
# How long the relay keeps polling its stdin after a question before it sleeps
# (`QuestionFrames`), from $SPECWIRE_RELAY_SPIN_MS; > 0 also makes a step waiting for the
# relay's reply poll for up to SPIN_WAIT_S first; 0 (the default): both ends always sleep in
# select(2). Polling is off by default until the GPU has judged it: on the dev VM's two vCPUs
# the polling ends take the cores the drafter needs (5 % slower in the CPU proxy), and the GPU
# run that was to compare them was lost (bench/RESULTS.md, round 32). 20 is the value tried.
# (The socket's polling is the target's --drafter-spin-ms.)
SPIN_MS = 0.0
SPIN_ENV = "SPECWIRE_RELAY_SPIN_MS"


def spin_ms() -> float:
    """How long the relay polls for questions before it sleeps (SPIN_MS, or $SPIN_ENV)."""
    try:
        return max(0.0, float(os.environ.get(SPIN_ENV) or SPIN_MS))
    except ValueError:
        return SPIN_MS


def _method() -> str:
    method = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].methods_by_name
    service, name = method["DraftStream"].full_name.rsplit(".", 1)
    return f"/{service}/{name}"


def _grow(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:  # over /proc/sys/fs/pipe-max-size: the default 64 KiB serves too
        pass


class RelayStreamCall(FramedCall):
    """One DraftStream through a relay child (see the module docstring): `FramedCall` on the
    child's stdin and stdout."""

    def __init__(self, target: str, security, timeout_s: float) -> None:
        """Start the relay and wait at most `timeout_s` for its channel to be up; raises
        UserError (the relay is then stopped)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
        )
        wfd, rfd = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        for fd in (wfd, rfd):
            _grow(fd)
        # $SPECWIRE_RELAY_SPIN_MS=0 turns polling off on both sides (an A/B switch).
        super().__init__(wfd, rfd, SPIN_WAIT_S if spin_ms() > 0 else 0.0)
        self.end_reason = "the drafter relay ended the stream"
        setup = {
            "target": target,
            "timeout_s": timeout_s,
            "token": security.token,
            "server_name": security.server_name,
        }
        for name in _SECURITY_BYTES:
            value = getattr(security, name)
            setup[name] = None if value is None else base64.b64encode(value).decode()
        self._write(json.dumps(setup).encode())
        ready = self._wait_setup(timeout_s)
        if ready is None or ready[0]:
            ended = self.ended
            self.close()
            if ended:  # it said why on stderr
                raise UserError(f"the drafter relay for {target} ended as it started")
            raise UserError(f"the drafter relay for {target} did not start within {timeout_s:g} s")

    def close(self) -> None:
        """End the relay without waiting for it (a drop comes from a step, lock held): close
        its stdin (it half-closes the stream and exits); a thread reaps it, killing it after
        `_GRACE_S`."""
        self.ended = True
        for f in (self._proc.stdin, self._proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        threading.Thread(target=self._reap, daemon=True, name="drafter-relay-reap").start()

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# -- the relay process --------------------------------------------------------------------


class QuestionFrames:
    """The frames on the relay's stdin. While questions come (one within `spin_s` of the
    last; `SPIN_MS`), it polls the pipe without sleeping, so that the target's write finds
    nobody to wake: a write that wakes a reader asleep in read(2) took ~15 us of the writer's
    time on the idle dev VM and ~70 us in the CPU proxy, on the step's critical path, and on
    the H100 host a synchronous step's submit took ~100 us through the relay (round 32's
    step probe; the write's share not measured apart); into a pipe nobody sleeps on, a write
    takes ~1 us. Each poll is a syscall that lets go of the GIL, so the relay's reply thread
    is not kept waiting. After `spin_s` without a question (at once with 0) it sleeps in
    select(2) until one comes."""

    def __init__(self, fd: int, spin_s: float) -> None:
        self.fd, self.spin_s = fd, spin_s
        os.set_blocking(fd, False)
        self._buf = bytearray()
        self._last = -spin_s  # nothing yet: sleep until the first frame

    def _more(self) -> bool:
        """Read what the pipe holds (at least a byte); False once it has ended."""
        while True:
            try:
                chunk = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                if time.monotonic() - self._last >= self.spin_s:
                    select.select([self.fd], [], [])
                continue
            if not chunk:
                return False
            self._buf += chunk
            return True

    def frame(self) -> bytes | None:
        """The next frame's payload; None once the pipe has ended."""
        while len(self._buf) < QUESTION.size:
            if not self._more():
                return None
        end = QUESTION.size + QUESTION.unpack_from(self._buf)[0]
        while len(self._buf) < end:
            if not self._more():
                return None
        payload = bytes(self._buf[QUESTION.size : end])
        del self._buf[:end]
        self._last = time.monotonic()
        return payload


def _frames(questions: QuestionFrames, traced: bool) -> Iterator[bytes]:
    """The questions, until the pipe ends (then gRPC half-closes the stream)."""
    while (payload := questions.frame()) is not None:
        if traced:
            TRACE.mark("taken", drafter_pb2.DraftStreamRequest.FromString(payload).step)
        yield payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _relay() -> int:
    import grpc

    from specwire.common.security import ClientSecurity
    from specwire.common.transport import make_channel
    from specwire.target_service.drafters.remote_channel import CHANNEL_OPTIONS

    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    questions = QuestionFrames(rfd, spin_ms() / 1000)
    raw = questions.frame()
    if raw is None:
        return 0  # closed before the setup: nothing to relay
    setup = json.loads(raw or b"{}")
    pem = {k: None if setup[k] is None else base64.b64decode(setup[k]) for k in _SECURITY_BYTES}
    security = ClientSecurity(token=setup["token"], server_name=setup["server_name"], **pem)
    channel = make_channel(setup["target"], security, CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=setup["timeout_s"])
    except grpc.FutureTimeoutError:
        print(f"drafter relay: {setup['target']} unreachable", file=sys.stderr)
        return 1
    _write_all(wfd, reply_frame(b"", time.monotonic()))  # ready
    traced = TRACE.dir is not None  # the hop trace's "taken" and "recv" are marked here
    call = channel.stream_stream(_method())(_frames(questions, traced))  # bytes in, bytes out
    try:
        for reply in call:
            if traced:
                TRACE.mark("recv", drafter_pb2.DraftStreamResponse.FromString(reply).step)
            _write_all(wfd, reply_frame(reply, time.monotonic()))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            print(
                f"drafter relay: stream failed ({exc.code().name}: {exc.details()})",
                file=sys.stderr,
            )
        return 1
    except BrokenPipeError:  # the target is gone
        return 0
    finally:
        TRACE.flush()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(_relay())
