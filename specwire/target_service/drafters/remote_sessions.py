"""The remote drafter's resource manager: what the drafter service holds, per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager


@dataclass
class Run:
    """A proposal the drafter made from a request's first `anchor` tokens. It stays usable
    while what the target commits is exactly its prefix (look-ahead: when a step accepts every
    draft and the bonus token is the proposal's next one, the tokens after it are the next
    step's drafts, with no round trip)."""

    anchor: int
    tokens: list[int]
    probs: list[tuple[list[int], list[float]]] | None
    complete: bool  # the drafter gave fewer tokens than asked: it had nothing more


class RemoteSessions(ResourceManager):
    """Per request, how many committed tokens the drafter holds (as far as we know), and the
    drafter's latest proposal for it (`runs`).

    Invariant: synced lengths are >= 0, and a request is never both live and awaiting its
    `finished` notice. Only the executor thread calls it. `on_finished` runs after a request
    the drafter holds is freed (the remote drafter sends the notice at once).
    """

    name = "remote_drafter"

    def __init__(self, on_finished: Callable[[], None] | None = None) -> None:
        self.synced: dict[str, int] = {}  # request_id -> tokens the drafter holds
        self.finished: list[str] = []  # freed requests the drafter has not been told about
        self.runs: dict[str, Run] = {}  # request_id -> the latest proposal received
        self.on_finished = on_finished

    def synced_len(self, request_id: str) -> int:
        return self.synced.get(request_id, 0)

    def resync(self, request_id: str) -> None:
        if request_id in self.synced:
            self.synced[request_id] = 0  # the full prefix goes out next step

    def resync_all(self) -> None:
        for rid in self.synced:
            self.synced[rid] = 0

    def free(self, request: Request) -> None:
        self.runs.pop(request.request_id, None)
        if self.synced.pop(request.request_id, None) is not None:
            self.finished.append(request.request_id)
            if self.on_finished is not None:
                self.on_finished()

    def take_finished(self) -> list[str]:
        out, self.finished = self.finished, []
        return out

    def keep(
        self,
        request_id: str,
        anchor: int,
        tokens: list[int],
        probs: list[tuple[list[int], list[float]]] | None,
        asked: int,
    ) -> None:
        """Keep the drafter's proposal continuing the request's first `anchor` tokens (`asked`
        were asked for). A proposal from an older prefix never replaces a newer one; a request
        freed meanwhile keeps nothing."""
        if request_id not in self.synced:
            return
        old = self.runs.get(request_id)
        if old is not None and old.anchor > anchor:
            return
        self.runs[request_id] = Run(anchor, tokens, probs, len(tokens) < asked)

    def drafts_from_run(self, request: Request) -> tuple[list[int], list | None, bool] | None:
        """(drafts, their distributions or None, whether they come from the look-ahead) from
        the request's kept proposal, if what was committed since it was made is exactly its
        prefix and enough of it is left; None when the drafter must be asked."""
        rid = request.request_id
        run = self.runs.get(rid)
        if run is None:
            return None
        n, budget = request.num_tokens, request.draft_budget
        m = n - run.anchor  # tokens committed since the proposal
        if m:
            if m < 0 or request.tokens_between(run.anchor, n) != run.tokens[:m]:
                del self.runs[rid]  # the target went another way
                return None
            rest = len(run.tokens) - m
            if rest <= 0 or (rest < budget and not run.complete):
                return None  # used up: a fresh proposal drafts further
        probs = None if run.probs is None else run.probs[m : m + budget]
        return run.tokens[m : m + budget], probs, m > 0

    def check_integrity(self) -> None:
        assert all(n >= 0 for n in self.synced.values()), "negative synced length"
        assert not set(self.finished) & self.synced.keys(), "a live request is marked finished"
        assert self.runs.keys() <= self.synced.keys(), "a proposal kept for a freed request"
