"""The remote drafter's DraftStream as frames on file descriptors (specwire/common/frames.py),
read and written by the executor's own thread: no gRPC thread of the target on the round trip.

`FramedCall` is the part both carriers share: the executor serialises a question and writes
it (non-blocking; what the descriptor does not take waits in `_out` and goes with the next
write or read), and reads the replies itself when a step looks for one (`replies`,
non-blocking) or waits for one (`wait`: select(2), the GIL released). Its carriers:

- `RelayStreamCall` (remote_relay.py, `--drafter-mode relay`): pipes to a child process that
  holds a gRPC DraftStream to the drafter, wherever it runs.
- `SocketStreamCall` (here, `--drafter-mode socket --drafter-socket PATH`): the unix socket
  of a drafter service on the same host (`specwire drafter --socket PATH`). No gRPC on the
  round trip at all, and no process in between: on the dev VM a bare question and reply took
  0.135 ms p50 through a unix socket against 0.46 ms on the gRPC stream (bench/RESULTS.md,
  round 33). The handshake (GetInfo and its checks) still goes over gRPC, and the socket's
  setup answers with the drafter's identity, which must be the handshake's: a socket that
  belongs to another drafter is refused.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import time

from specwire.common.errors import UserError
from specwire.common.frames import FAILED, IDENTITY, QUESTION, REPLY
from specwire.common.hoptrace import TARGET as TRACE

_READ_BYTES = 1 << 16
_SELECT_FDS = 1024  # FD_SETSIZE: select(2) takes no higher descriptor (then poll(2))
# The executor's side: a step waiting for a reply polls the descriptor this long before it
# sleeps (`FramedCall.wait`), when `spin_wait_s` says so (remote_relay.SPIN_MS).
SPIN_WAIT_S = 0.002


class FramedCall:
    """One DraftStream as frames on `wfd` (questions) and `rfd` (replies); the same `send`,
    `close` and `ended` as `DraftStreamCall`, and the replies are pulled: `replies` (never
    blocks) and `wait` (blocks until one may be there). The executor's thread alone calls
    `send`, `replies` and `wait`; `close` may come from any thread. `end_reason` says why the
    stream ended when the other end said so."""

    def __init__(self, wfd: int, rfd: int, spin_wait_s: float = 0.0) -> None:
        self._wfd, self._rfd = wfd, rfd
        for fd in {wfd, rfd}:
            os.set_blocking(fd, False)
        self._in = bytearray()  # bytes read, not yet a whole frame
        self._out = bytearray()  # frames written, not yet taken by the descriptor
        self._poll = select.poll()
        self._poll.register(rfd, select.POLLIN)
        self.ended = False  # the other end is gone (end of file) or the descriptor broke
        self.end_reason = "the drafter ended the stream"
        self._spin_wait_s = spin_wait_s

    def send(self, msg) -> None:
        """Queue `msg` for the drafter (never blocks)."""
        TRACE.mark("send", msg.step)
        self._write(msg.SerializeToString())

    def _write(self, payload: bytes) -> None:
        self._out += QUESTION.pack(len(payload))
        self._out += payload
        self._flush()

    def _flush(self) -> None:
        while self._out and not self.ended:
            try:
                n = os.write(self._wfd, self._out)
            except BlockingIOError:
                return  # full: the rest goes with the next write or read
            except OSError as exc:  # EPIPE / ECONNRESET: the other end is gone
                if exc.errno not in (errno.EPIPE, errno.EBADF, errno.ECONNRESET):
                    raise
                self.ended = True
                return
            del self._out[:n]

    def replies(self) -> list[tuple[bytes, float]]:
        """Every whole reply written so far, serialised, with when the other end sent (or
        read) it (never blocks). Sets `ended` at the end of the replies, or when the other
        end sent why it is ending the stream (`end_reason`)."""
        self._flush()
        while not self.ended:
            try:
                chunk = os.read(self._rfd, _READ_BYTES)
            except BlockingIOError:
                break
            except OSError:  # EBADF: closed meanwhile; ECONNRESET
                chunk = b""
            if not chunk:
                self.ended = True
                break
            self._in += chunk
            if len(chunk) < _READ_BYTES:  # a short read drained the descriptor: no EAGAIN
                break  # read to learn it (a syscall a step); more is read at the next call
        out = []
        while len(self._in) >= REPLY.size:
            n, at = REPLY.unpack_from(self._in)
            end = REPLY.size + n
            if len(self._in) < end:
                break
            payload = bytes(self._in[REPLY.size : end])
            del self._in[:end]
            if at == FAILED:
                self.end_reason = payload.decode(errors="replace")
                self.ended = True
                break
            out.append((payload, at))
        return out

    def wait(self, timeout_s: float) -> None:
        """Wait until the other end writes something or ends, at most `timeout_s`: for the
        first `spin_wait_s` by polling (each poll a syscall that lets go of the GIL), so that
        the write finds nobody asleep to wake; then asleep in select(2), whose timeout has
        microseconds (poll(2) would round a step's patience of a few tenths of a millisecond
        up to a whole one; it serves only descriptors past select's limit)."""
        if self.ended:
            return
        now = time.monotonic()
        end = now + max(0.0, timeout_s)
        spin_end = min(end, now + self._spin_wait_s)
        try:
            if self._rfd < _SELECT_FDS:
                while not select.select([self._rfd], [], [], 0)[0]:
                    now = time.monotonic()
                    if now >= spin_end:
                        select.select([self._rfd], [], [], max(0.0, end - now))
                        return
            else:
                self._poll.poll(max(0, int(timeout_s * 1000 + 0.999)))
        except (OSError, ValueError):  # closed meanwhile
            self.ended = True

    def _wait_setup(self, timeout_s: float) -> tuple[bytes, float] | None:
        """The first reply frame (a setup's answer), waiting at most `timeout_s`; None if
        none came or the stream ended."""
        end = time.monotonic() + timeout_s
        while not (ready := self.replies()) and not self.ended and time.monotonic() < end:
            self.wait(end - time.monotonic())
        return ready[0] if ready else None

    def close(self) -> None:
        raise NotImplementedError


class SocketStreamCall(FramedCall):
    """A DraftStream as frames on a drafter service's unix socket (module docstring)."""

    def __init__(
        self, path: str, token: str | None, info, timeout_s: float, spin_wait_s: float = 0.0
    ) -> None:
        """Connect to `path`, send the setup (the token) and check that the drafter there is
        the one `info` (GetInfo's reply) describes, within `timeout_s`; raises UserError.
        `spin_wait_s`: as `FramedCall`'s (a step waiting for a reply polls that long first),
        and the drafter is asked to poll as long (its `FrameServer`: `spin_ms` in the setup)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise UserError(
                f"--drafter-socket {path}: cannot connect ({exc.strerror or exc}); is the "
                "drafter service started with --socket on this host?"
            ) from None
        fd = self._sock.fileno()
        super().__init__(fd, fd, spin_wait_s)
        setup = {"token": token, **({"spin_ms": spin_wait_s * 1000} if spin_wait_s > 0 else {})}
        self._write(json.dumps(setup).encode())
        got = self._wait_setup(timeout_s)
        try:
            setup = json.loads(got[0]) if got else {"error": self.end_reason}
            if not isinstance(setup, dict):
                raise ValueError
        except ValueError:
            setup = {"error": "its setup reply is not JSON"}
        theirs = setup.get("info") or {}
        if "error" in setup or not isinstance(theirs, dict):
            self.close()
            error = setup.get("error") if got or self.ended else "no reply"
            raise UserError(f"--drafter-socket {path}: refused ({error})")
        mismatch = [k for k in IDENTITY if theirs.get(k) != getattr(info, k)]
        if mismatch:
            self.close()
            raise UserError(
                f"--drafter-socket {path} is another drafter's than --drafter's "
                f"({', '.join(f'{k} {theirs.get(k)!r} != {getattr(info, k)!r}' for k in mismatch)})"
            )

    def close(self) -> None:
        """End the stream (any thread): the drafter sees the end of its questions."""
        self.ended = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
