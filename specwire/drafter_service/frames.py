"""`specwire drafter --socket PATH`: DraftStream's questions and replies as frames
(specwire/common/frames.py) on a unix socket, for a target on the same host
(`--drafter-mode socket --drafter-socket PATH`).

Why: on a host the drafter shares with the target, gRPC is most of the round trip. A bare
question and reply took 0.46 ms p50 on the gRPC stream on the dev VM and 0.135 ms as frames on
a unix socket (bench/drafter_ping.py; bench/RESULTS.md, round 33), and a reply that comes
before the next step is built is what lets that step draft.

One connection is one DraftStream, served by the same code as the gRPC call
(`DrafterServicer.stream`: the caller's stream limit, the sessions, the hop trace), on the same
event loop. Its first frame is the target's setup, {"token": ..., "spin_ms": ...} (JSON);
the answer is {"info": GetInfo's fields}, or {"error": why} and the connection closes. A stream
that fails (a question that does not parse, a limit) ends with a FAILED frame that says why.

Polling. A target may ask (`spin_ms`, at most MAX_SPIN_MS) that the service's event loop poll
for that long after each event before it sleeps, while its connection is open: its questions
then find the loop awake instead of asleep on a core that must be woken, which on a GPU host is
most of the round trip (bench/RESULTS.md, round 34). The loop polls for the most that any open
connection asked, or the service's own `--spin-ms`, whichever is more.

Who may connect. The socket file is created with mode 0600: only the service's own user can
open it. When the service takes tokens (`--auth-token-file`) the setup must carry one of them,
and the caller's sessions are its token's, as on gRPC; without tokens each connection is a
caller of its own ("peer:unix:N"), whose sessions go when it closes. TLS does not apply: the
bytes never leave the host.

Stopping removes the socket file at once, so nobody new connects; the open streams keep
drafting for the grace a drain gives (as the service's gRPC streams do), then end, and the
target goes without drafts and reconnects, as after any dropped stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import time

from google.protobuf.message import DecodeError

from specwire.common.errors import UserError
from specwire.common.frames import (
    IDENTITY,
    MAX_SPIN_MS,
    failed_frame,
    read_question,
    reply_frame,
)
from specwire.common.protogen import drafter_pb2
from specwire.common.security import token_identity, token_valid

log = logging.getLogger(__name__)

MAX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def check_socket_path(path: str) -> None:
    """Raise UserError for a path no unix socket can take."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise UserError(f"--socket {path!r}: longer than {MAX_PATH} bytes (a unix socket's limit)")


class FrameServer:
    """The unix socket's server (module docstring), on the servicer's event loop."""

    def __init__(self, servicer, path: str, tokens: tuple[str, ...], selector=None) -> None:
        """`selector`: the event loop's `transport.SpinSelector`, whose polling connections may
        ask for (None: they may not)."""
        self.servicer, self.path, self.tokens = servicer, path, tokens
        self.connections = 0  # accepted so far (names a tokenless caller)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._selector = selector
        self._own_spin_s = selector.spin_s if selector is not None else 0.0
        self._asked: dict[int, float] = {}  # connection -> the polling it asked for (s)

    async def start(self) -> None:
        """Listen on `path` (mode 0600). A socket left there by a service that died is
        replaced; one a live process serves, or anything else there, is an error
        (UserError)."""
        try:
            if stat.S_ISSOCK(os.stat(self.path).st_mode):
                if _served(self.path):
                    raise UserError(f"--socket {self.path}: another process serves it")
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
            os.chmod(self.path, 0o600)  # (created as the umask allows: 0755 at the usual 022,
            # which lets nobody else connect, a socket needing write permission)
        except OSError as exc:
            why = exc.strerror or exc
            raise UserError(f"--socket {self.path}: cannot listen ({why})") from None

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening and remove the socket file, so nobody new connects; the open
        connections keep drafting for up to `grace` seconds (as the service's open gRPC
        streams do while it drains), then end."""
        if self._server is None:
            return
        self._server.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._writers and loop.time() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        self._writers.add(writer)
        try:
            owner = await self._setup(reader, writer, n)
            if owner is not None:
                await self._relay(reader, writer, owner)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the target went away, or the service is stopping
        finally:
            self._writers.discard(writer)
            if self._asked.pop(n, None) is not None:
                self._respin()
            writer.close()

    @property
    def spin_s(self) -> float:
        """How long the event loop polls after an event now (0: it sleeps at once)."""
        return self._selector.spin_s if self._selector is not None else 0.0

    def _respin(self) -> None:
        if self._selector is not None:
            self._selector.spin_s = max([self._own_spin_s, *self._asked.values()])

    async def _setup(self, reader, writer, n: int) -> str | None:
        """Read the setup, answer it; the caller's identity, or None (refused: said why)."""
        try:
            raw = await read_question(reader)
            setup = json.loads(raw) if raw is not None else None
        except ValueError:
            setup = "bad"
        if setup is None:
            return None
        if not isinstance(setup, dict):
            return await _answer(writer, {"error": "the setup is not a JSON object"})
        token = setup.get("token")
        if self.tokens and not token_valid(token, self.tokens):
            return await _answer(writer, {"error": "missing or invalid token"})
        spin_ms = setup.get("spin_ms", 0)
        number = isinstance(spin_ms, int | float) and not isinstance(spin_ms, bool)
        if not (number and 0 <= spin_ms <= MAX_SPIN_MS):
            why = f"spin_ms must be a number of milliseconds from 0 to {MAX_SPIN_MS:g}"
            return await _answer(writer, {"error": why})
        try:
            info = self.servicer.info()
        except UserError as exc:  # still starting, or draining
            return await _answer(writer, {"error": str(exc)})
        if spin_ms > 0:  # polling before the answer: the target's first question finds it
            self._asked[n] = spin_ms / 1000
            self._respin()
        await _answer(writer, {"info": {k: getattr(info, k) for k in IDENTITY}})
        return token_identity(token) if self.tokens else f"peer:unix:{n}"

    async def _relay(self, reader, writer, owner: str) -> None:
        """Answer the questions until the target closes its end; a failure says why."""

        async def questions():
            while (payload := await read_question(reader)) is not None:
                yield drafter_pb2.DraftStreamRequest.FromString(payload)

        try:
            async for reply in self.servicer.stream(questions(), owner):
                writer.write(reply_frame(reply.SerializeToString(), time.monotonic()))
                await writer.drain()  # at once unless the target stopped reading
        except UserError as exc:
            writer.write(failed_frame(f"{exc.code}: {exc}"))
        except (DecodeError, ValueError) as exc:
            log.warning("drafter socket: a question that does not parse (%s)", exc)
            writer.write(failed_frame(f"INVALID_ARGUMENT: a question that does not parse ({exc})"))


def _served(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:  # ECONNREFUSED: nobody listens (its service died)
        return False
    finally:
        probe.close()


async def _answer(writer: asyncio.StreamWriter, body: dict) -> None:
    writer.write(reply_frame(json.dumps(body).encode(), time.monotonic()))
    await writer.drain()
