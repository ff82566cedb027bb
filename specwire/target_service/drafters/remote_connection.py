"""The remote drafter's connection: the channel, the handshake, and in stream mode the one open
DraftStream and its reader thread; dropping the connection and re-opening it in the background.

`RemoteConnection` owns that state: whether the connection is up, the open stream, the steps
sent on it and not yet answered (at most `max_inflight` questions: the stream answers in
order), the replies the reader thread hands over, and `lost_sync`. It
also owns the lock that guards it, `cv`, and `RemoteDrafter` shares that one Condition for its
own step state and counters: a step reads the connection and updates its own state in one
critical section (e.g. "up, nothing in flight: this message is step n, and it is in flight"),
and waits on `cv` for the reply the reader thread hands over. Members marked "`cv` held"
expect the caller to hold it; the others take it themselves.

A stream that breaks, or stays silent for `stall_s` (the step notices: `stalled`), is dropped
(`disconnect`, from any thread) and re-opened in the background with exponential back-off,
after re-checking the handshake (the drafter may have restarted with another model);
`lost_sync` then tells the next step that every sequence goes out from base_len 0 again.
Unary mode has no stream: a failed call drops the connection the same way. Relay and socket
modes are stream mode with the stream as frames (`remote_frames.py`): on the pipes of a child
process that holds the gRPC stream (`remote_relay.py`), or on the drafter service's own unix
socket; no reader thread, the replies are read off the descriptor by the step that looks for
one (`reply`, `wait`).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from specwire.common.errors import UserError
from specwire.common.hoptrace import TARGET as TRACE
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.common.security import ClientSecurity
from specwire.common.transport import make_channel
from specwire.target_service.drafters.remote_channel import (
    CHANNEL_OPTIONS,
    MAX_INFLIGHT,
    DrafterUnreachable,
    DraftStreamCall,
    RemoteDrafterConfig,
    handshake,
)
from specwire.target_service.drafters.remote_frames import FramedCall, SocketStreamCall
from specwire.target_service.drafters.remote_relay import RelayStreamCall
from specwire.target_service.drafters.remote_sessions import Reply, read_reply

log = logging.getLogger(__name__)

_KEEP = MAX_INFLIGHT + 1  # replies held for their steps at most (`_hand`)
# At start-up the handshake waits this long before it says in the log that it is waiting.
STARTUP_QUIET_S = 2.0


class RemoteConnection:
    """The channel to one drafter service, handshaken at construction (raises UserError), and
    its stream; see the module docstring. `mode` is the wire's: "stream" (`framed`: as frames
    through a relay process or on a unix socket) or "unary", also when the drafter offers no
    streams. Nothing is sent
    before `connect`."""

    def __init__(
        self,
        config: RemoteDrafterConfig,
        security: ClientSecurity,
        name: str,
        vocab_size: int,
        tokenizer_fingerprint: str,
    ) -> None:
        self.config = config
        self.name = name
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        # Guards everything below (and, shared, the drafter's step state and counters).
        self.cv = threading.Condition()
        self.connections = 0  # made so far, the first one included (the `reconnects` counter)
        self._connected = False
        self._stream: DraftStreamCall | None = None
        self._inflight: dict[int, float] = {}  # stream: step sent and not answered -> when
        # Replies read out of their protobuf by the reader, not yet taken: step -> (reply,
        # when it arrived). At most a few: one whose step gave up on it is dropped (`_hand`).
        self._replies: dict[int, tuple[Reply, float]] = {}
        self._reply_at = 0.0  # when the reply `reply` last returned arrived
        # Branches asked to follow their drafts (`branches_later`): the steps whose branches
        # have not come, and those that came, not yet taken (`take_branches`).
        self._branches_due: set[int] = set()
        self._branches: list[Reply] = []
        self._lost_sync = False  # set on failure: every sequence restarts from base_len 0
        self._reconnecting = False
        self._closed = threading.Event()
        self._security = security  # the relay's, for its own channel
        self._channel = make_channel(config.target, security, CHANNEL_OPTIONS)
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self._channel)
        try:
            self.info = self._startup_handshake()
        except BaseException:
            self._channel.close()
            raise
        self.framed = config.mode in ("relay", "socket")
        self.mode = "stream" if self.framed else config.mode
        if config.mode == "socket" and "socket" not in self.info.capabilities:
            self._channel.close()
            raise UserError(
                f"drafter at {name} serves no socket: start it with --socket PATH, on this host"
            )
        if self.mode == "stream" and "stream" not in self.info.capabilities:
            log.warning("drafter %s does not offer streams; using unary calls", self.name)
            self.mode, self.framed = "unary", False

    # -- the state a step reads (`cv` held) ---------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def closed(self) -> bool:
        """`close` has begun (any thread, no lock needed)."""
        return self._closed.is_set()

    @property
    def lost_sync(self) -> bool:
        """The connection was lost since the last `take_lost_sync`."""
        return self._lost_sync

    @property
    def inflight(self) -> int:
        """Stream mode: how many steps were sent and not yet answered (0: the stream is
        free)."""
        return len(self._inflight)

    def stalled(self, now: float) -> bool:
        """A step in flight for longer than `stall_s` (the caller then `disconnect`s)."""
        return bool(self._inflight) and now - min(self._inflight.values()) > self.config.stall_s

    def send(
        self, msg: drafter_pb2.DraftStreamRequest, awaited: bool = True
    ) -> DraftStreamCall | None:
        """Send `msg` on the open stream and return that stream; None (nothing sent) when
        there is none. `msg.step` is then in flight until the reader hands its reply over
        (`reply`); with `awaited=False` it is not, and its reply is dropped (the finished
        notices sent between steps)."""
        stream = self._stream
        if stream is None:
            return None
        if awaited:
            self._inflight[msg.step] = time.monotonic()
            if msg.branches_later:
                self._branches_due.add(msg.step)
        stream.send(msg)
        return stream

    @property
    def branches_due(self) -> bool:
        """Branches asked to follow their drafts have not all come, or came and wait to be
        taken (read without `cv`: the executor's hint; `take_branches` decides)."""
        return bool(self._branches_due or self._branches)

    def take_branches(self) -> list[Reply]:
        """The branches-only replies that have come (`cv` held), oldest first, but for those
        whose drafts' reply is still to be taken (`reply`): branches attach to the proposal
        that reply holds, so they wait for it. Framed: those the caller's `collect` read."""
        out = [b for b in self._branches if b.step not in self._replies]
        self._branches = [b for b in self._branches if b.step in self._replies]
        return out

    def _arrived(self, reply: Reply, arrived: float | None = None) -> None:
        """A reply read off the stream (`cv` held): the drafts of a step in flight, handed to
        it, or the branches that follow a step's drafts (kept for `take_branches`). The
        stream answers in order, so a step's drafts mean that no branches will come for the
        steps before it (a drafter that sends them with the drafts, or found none to send)."""
        step = reply.step
        if reply.branches_only:
            if step in self._branches_due:
                self._branches_due.discard(step)
                self._branches.append(reply)
            return
        if self._branches_due:
            self._branches_due = {s for s in self._branches_due if s >= step}
        if self._inflight.pop(step, None) is not None:  # else junk: ignore
            self._hand(reply, arrived)

    def reply(self, step: int, pump: bool = True) -> Reply | None:
        """The stream's reply for `step`, once the reader has handed it over (relay: once it
        is on the pipe); taken (a second call returns None). Sets `reply_at`. `pump`: framed,
        read the descriptor first (else the caller just did: `collect`)."""
        if pump and self.framed and self._stream is not None:
            self._pump(self._stream)
        got = self._replies.pop(step, None)
        if got is None:
            return None
        reply, self._reply_at = got
        return reply

    def collect(self) -> None:
        """Framed: read every reply and branches the descriptor holds, once, for the `reply`
        (with `pump=False`) and `take_branches` calls that follow (`cv` held)."""
        if self.framed and self._stream is not None:
            self._pump(self._stream)

    def wait(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for a reply to arrive (`cv` held, and released meanwhile)."""
        stream = self._stream
        if not self.framed or stream is None:
            self.cv.wait(timeout_s)
            return
        self.cv.release()
        try:
            stream.wait(timeout_s)
        finally:
            self.cv.acquire()

    def _pump(self, stream: FramedCall) -> None:
        """Hand over the replies the relay or the socket has written (`cv` held): the reader
        thread's work, done on the thread that looks for a reply."""
        for data, arrived in stream.replies():
            try:
                message = drafter_pb2.DraftStreamResponse.FromString(data)
            except DecodeError:  # (on the stream, gRPC's deserialiser fails the call)
                self.disconnect("the drafter sent a reply that does not parse")
                return
            reply = read_reply(message)
            self._arrived(reply, arrived)
            TRACE.mark("handed", reply.step)
        if stream.ended:
            self.disconnect(stream.end_reason)

    def is_open(self, stream: object) -> bool:
        """`stream` (from `send`) is still the open one: not dropped, so a reply may come."""
        return stream is self._stream

    @property
    def reply_at(self) -> float:
        """When the reply `reply` last returned arrived (time.monotonic(); the executor
        thread's alone: only `reply` sets it)."""
        return self._reply_at

    # -- the lifecycle (each takes `cv` itself) -----------------------------------------------

    def take_lost_sync(self) -> bool:
        """`lost_sync`, cleared: the caller re-sends every sequence from base_len 0. Takes
        `cv` itself, and only when it is set (every step asks; a flag set just after the
        unlocked read is seen by the next step, as one set just after a locked read would)."""
        if not self._lost_sync:
            return False
        with self.cv:
            lost, self._lost_sync = self._lost_sync, False
        return lost

    def _startup_handshake(self) -> drafter_pb2.GetInfoResponse:
        """The first handshake: waits up to `startup_wait_s` for a drafter that is not up yet,
        saying so in the log once the first seconds have passed; raises UserError."""
        wait = self.config.startup_wait_s
        first = min(wait, STARTUP_QUIET_S)
        try:
            try:
                return self._handshake(first)
            except DrafterUnreachable as exc:
                if wait <= first:
                    raise
                log.warning(
                    "drafter %s is not reachable yet (%s); waiting up to %g s more",
                    self.name,
                    exc.reason,
                    wait - first,
                )
            return self._handshake(wait - first)
        except DrafterUnreachable as exc:
            waited = f"; waited {wait:g} s (--drafter-wait-s)"
            raise DrafterUnreachable(exc.name, exc.reason, waited) from None

    def _handshake(self, timeout_s: float, wait: bool = True) -> drafter_pb2.GetInfoResponse:
        """See `remote_channel.handshake`; raises UserError."""
        return handshake(
            self.stub, self.name, self.vocab_size, self.tokenizer_fingerprint, timeout_s, wait
        )

    def connect(self, ends_reconnect: bool = False) -> None:
        """Open the stream (stream mode) and mark the connection up; counted in `connections`.
        The drafter calls it once, when built; the background reconnect after that, with
        `ends_reconnect`: the loop is over in the same critical section that marks the
        connection up, so a `disconnect` right after it starts a new loop (were the flag
        cleared later, that disconnect would find a loop still running, start none, and the
        connection would stay down for good)."""
        stream = None
        if self.config.mode == "socket":
            stream = SocketStreamCall(
                self.config.socket,
                self._security.token,
                self.info,
                self.config.connect_timeout_s,
                self.config.spin_ms / 1000,
            )
        elif self.framed:
            stream = RelayStreamCall(
                self.config.target, self._security, self.config.connect_timeout_s
            )
        elif self.mode == "stream":
            stream = DraftStreamCall(self.stub, self._read_stream)
        with self.cv:
            if ends_reconnect:
                self._reconnecting = False
            if self._closed.is_set():  # close() won the race with a reconnect
                if stream is not None:
                    stream.close()
                return
            self._stream, self._connected = stream, True
            self._inflight, self._replies = {}, {}
            self._branches_due, self._branches = set(), []
            self.connections += 1
            # A stream whose reader ended before it was registered here (a drafter that fails
            # it at once) has nobody left to report it: drop it now, not at the stall check.
            died = stream is not None and stream.ended
        if died:
            self.disconnect("the stream ended as it opened")

    def disconnect(self, why: str) -> None:
        """Drop the connection (any thread) and re-open it in the background."""
        with self.cv:
            if not self._connected or self._closed.is_set():
                return
            log.warning("drafter %s: %s; reconnecting in the background", self.name, why)
            stream, self._stream, self._connected = self._stream, None, False
            self._inflight, self._replies, self._lost_sync = {}, {}, True
            self._branches_due, self._branches = set(), []
            self.cv.notify_all()
            start = not self._reconnecting
            self._reconnecting = True
        if stream is not None:
            stream.close()
        if start:
            threading.Thread(
                target=self._reconnect_loop, daemon=True, name="drafter-reconnect"
            ).start()

    def _reconnect_loop(self) -> None:
        delay = self.config.backoff_initial_s
        while not self._closed.wait(delay):
            try:
                self._handshake(min(self.config.connect_timeout_s, 1.0), wait=False)
                self.connect(ends_reconnect=True)
                return
            except (UserError, grpc.RpcError, ValueError) as exc:  # ValueError: channel closed
                log.info("drafter %s: still down: %s", self.name, exc)
                delay = min(2 * delay, self.config.backoff_max_s)
        with self.cv:  # closed
            self._reconnecting = False

    def _read_stream(self, stream: DraftStreamCall, call: grpc.Call) -> None:
        """The reader thread: hand the reply to the step in flight to the waiting step."""
        try:
            for message in call:
                TRACE.mark("recv", message.step)
                reply = read_reply(message)  # here, not on the executor's critical path
                with self.cv:
                    if stream is not self._stream:
                        return
                    self._arrived(reply)
                    self.cv.notify_all()
                TRACE.mark("handed", reply.step)
            why = "the drafter ended the stream"
        except grpc.RpcError as exc:
            why = f"stream failed ({exc.code().name}: {exc.details()})"
        with self.cv:  # one critical section with `connect`'s check: one of them reports it
            stream.ended = True
            current = stream is self._stream
        if current:
            self.disconnect(why)

    def _hand(self, reply: Reply, arrived: float | None = None) -> None:
        """Keep `reply`, which arrived at `arrived` (default: now), for the step that asked
        (`cv` held). A reply nobody took by the time `_KEEP` later ones came was given up on
        (late): dropped, so none piles up."""
        self._replies[reply.step] = (reply, time.monotonic() if arrived is None else arrived)
        while len(self._replies) > _KEEP:
            del self._replies[min(self._replies)]

    def close(self) -> None:
        self._closed.set()
        with self.cv:
            stream, self._stream, self._connected = self._stream, None, False
            self.cv.notify_all()
        if stream is not None:
            stream.close()
        self._channel.close()
        TRACE.flush()
