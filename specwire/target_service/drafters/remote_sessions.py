"""The remote drafter's resource manager: what the drafter service holds, per request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager


@dataclass
class Run:
    """A proposal the drafter made from a request's first `anchor` tokens. It stays usable
    while what the target commits is exactly its prefix (look-ahead: when a step accepts every
    draft and the bonus token is the proposal's next one, the tokens after it are the next
    step's drafts, with no round trip).

    `branches` (drafter.proto `Branch`: position, token, tokens) are the other ways the
    drafter foresaw: when the target commits the proposal's first `position` tokens and then
    `token`, the branch becomes the run. They are kept as they came (protobuf) and read only
    when the target leaves the proposal."""

    anchor: int
    tokens: list[int]
    probs: list[tuple[list[int], list[float]]] | None
    complete: bool  # the drafter gave fewer tokens than asked: it had nothing more
    branches: Sequence[Any] = ()
    asked: int = 0  # tokens asked for from `anchor` (a branch at p holds at most asked-p-1)

    def branch(self, position: int, token: int) -> Run | None:
        """The run that starts where the target left this one for `token` at `position`."""
        for b in self.branches:
            if b.position == position and b.token == token:
                room = self.asked - position - 1
                tokens = list(b.tokens[:room])
                return Run(self.anchor + position + 1, tokens, None, len(tokens) < room)
        return None


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
        branches: Sequence[Any] = (),
    ) -> None:
        """Keep the drafter's proposal continuing the request's first `anchor` tokens (`asked`
        were asked for), with its branches. A proposal from an older prefix never replaces a
        newer one; a request freed meanwhile keeps nothing."""
        if request_id not in self.synced:
            return
        old = self.runs.get(request_id)
        if old is not None and old.anchor > anchor:
            return
        self.runs[request_id] = Run(anchor, tokens, probs, len(tokens) < asked, branches, asked)

    def drafts_from_run(self, request: Request) -> tuple[list[int], list | None, str] | None:
        """(drafts, their distributions or None, where they come from) from the request's
        kept proposal, if what was committed since it was made is exactly its prefix, or the
        prefix of one of its branches, and enough of it is left; None when the drafter must be
        asked. Where: "asked" (the proposal's start), "lookahead" (further along it) or
        "branch"."""
        rid = request.request_id
        run = self.runs.get(rid)
        if run is None:
            return None
        n, budget = request.num_tokens, request.draft_budget
        m = n - run.anchor  # tokens committed since the proposal
        if m < 0:
            del self.runs[rid]
            return None
        where = "lookahead" if m else "asked"
        if m:
            committed = request.tokens_between(run.anchor, n)
            if committed != run.tokens[:m]:
                # The target went another way: at the first difference, a branch may have
                # foreseen it (then it becomes the run).
                p = _first_difference(committed, run.tokens)
                run = run.branch(p, committed[p]) if run.branches else None
                if run is None or committed[p + 1 :] != run.tokens[: m - p - 1]:
                    del self.runs[rid]
                    return None
                self.runs[rid] = run
                m, where = n - run.anchor, "branch"
            rest = len(run.tokens) - m
            if rest <= 0 or (rest < budget and not run.complete):
                return None  # used up: a fresh proposal drafts further
        probs = None if run.probs is None else run.probs[m : m + budget]
        return run.tokens[m : m + budget], probs, where

    def check_integrity(self) -> None:
        assert all(n >= 0 for n in self.synced.values()), "negative synced length"
        assert not set(self.finished) & self.synced.keys(), "a live request is marked finished"
        assert self.runs.keys() <= self.synced.keys(), "a proposal kept for a freed request"


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where `a` and `b` differ (or the shorter one's length)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
