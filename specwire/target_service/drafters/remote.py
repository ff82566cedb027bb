"""`--drafter grpc://HOST:PORT`: drafts from a drafter service (drafter.proto), fail-open.

One message per step (a DraftStreamRequest, or a DraftRequest in unary mode) carries every decoding
request's delta (`base_len` = what the drafter already holds, `new_tokens` = the rest). The step
waits at most `deadline_ms`; a late, failed or malformed reply costs that step its drafts, never its
output.

Stream mode (default) keeps one DraftStream open: a queue feeds the request iterator, a reader
thread hands replies to the waiting step. At most `max_inflight` questions (default 2; the
stream answers in order) are in flight: a commit asks again while the previous question is
unanswered (bench/RESULTS.md, round 27); past that a step sends nothing (its deltas ride along
next time), so a slow drafter never builds a backlog. A stream that breaks, or stays silent
for `stall_s`, is dropped and re-opened in the background with exponential back-off, after
re-checking the handshake (the drafter may have restarted with another model); every sequence
is then re-sent from base_len 0 (`remote_connection.py`).

Drafting off the critical path. `submit` (the moment a step commits) sends what it learnt and
asks for the next drafts *plus a look-ahead*: `lookahead` more tokens (auto: four more steps'
worth, `LOOKAHEAD_STEPS`), so each proposal also covers the steps after next in the case where
they accept every draft and the bonus tokens are the proposal's next ones. Proposals are
kept per request (`RemoteSessions.runs`); a step takes its drafts from the kept proposal
whenever what was committed since is exactly its prefix (no waiting at all), and waits for
the drafter only for requests no proposal covers (then for the reply already in flight when
there is one). When the next step would not wait for the reply anyway, `submit` holds the
question and `launched` (the executor's hook after every launch) sends it while the device
runs: off the synchronous step's critical path (`remote_patience.py`, "Sending at launch").
Drafts stay unpadded on the wire: the look-ahead is only a longer `max_draft_tokens`. A drafter
with the "branches" capability also sends other ways on at the proposal's first positions; when
a step leaves the proposal for a token a branch foresaw, the branch drafts the next step
(`branched`).

Patience. A step waits for the reply in flight only as long as `remote_patience.Patience`
says (auto: only when it is due within 30 % of a drafting step). Otherwise the step goes
without those drafts (`deferred`) and the reply stays awaited: when it comes it is kept like
any proposal, so the next step drafts from it if what this step committed is its first
token(s). A reply still missing a deadline after it was asked for is given up (`late`).

Deadline default, 50 ms: about one CPU decode step of the default 135M target; it fires only
for a drafter that is genuinely too slow (a loopback n-gram reply takes ~1 ms). On a GPU
target, whose step is a few ms, lower it (`--drafter-deadline-ms`).

This module is the step: what to ask and when, keeping the replies' proposals and the
counters. Pieces: `remote_replies.py` (`PrefetchReplies`, a mixin: collecting the reply to a
question asked early, waiting at most the patience or the deadline), `remote_notices.py`
(`FinishedNotices`, a mixin: telling the drafter at once that requests finished),
`remote_connection.py` (`RemoteConnection`: the channel, the stream and its reader thread,
stall detection, dropping and re-opening the connection; it owns the lock, `cv`, which the step
shares), `remote_channel.py` (config, handshake checks, the DraftStream call),
`remote_sessions.py` (what the drafter holds per request, a resource manager, and the
per-request wire deltas and kept proposals) and `remote_patience.py` (how long a step waits for
a reply asked for early).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from specwire.common.protogen import drafter_pb2
from specwire.common.security import ClientSecurity
from specwire.target_service.drafters.base import Drafter
from specwire.target_service.drafters.remote_channel import (
    PROTOCOL_VERSION,
    RemoteDrafterConfig,
)
from specwire.target_service.drafters.remote_connection import RemoteConnection
from specwire.target_service.drafters.remote_notices import FinishedNotices
from specwire.target_service.drafters.remote_patience import Patience
from specwire.target_service.drafters.remote_replies import Prefetch, PrefetchReplies
from specwire.target_service.drafters.remote_sessions import (
    BRANCH_POSITIONS,
    RemoteSessions,
    Reply,
    Sent,
    branches_per_position,
)
from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceRegistry

log = logging.getLogger(__name__)

# Re-exported: the names this module has always offered.
__all__ = [
    "COUNTERS",
    "PROTOCOL_VERSION",
    "RemoteDrafter",
    "RemoteDrafterConfig",
    "RemoteSessions",
]

COUNTERS = (
    "late",
    "failed",
    "stale",
    "resynced",
    "unknown_request",
    "reconnects",
    "prefetched",
    "lookahead",
    "deferred",
    "branched",
    "at_launch",
    "probes",
)

# The auto look-ahead of a drafter whose longer proposal costs nothing (a lookup), in steps:
# past the next step's K drafts, enough for this many more steps that accept all their drafts
# (K+1 tokens each). One step's worth serves a reply that comes within the next step; a reply
# that comes a step late (a round trip longer than a bf16 step) must still cover the steps run
# meanwhile, and a proposal that keeps being right drafts step after step with no round trip.
# In a replay of greedy HumanEval outputs (bench/branch_replay.py) with replies a step late,
# K=4: K+1 tokens gave 0.84 of the in-process drafter's projected speed, 4(K+1) 0.96; with
# replies in time both give the same.
LOOKAHEAD_STEPS = 4


class RemoteDrafter(PrefetchReplies, FinishedNotices, Drafter):
    """A `Drafter` backed by a drafter service; see the module docstring."""

    def __init__(
        self,
        config: RemoteDrafterConfig,
        max_draft_len: int,
        vocab_size: int,
        tokenizer_fingerprint: str,
        security: ClientSecurity | None = None,
        lookahead: int = -1,
        branches: int = -1,
    ) -> None:
        """Handshake with the drafter `config` names (raises UserError); `lookahead` (tokens
        asked past a step's drafts) and `branches` (alternatives per draft position): -1 auto,
        by what the drafter offers."""
        super().__init__(max_draft_len)
        self.config = config
        self.security = security or ClientSecurity()
        self.name = f"grpc://{self.config.target}"
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.spec_resource_manager = self.sessions = RemoteSessions(self._send_finished)
        self._counters = dict.fromkeys(COUNTERS, 0)  # "reconnects": the connection's count
        self.connection = RemoteConnection(
            self.config, self.security, self.name, vocab_size, tokenizer_fingerprint
        )
        # The connection's lock, shared: a step reads the connection's state and sends in one
        # critical section, and waits on it for the reply the reader thread hands over. The
        # step number and the counters are the executor thread's alone (`counters` copies).
        self._cv = self.connection.cv
        self._step = 0
        self._notices: set[grpc.Future] = set()  # unary finished notices in flight
        # Questions asked early and not yet collected, oldest first (at most `max_inflight`).
        self._pending: list[Prefetch] = []
        # A submit's question held back until the next step is launched (`launched`).
        self._held: list[Request] | None = None
        self.info, self.mode = self.connection.info, self.connection.mode
        # Unary calls are answered side by side, not in order: one question at a time.
        self.max_inflight = self.config.max_inflight if self.mode == "stream" else 1
        self.want_probs = "draft_probs" in self.info.capabilities
        offers_branches = "branches" in self.info.capabilities
        if lookahead < 0:  # auto: a lookup's longer proposal costs the drafter nothing
            cheap = self.info.name == "ngram" or offers_branches
            lookahead = LOOKAHEAD_STEPS * (max_draft_len + 1) if cheap else 0
        self.lookahead = lookahead
        self.patience = Patience(self.config, lookahead, lambda: self.wait_worth_s)
        # The most tokens a proposal may hold: what the drafter says it ever returns.
        self._most = self.info.max_draft_len or (max_draft_len + lookahead)
        # Alternatives asked per draft position (-1: auto, by the message's size). None from
        # a drafter that does not offer them, nor without the look-ahead that lets a branch
        # hold a whole step's drafts (at position p it holds what was asked, less p + 1):
        # the look-ahead the drafter's own cap leaves.
        room = min(lookahead, self._most - max_draft_len)
        self.branches = branches if offers_branches and room >= BRANCH_POSITIONS else 0
        self.connection.connect()

    # -- the step -----------------------------------------------------------------------------

    def submit(self, requests: Sequence[Request]) -> None:
        """Called by the executor the moment a step has committed its tokens: send what it
        learnt and ask for the next drafts and the look-ahead now, so the round trip runs
        while the executor finishes the step, schedules the next and (for requests a kept
        proposal covers) while the device runs it. When the next step would not wait for the
        reply anyway (`Patience.at_launch`), the question is held back and sent by `launched`,
        once that step is on the device. Never blocks; skipped while a message is in flight
        or the connection is down (the next step then asks the usual way)."""
        self.patience.committed(time.monotonic())
        self._held = None
        self._take_answered(branches=False)
        if len(self._pending) >= self.max_inflight:  # nothing more goes out meanwhile
            return
        if not self._pending and self.patience.at_launch(
            self.device_busy, lambda: self._covered(requests), len(requests)
        ):
            # The next step will not use this reply: ask once it is on the device.
            self._held = list(requests)
            return
        self._question(requests)

    def _covered(self, requests: Sequence[Request]) -> bool:
        """Whether every request the next step may draft for has drafts in its kept proposal
        (at this step's cap; `RemoteSessions.drafts_from_run`, peeking: `_prepare` takes
        them), so that step needs no reply."""
        for r in requests:
            if not r.finished and r.useful_drafts > 0:
                got = self.sessions.drafts_from_run(r, peek=True)
                if got is None or not got[0]:
                    return False
        return True

    def arrived(self, requests: Sequence[Request]) -> None:
        """Ask now for the first drafts of requests just admitted (the drafter is told their
        prompt), while the device runs: the step that ends their prefill then drafts from the
        kept proposal, not from a round trip inside it (a whole prompt's, which the drafter
        must also index). Skipped like any early question: with `max_inflight` in flight (a
        question held for the launch has gone by now) or the connection down."""
        self._take_answered(branches=False)
        if len(self._pending) < self.max_inflight:
            self._question(requests, timed=False)

    def launched(self) -> None:
        """The step after a submit is on the device: send the question held back (see
        remote_patience.py, "Sending at launch")."""
        self.patience.launched(time.monotonic())
        held, self._held = self._held, None
        if held and not self._pending:
            self._count("at_launch")
            self._question(held, at_launch=True)

    def _question(
        self, requests: Sequence[Request], at_launch: bool = False, timed: bool = True
    ) -> None:
        """Send the drafter what was committed and ask for the next drafts and the look-ahead
        (as `submit`'s prefetch). Skipped while the connection is down or busy. `timed`: its
        round trip is a sample for `Patience` (`Prefetch.timed`)."""
        live = [(r, n) for r in requests if not r.finished and (n := r.useful_drafts) > 0]
        if not live:
            return
        conn = self.connection
        with self._cv:
            if not conn.connected or conn.lost_sync or conn.inflight >= self.max_inflight:
                return
        self._step += 1
        step = self._step
        msg, sent = self._build(step, live)
        since = time.monotonic()  # before the send: a socket's reply may beat a clock read after
        if self.mode == "stream":
            with self._cv:
                stream = conn.send(msg)  # in flight as `step` (the message's)
            if stream is not None:
                pre = Prefetch(step, sent, stream, None, since, at_launch=at_launch, timed=timed)
                self._pending.append(pre)
        else:
            future = conn.stub.Draft.future(msg, timeout=self.config.deadline_ms / 1000 + 1.0)
            pre = Prefetch(step, sent, None, future, since, at_launch=at_launch, timed=timed)
            self._pending.append(pre)
            future.add_done_callback(pre.mark_answered)

    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        try:
            self._prepare(requests)
        finally:
            self.patience.drafted(time.monotonic(), self.device_busy)

    def _prepare(self, requests: Sequence[Request]) -> None:
        for r in requests:
            r.draft_tokens, r.draft_probs = [], None
        if self.connection.take_lost_sync():  # every sequence goes out from token 0 next time
            self.sessions.resync_all()
        self._take_answered()
        requests = [r for r in requests if not self._from_run(r)]
        if self._held is not None:  # (none pending then: `submit` holds only without one)
            # The question of the last commit goes out once this step is launched: the
            # requests no proposal covers join it and go without drafts this step (as when
            # the reply is not waited for), after the checks any question makes (below).
            held = {r.request_id for r in self._held}
            self._held += [r for r in requests if r.request_id not in held]
        pre, covered = self._covering(requests)
        if covered:
            # The reply in flight covers requests no kept proposal does: wait for it (once: a
            # late reply costs them this step's drafts, not a second question). With a
            # patience shorter than the deadline, a reply not there by then is still kept
            # when it comes: the steps after use it if this step commits its first tokens.
            if self.device_step_done is not None and self.patience.auto:
                got = self._use_prefetch_until(pre, self.device_step_done)
            else:
                now = time.monotonic()
                wait = self.patience.wait_s(pre.since, now, self.device_busy, pre.at_launch)
                got = self._use_prefetch(pre, wait)
            if got:
                for r in requests:
                    if r.request_id in covered:
                        self._from_run(r)
            requests = [r for r in requests if r.request_id not in covered]
        if not requests and not self.sessions.finished:
            return
        conn = self.connection
        with self._cv:
            self._step += 1
            step, connected = self._step, conn.connected
            inflight = conn.inflight > 0
            stalled = conn.stalled(time.monotonic())
        if not connected:
            return self._count("failed" if requests else None)
        if stalled:
            conn.disconnect(f"no reply for {self.config.stall_s:.1f} s")
            return self._count("failed")
        if inflight or self._pending:
            # the drafter has not answered an earlier message yet: skip, keep the deltas
            return self._count("late" if requests else None)
        if self._held is not None:  # asked once this step is launched
            return self._count("deferred" if requests else None)
        msg, sent = self._build(step, [(r, r.draft_budget) for r in requests])
        t0 = time.monotonic()
        reply = self._exchange_stream(msg) if self.mode == "stream" else self._exchange_unary(msg)
        if reply is not None and requests:
            self.patience.replied(time.monotonic() - t0)
            self._apply(reply, sent)
            for r in requests:
                self._from_run(r)

    def _ask(self, budget: int) -> int:
        """Tokens to ask for when a step may use `budget`: those and the look-ahead."""
        return min(budget + self.lookahead, self._most) if budget > 0 else 0

    def _from_run(self, r: Request) -> bool:
        """Fill `r`'s drafts from its kept proposal (`RemoteSessions.drafts_from_run`); False
        when none covers what was committed since (the drafter must be asked)."""
        got = self.sessions.drafts_from_run(r)
        if got is None:
            return False
        r.draft_tokens, probs, where = got
        if probs is not None:
            r.draft_probs = probs
        if where != "asked":
            self._count("branched" if where == "branch" else "lookahead")
        return True

    def _build(self, step: int, budgets: Sequence[tuple[Request, int]]):
        """The message for the requests of `budgets` (request, drafts it may use: each asks
        `_ask(budget)` tokens), with the finished notices pending. The two message types are
        field for field the same (drafter.proto)."""
        kind = drafter_pb2.DraftStreamRequest if self.mode == "stream" else drafter_pb2.DraftRequest
        msg = kind(step=step, want_probs=self.want_probs)
        per_position = branches_per_position(self.branches, len(budgets))
        if per_position and self.mode == "stream":
            msg.branches_later = self.config.branches_at == "later"
        asks = [(r, self._ask(budget)) for r, budget in budgets]
        return msg, self.sessions.write_updates(msg, asks, per_position)

    def _exchange_stream(self, msg: drafter_pb2.DraftStreamRequest) -> Reply | None:
        end = time.monotonic() + self.config.deadline_ms / 1000
        with self._cv:
            stream = self.connection.send(msg)
            if stream is None:
                return self._count("failed")
            if not msg.sequences or all(s.finished for s in msg.sequences):
                return None  # only `finished` notices: nothing to wait for
            return self._stream_reply(msg.step, stream, end)

    def _exchange_unary(self, msg: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse | None:
        """One blocking Draft call on the executor's thread: gRPC waits for the reply in C on
        this thread, so only this thread needs the GIL back when it arrives. A future would
        add a hand-over (gRPC's channel thread completes it, then wakes us), and each costs up
        to a GIL switch interval when the server's other threads are busy: 1.41 ms against
        2.73 ms a round trip next to one busy Python thread (`bench/drafter_ping.py
        --busy-threads 1`, bench/RESULTS.md round 7)."""
        try:
            return self.connection.stub.Draft(msg, timeout=self.config.deadline_ms / 1000)
        except grpc.RpcError as exc:
            return self._call_failed(exc)
        except ValueError:  # the channel closed under us (shutdown)
            return self._count("failed")

    def _apply(self, reply, sent: Sent) -> None:
        """Keep `reply`'s proposals (`RemoteSessions.apply`); count what it refused."""
        for name in self.sessions.apply(reply, sent):
            self._count(name)

    def _count(self, name: str | None) -> None:
        """Bump a counter (executor thread only: the one writer, so no lock)."""
        if name is not None:
            self._counters[name] += 1

    def timings(self) -> dict[str, float | None]:
        """`Patience.timings`: the EMAs its auto rules weigh, exported as gauges."""
        return self.patience.timings()

    def counters(self) -> dict[str, int]:
        """`COUNTERS`, as metrics.DRAFTER_COUNTERS describes them (reconnects: the first
        connection counts; probes: `Patience.at_launch`'s, counted in at_launch too), and the
        pipelined steps' hypotheses settled (`RemoteSessions._settle`)."""
        with self._cv:
            counts = dict(self._counters)
            counts["reconnects"] = self.connection.connections
            counts["probes"] = self.patience.probes
        counts["hypotheses_held"] = self.sessions.hypotheses_held
        counts["hypotheses_failed"] = self.sessions.hypotheses_failed
        return counts

    def close(self) -> None:
        self._held = None
        self.connection.close()
