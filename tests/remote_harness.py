"""A RemoteDrafter driven as the executor drives it, against real drafter services on
loopback: the harness shared by the remote drafter's tests (their `servers` fixture is in
conftest.py)."""

from __future__ import annotations

import shutil
import tempfile
import time

from specwire.target_service.drafters.remote import RemoteDrafter
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig
from specwire.target_service.request import Request, RequestState
from specwire.target_service.resources.base import ResourceRegistry

VOCAB, FP = 100, "fp-target"
REPETITIVE = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
MODES = ["stream", "relay", "socket", "unary"]
# The modes a hand-written gRPC servicer serves: it has no unix socket (the socket's own
# failures are test_remote_socket.py's).
GRPC_MODES = [m for m in MODES if m != "socket"]


class Sockets:
    """A short temporary folder for drafter services' unix sockets (a socket's path holds 107
    bytes): one per port, so a service restarted on its port comes back on its socket."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="specwire-")

    def path(self, port: int, started: int) -> str:
        """The socket of a service on `port` (0: any port, then the `started`-th one)."""
        return f"{self.dir}/{f'p{port}' if port else f'd{started}'}.sock"

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def never() -> bool:  # `Patience.at_launch`'s `covered`: some request needs the reply
    return False


def reply_kept(drafter: RemoteDrafter) -> bool:
    """True once a `submit`'s reply has arrived and been kept (what the next step does first);
    True at once when nothing was submitted."""
    return drafter.unanswered() == 0


def record_prices(drafter: RemoteDrafter) -> list[float | None]:
    """Every budget price (`Drafter.wait_worth_s`) the drafter's patience reads, in order:
    what the executor handed it, seen through the `Patience.worth` seam."""
    prices: list[float | None] = []
    price = drafter.patience.worth

    def worth() -> float | None:
        prices.append(price())
        return prices[-1]

    drafter.patience.worth = worth
    return prices


def make_request(rid: str, prompt: list[int], k: int = 4) -> Request:
    req = Request(rid, list(prompt), max_new_tokens=64, max_draft_len=k)
    req.state, req.step_draft_cap = RequestState.DECODE, k  # as the scheduler leaves it
    return req


class Harness:
    """A RemoteDrafter with its resource registry, as the executor drives it."""

    def __init__(self, address: str, mode: str = "stream", deadline_ms: float = 2000, **kw):
        """`kw`: RemoteDrafter's own arguments (security, lookahead, branches), `vocab` and
        `fp` (the target's), and RemoteDrafterConfig fields."""
        own = {k: kw.pop(k) for k in ("security", "lookahead", "branches") if k in kw}
        vocab, fp = kw.pop("vocab", VOCAB), kw.pop("fp", FP)
        config = RemoteDrafterConfig(address, mode=mode, deadline_ms=deadline_ms, **kw)
        self.drafter = RemoteDrafter(config, 4, vocab, fp, **own)
        self.resources = ResourceRegistry()
        self.resources.add(self.drafter.spec_resource_manager)

    def step(self, requests: list[Request]) -> list[list[int]]:
        """Drafts for a step, then its launch as the executor does it (`Drafter.launched`:
        a question held back at the last commit goes out)."""
        self.resources.prepare(requests)
        self.drafter.prepare_draft_tokens(requests, self.resources)
        self.resources.check_integrity()
        drafts = [r.draft_tokens for r in requests]
        self.drafter.launched()
        return drafts

    def counters(self) -> dict[str, int]:
        return self.drafter.counters()

    def await_branches(self, timeout_s: float = 5.0) -> None:
        """What a step's device time gives the drafter: the branches that follow the drafts
        already kept (`branches_later`) come, and are kept with their proposals."""
        end = time.monotonic() + timeout_s
        self.drafter.unanswered()  # keeps what came (read off the socket or the relay's pipe)
        while self.drafter.connection.branches_due and time.monotonic() < end:
            time.sleep(0.001)
            self.drafter.unanswered()
