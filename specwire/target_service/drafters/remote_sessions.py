"""The remote drafter's resource manager: what the drafter service holds, per request, and
the wire deltas that keep it so (`write_updates`: what each message says about a request;
`apply`: what a reply proposes for it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager

# Branches are asked at the first BRANCH_POSITIONS draft positions: where the first draft is
# rejected (or a draftless step commits its token), or the second. In a replay of SmolLM2's
# HumanEval outputs (bench/branch_replay.py --branch-positions 1/2/5) one, two and five
# positions projected 0.94, 0.95 and 0.96 of the in-process drafter's speed, while the
# n-gram drafter's work grows with the positions (with two, 3-5x its work per message without
# branches: bench/branch_cost.py).
BRANCH_POSITIONS = 2
# Auto (--drafter-branches -1): this many alternatives per position while a message carries at
# most AUTO_BRANCH_ROWS sequences (under load the batch, not the drafter's round trip, sets the
# pace).
AUTO_BRANCHES = 4
AUTO_BRANCH_ROWS = 8

Sent = dict[str, tuple[int, int]]  # request -> (tokens the drafter was sent, drafts asked)


class Proposed(NamedTuple):
    """A reply's answer for one sequence (drafter.proto `SequenceDraft`) as Python values."""

    request_id: str
    base_len: int
    resync: bool
    tokens: Sequence[int]  # as it came (see `read_reply`); a slice of it is a list
    probs: list[tuple[list[int], list[float]]] | None  # None unless one per token
    branches: Sequence[Any]  # drafter.proto `Branch`es, as they came (read only when used)


class Reply(NamedTuple):
    """A DraftResponse or DraftStreamResponse as Python values (`read_reply`)."""

    step: int
    drafts: list[Proposed]
    # The branches that follow a step's drafts (drafter.proto `branches_only`): each
    # Proposed carries only request_id, base_len and branches.
    branches_only: bool = False


def read_reply(reply: Any) -> Reply:
    """Read a reply out of its protobuf once, where it arrives: the stream's reader thread
    does it while the executor waits for the device, so the step that keeps the proposals
    (`RemoteSessions.apply`, on the critical path of a drafting step) touches no protobuf
    fields (each read builds a Python object: most of what keeping a proposal cost).

    A proposal's tokens stay the message's repeated field: a step slices the few it drafts
    (a list), while `list()` of all of them built one int at a time what the look-ahead asked
    (K + 4(K + 1) a sequence): 11.8 of this function's 19.6 us for a reply of 8 sequences of
    44 tokens on the dev VM, 4 us to slice 9 of each (round 43)."""
    if isinstance(reply, Reply):
        return reply
    if reply.branches_only:  # only the ids, lengths and branches are read (`add_branches`)
        return Reply(
            reply.step,
            [Proposed(d.request_id, d.base_len, False, [], None, d.branches) for d in reply.drafts],
            True,
        )
    drafts = []
    for d in reply.drafts:
        tokens = d.tokens
        probs = None
        if d.probs and len(d.probs) == len(tokens):
            probs = [(list(p.ids), list(p.probs)) for p in d.probs]
        drafts.append(Proposed(d.request_id, d.base_len, d.resync, tokens, probs, d.branches or ()))
    return Reply(reply.step, drafts)


def branches_per_position(setting: int, rows: int) -> int:
    """Alternatives to ask for at each branch position: `setting`, or for -1 (auto)
    AUTO_BRANCHES while a message carries at most AUTO_BRANCH_ROWS sequences, else none."""
    if setting >= 0:
        return setting
    return AUTO_BRANCHES if rows <= AUTO_BRANCH_ROWS else 0


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
    tokens: Sequence[int]  # a list, or the reply's repeated field (`read_reply`)
    probs: list[tuple[list[int], list[float]]] | None
    asked: int  # tokens asked for from `anchor` (a branch at p holds at most asked - p - 1)
    branches: Sequence[Any] = ()
    # (position, token) -> its branch, built at the first lookup: a step peeks at a run it
    # left (`RemoteDrafter._covered`) and then takes it, and each read of a protobuf field
    # builds a Python object.
    _by_way: dict[tuple[int, int], Any] | None = field(default=None, repr=False)

    @property
    def complete(self) -> bool:
        """The drafter gave fewer tokens than asked: it had nothing more."""
        return len(self.tokens) < self.asked

    def branch(self, position: int, token: int) -> Run | None:
        """The run that starts where the target left this one for `token` at `position`."""
        room = self.asked - position - 1  # what the drafter may propose past the branch token
        if room <= 0:
            return None
        if self._by_way is None:
            self._by_way = {}
            for b in self.branches:  # the first of a (position, token) named twice
                self._by_way.setdefault((b.position, b.token), b)
        b = self._by_way.get((position, token))
        if b is None:
            return None
        return Run(self.anchor + position + 1, list(b.tokens[:room]), None, room)

    def add_branches(self, branches: Sequence[Any]) -> None:
        """The branches that came after the proposal (a branches-only reply)."""
        self.branches, self._by_way = branches, None


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
        # A pipelined step's hypothesis about the step in flight, per request: (the request's
        # committed steps when it was made, the proposal's anchor, its tokens, how many of
        # them the step in flight commits if it holds); settled at the request's next staging
        # (`_settle`), into `hypotheses_held` / `hypotheses_failed`.
        self.hypotheses: dict[str, tuple[int, int, Sequence[int], int]] = {}
        self.hypotheses_held = 0
        self.hypotheses_failed = 0

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
        self.hypotheses.pop(request.request_id, None)
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
        self.runs[request_id] = Run(anchor, tokens, probs, asked, branches)

    def add_branches(self, reply: Reply) -> None:
        """Attach the branches of a branches-only reply (drafter.proto `branches_later`) to
        the proposals they belong to: a request's kept run of the same anchor that has none
        yet (a newer proposal, or a branch taken meanwhile, leaves them unused)."""
        for d in reply.drafts:
            run = self.runs.get(d.request_id)
            if run is not None and run.anchor == d.base_len and not run.branches:
                run.add_branches(d.branches)

    def drafts_from_run(
        self, request: Request, peek: bool = False
    ) -> tuple[list[int], list | None, str] | None:
        """(drafts, their distributions or None, where they come from) from the request's
        kept proposal, if what was committed since it was made is exactly its prefix, or the
        prefix of one of its branches, and enough of it is left; None when the drafter must be
        asked. Where: "asked" (the proposal's start), "lookahead" (further along it) or
        "branch". Unless `peek`, a proposal the target left is dropped, or replaced by the
        branch it took.

        A pipelined step (`Request.drafts_in_flight`) is staged before the step in flight is
        read: its drafts then continue the proposal on the hypothesis that the target follows
        it through that step — accepting its drafts as far as they agree with the proposal,
        then the proposal's next token as the bonus. The device moves the row by what was
        really accepted; where the hypothesis fails the drafts are verified and rejected
        (lossless either way)."""
        rid = request.request_id
        if not peek and rid in self.hypotheses:
            self._settle(request)
        run = self.runs.get(rid)
        if run is None:
            return None
        n, budget = request.num_tokens, request.draft_budget
        in_flight = request.drafts_in_flight
        if in_flight is not None and request.num_settled_tokens < n:
            n -= 1  # committed: the tokens before the step in flight's placeholder
        else:
            in_flight = None
        m = n - run.anchor  # tokens committed since the proposal
        if m < 0:
            if not peek:
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
                    if not peek:
                        del self.runs[rid]
                    return None
                if not peek:
                    self.runs[rid] = run
                m, where = n - run.anchor, "branch"
        if in_flight is not None:  # past the step in flight, as the proposal says it goes
            ahead = run.tokens[m : m + len(in_flight)]
            m += _first_difference(in_flight, ahead) + 1
            where = "lookahead" if where == "asked" else where
        if m:
            rest = len(run.tokens) - m
            if rest <= 0 or (rest < budget and not run.complete):
                return None  # used up: a fresh proposal drafts further
        if in_flight is not None and not peek:
            self.hypotheses[rid] = (request.stats.steps, run.anchor, run.tokens, m)
        probs = None if run.probs is None else run.probs[m : m + budget]
        return run.tokens[m : m + budget], probs, where

    def _settle(self, request: Request) -> None:
        """Count whether the step that was in flight when `request`'s last pipelined step
        was staged committed what that step's hypothesis said (exactly the proposal's tokens
        up to its foreseen bonus). Known only while that step is the one committed since; a
        request not staged meanwhile (no drafting step) goes uncounted."""
        steps, anchor, tokens, m = self.hypotheses.pop(request.request_id)
        if request.stats.steps != steps + 1:
            return
        end = anchor + m
        held = request.num_settled_tokens == end and request.tokens_between(anchor, end) == list(
            tokens[:m]
        )
        if held:
            self.hypotheses_held += 1
        else:
            self.hypotheses_failed += 1

    def write_updates(
        self, msg: Any, asks: Sequence[tuple[Request, int]], per_position: int
    ) -> Sent:
        """Add to `msg` (a DraftRequest or DraftStreamRequest) the finished notices pending
        and one update per (request, drafts to ask for) of `asks`: the tokens committed since
        what the drafter holds, and when `per_position`, branches. The requests count as
        synced from here on."""
        add = msg.sequences.add
        for rid in self.take_finished():
            add(request_id=rid, finished=True)
        sent: Sent = {}
        synced = self.synced
        for r, k in asks:
            rid = r.request_id
            n = r.num_settled_tokens  # a plain step's submit: the next step is in flight
            base = synced.get(rid, 0)
            if base > n:
                base = 0
            branches = per_position if k else 0
            add(
                request_id=rid,
                base_len=base,
                new_tokens=r.tokens_between(base, n),
                max_draft_tokens=k,
                max_branches=branches,
                branch_positions=min(BRANCH_POSITIONS, k + 1) if branches else 0,
            )
            # Optimistic: if this message is lost, the drafter answers resync (or the stream
            # breaks and everything restarts from 0); lengths only grow, so nothing goes wrong.
            synced[rid] = n
            sent[rid] = (n, k)
        return sent

    def apply(self, reply: Any, sent: Sent) -> list[str]:
        """Keep each proposal of `reply` (a DraftResponse or DraftStreamResponse answering the
        updates `sent` describes, or its `read_reply`) as its request's run, with its
        branches. Returns the counters to bump for what it refused: unknown_request, stale (a
        second draft for a sequence, or one for another length), resynced (the drafter asks
        for the whole prefix next time)."""
        refused: list[str] = []
        seen: set[str] = set()
        for d in read_reply(reply).drafts:
            rid = d.request_id
            if rid not in sent:
                refused.append("unknown_request")
            elif rid in seen:
                refused.append("stale")
            elif d.resync:
                refused.append("resynced")
                self.resync(rid)
            elif d.base_len != sent[rid][0]:
                refused.append("stale")
            else:
                n, asked = sent[rid]
                self.keep(rid, n, d.tokens, d.probs, asked=asked, branches=d.branches)
            seen.add(rid)
        return refused

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
