"""The gRPC side of `RemoteDrafter`: its configuration, the handshake and the stream call.

`handshake` is GetInfo plus the compatibility checks the target makes before trusting a
drafter (protocol version, vocabulary size, tokenizer fingerprint). `DraftStreamCall` is one
open DraftStream: a queue feeds its request iterator and a reader thread consumes the replies.
Keeping a connection up (opening the stream, dropping and re-opening it) is
`remote_connection.py`'s.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from specwire.common.drafting import PROTOCOL_VERSION, check_compatible
from specwire.common.errors import UserError
from specwire.common.frames import MAX_SPIN_MS
from specwire.common.hoptrace import TARGET as TRACE
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc

DEFAULT_DEADLINE_MS = 50.0
# At start-up, how long a target waits for a drafter that is not up yet (--drafter-wait-s).
DEFAULT_WAIT_S = 60.0
CHANNEL_OPTIONS = [  # notice a restarted drafter within ~1 s (gRPC's default waits up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
MAX_INFLIGHT = 4  # the most questions `--drafter-max-inflight` may keep on the stream at once
# `--drafter-mode`: a DraftStream held by the target's threads, the same stream held by a relay
# process (remote_relay.py), the same questions and replies on the drafter's unix socket
# (remote_frames.py; `--drafter-socket`), or one unary Draft call per question.
MODES = ("stream", "relay", "socket", "unary")
# Socket mode's polling (`--drafter-spin-ms`): what auto picks for a target on a GPU (at most
# MAX_SPIN_MS, the most a drafter service grants a connection).
AUTO_SPIN_MS = 20.0
# `--drafter-ask-at`: when a question asked as a step commits goes out (remote_patience.py).
ASK_AT = ("auto", "timed", "commit", "launch")
# `--drafter-branches-at`: branches in a reply of their own after the drafts (the drafts are
# not held back while the drafter finds them), or in the drafts' reply (before round 37).
BRANCHES_AT = ("later", "reply")
# `--drafter-wait-rule`: how long auto patience waits for a reply on its way
# (remote_patience.py): a share of a drafting step, or what the policy says drafts are worth.
WAIT_RULES = ("share", "gain")


def check_socket(mode: str, socket: str) -> None:
    """A socket path comes with socket mode and socket mode with one; raises UserError."""
    if mode == "socket" and not socket:
        raise UserError("--drafter-mode socket needs --drafter-socket PATH")
    if socket and mode != "socket":
        raise UserError("--drafter-socket is for --drafter-mode socket")


def check_spin(spin_ms: float) -> None:
    """Socket mode's polling, once auto (-1) is resolved, is 0 to MAX_SPIN_MS ms (the most a
    drafter service grants); raises UserError."""
    if not 0 <= spin_ms <= MAX_SPIN_MS:
        raise UserError(
            f"--drafter-spin-ms must be from 0 to {MAX_SPIN_MS:g} (or -1: auto), got {spin_ms}"
        )


def check_wait(wait_s: float) -> None:
    """The start-up wait for a drafter (`--drafter-wait-s`) is > 0 s; raises UserError."""
    if not wait_s > 0:
        raise UserError(f"--drafter-wait-s must be > 0, got {wait_s:g}")


@dataclass(frozen=True)
class RemoteDrafterConfig:
    address: str  # "grpc://host:port" or "host:port"
    mode: str = "stream"  # one of MODES
    deadline_ms: float = DEFAULT_DEADLINE_MS
    connect_timeout_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    # How long a step waits for drafts asked for as the previous step committed; -1 = auto
    # (a share of the step's own time). A reply later than this is still kept for the steps
    # after (see remote.py).
    patience_ms: float = -1.0
    # When the question asked as a step commits goes out (auto patience): once the next step is
    # launched when that step will not use the reply ("auto": it would not wait for it, or every
    # request's drafts come from a kept proposal; "timed": the first reason only), or always at
    # the commit ("commit"), or always at the launch ("launch"). See remote_patience.py,
    # "Sending at launch".
    ask_at: str = "auto"
    # How long auto patience waits for a reply on its way (one of WAIT_RULES): at most
    # PATIENCE_SHARE of a drafting step ("share"), or as long as the drafts still pay for the
    # wait by the draft-length policy's cost model ("gain": `Drafter.wait_worth_s`).
    wait_rule: str = "share"
    # Questions a stream may have in flight at once (the stream answers in order): with 1 a
    # commit whose previous question is unanswered asks nothing; with 2 (the default) it asks
    # again, so a reply that comes a step late still leaves one on the way. Unary calls keep 1.
    max_inflight: int = 2
    # Socket mode: the drafter service's unix socket (`specwire drafter --socket PATH`).
    socket: str = ""
    # Socket mode: a step waiting for a reply polls the socket this long (at most its wait)
    # before it sleeps, and the drafter is asked to poll as long after each event while this
    # target is connected; 0: both sleep (unless the drafter's own --spin-ms says otherwise).
    spin_ms: float = 0.0
    # Stream modes: where the branches asked for come (one of BRANCHES_AT).
    branches_at: str = "later"
    # At start-up: how long the handshake waits for a drafter that is not up yet (still
    # starting, or started after the target), before the target gives up and refuses to start.
    startup_wait_s: float = DEFAULT_WAIT_S

    def __post_init__(self) -> None:
        if not self.target or ":" not in self.target:
            raise UserError(f"--drafter {self.address!r}: expected grpc://HOST:PORT")
        if self.mode not in MODES:
            raise UserError(f"drafter mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_socket(self.mode, self.socket)
        if self.ask_at not in ASK_AT:
            raise UserError(
                f"drafter ask-at must be one of {', '.join(ASK_AT)}, got {self.ask_at!r}"
            )
        if self.branches_at not in BRANCHES_AT:
            raise UserError(
                f"drafter branches-at must be one of {', '.join(BRANCHES_AT)}, "
                f"got {self.branches_at!r}"
            )
        if self.wait_rule not in WAIT_RULES:
            raise UserError(
                f"drafter wait rule must be one of {', '.join(WAIT_RULES)}, got {self.wait_rule!r}"
            )
        if not 1 <= self.max_inflight <= MAX_INFLIGHT:
            raise UserError(
                f"drafter max in flight must be between 1 and {MAX_INFLIGHT}, "
                f"got {self.max_inflight}"
            )
        check_spin(self.spin_ms)
        if self.deadline_ms <= 0 or self.connect_timeout_s <= 0:
            raise UserError("drafter deadline and connect timeout must be > 0")
        check_wait(self.startup_wait_s)
        if self.patience_ms != -1 and not 0 <= self.patience_ms <= self.deadline_ms:
            raise UserError(
                "drafter patience must be between 0 and the deadline "
                f"({self.deadline_ms:g} ms), or -1 (auto); got {self.patience_ms:g}"
            )

    @property
    def target(self) -> str:
        return self.address.removeprefix("grpc://")

    @property
    def patience_s(self) -> float | None:
        """Seconds a step waits for a prefetched reply before going without it (None: auto,
        `remote_patience.Patience`)."""
        return None if self.patience_ms == -1 else self.patience_ms / 1000

    @property
    def stall_s(self) -> float:
        return max(1.0, 20 * self.deadline_ms / 1000)


class DrafterUnreachable(UserError):
    """The handshake found no drafter answering (as against one that answered and does not
    fit); `reason`: gRPC's status and details."""

    def __init__(self, name: str, reason: str, waited: str = "") -> None:
        super().__init__(f"drafter at {name} is unreachable ({reason}){waited}")
        self.name, self.reason = name, reason


def handshake(
    stub: drafter_pb2_grpc.DrafterServiceStub,
    name: str,
    vocab_size: int,
    tokenizer_fingerprint: str,
    timeout_s: float,
    wait: bool = True,
) -> drafter_pb2.GetInfoResponse:
    """GetInfo and the compatibility checks; raise UserError (one line) on any mismatch.

    `wait`: at start-up, wait up to `timeout_s` for a drafter that is still starting. The
    background reconnect probes once instead (its own back-off paces the attempts), so no
    thread sits in a long blocking call that would hold up shutdown.
    """
    end = time.monotonic() + timeout_s
    while True:
        try:
            info = stub.GetInfo(
                drafter_pb2.GetInfoRequest(protocol_version=PROTOCOL_VERSION),
                timeout=max(0.01, end - time.monotonic()),
                wait_for_ready=wait,
            )
            break
        except grpc.RpcError as exc:
            if not wait or exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= end:
                raise DrafterUnreachable(name, f"{exc.code().name}: {exc.details()}") from None
            time.sleep(0.05)
    if info.protocol_version != PROTOCOL_VERSION:
        raise UserError(
            f"drafter at {name} speaks protocol version {info.protocol_version}, "
            f"this target speaks {PROTOCOL_VERSION}"
        )
    check_compatible(
        f"drafter at {name}",
        info.name,
        info.vocab_size,
        info.tokenizer_fingerprint,
        vocab_size,
        tokenizer_fingerprint,
    )
    return info


class DraftStreamCall:
    """One DraftStream call: a sender queue feeding its request iterator, and a reader thread.

    `read(self, call)` runs on the reader thread ("drafter-rx") and iterates the replies; it
    returns when the stream ends or fails. `ended` is the reader's to set, under the lock its
    owner guards the stream with (`RemoteConnection.cv`).
    """

    ended = False

    def __init__(
        self,
        stub: drafter_pb2_grpc.DrafterServiceStub,
        read: Callable[[DraftStreamCall, grpc.Call], None],
    ) -> None:
        self._queue: queue.SimpleQueue[drafter_pb2.DraftStreamRequest | None] = queue.SimpleQueue()
        self._call = stub.DraftStream(self._requests())
        self._reader = threading.Thread(
            target=read, args=(self, self._call), daemon=True, name="drafter-rx"
        )
        self._reader.start()

    def _requests(self) -> Iterator[drafter_pb2.DraftStreamRequest]:
        while (msg := self._queue.get()) is not None:
            TRACE.mark("taken", msg.step)
            yield msg

    def send(self, msg: drafter_pb2.DraftStreamRequest) -> None:
        TRACE.mark("send", msg.step)
        self._queue.put(msg)

    def close(self) -> None:
        self._queue.put(None)
        self._call.cancel()
