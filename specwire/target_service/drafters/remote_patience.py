"""How long a step waits for the remote drafter's reply to the question asked as the previous
step committed (`--drafter-patience-ms`; see remote.py's docstring, "Patience").

Fixed: the flag's value. Auto: the reply is waited for only when it is due within a budget,
and then at most that long; otherwise not at all, and the late reply serves the step after.
The budget (`--drafter-wait-rule`): PATIENCE_SHARE of a drafting step's time ("share"), or
what the step's drafts are worth by the draft-length policy's cost model ("gain",
`DraftLengthPolicy.wait_worth_s`: the longest wait after which the step, drafts verified,
still commits tokens faster than without them; at one stream on a small model, where a
drafting step commits ~2-3 tokens for ~1.1x a plain step's time, that is longer than a round
trip, where a share of the step is not). `None` means "up to the deadline, then give it up",
which auto also answers before anything was timed, while another step keeps the device busy
(the two-batch overlap: waiting is nearly free), and for a drafter asked without a look-ahead
(its late proposal holds just the drafts asked for: one token later it is too short to use).

Five EMAs, all from the remote drafter's own calls: a drafting step (drafts taken -> the
step's `submit`), a round trip (sent -> the reply's arrival) of the questions sent at a commit
or inside a step, the same for those sent at a launch, the host's gap between a step's commit
and the next launch (`submit` -> `launched`) and the time from a launch to that step's commit
(`launched` -> `submit`: what a question sent at the launch has before the step after drafts).

Sending at launch (`at_launch`). When the next step will not use the reply, the question asked
as a step commits serves only the step after next. Building and sending it then costs the
synchronous step ~50 us of host time on its critical path for nothing (and gRPC's threads
serialise it while the executor wants the GIL), so the drafter holds it back and sends it once
the next step has been launched, while the device runs; it is still in time when the round trip
fits in the time from the launch to that step's commit. The next step will not use the reply
when it would not wait for it (the round trip is longer than its share: "timed"), or when every
request's drafts come from a kept proposal (the last step accepted what it was proposed:
`covered`). Auto patience only (a fixed one keeps the question at the commit);
`--drafter-ask-at timed` keeps the first reason only, `commit` turns it off and `launch`
holds every such question (A/B switches: `launch` tests whether the round trip, measured while
questions go out at the commit, is itself lengthened by the host work they compete with).

The two round trips are timed apart because they can differ: a question sent at the commit
travels while the executor builds the next step, holding the GIL that gRPC's threads need to
send it and to hand its reply over; one sent at the launch travels mostly while the executor
waits for the device (in the CPU proxy 0.5-0.6 ms at the commit, 0.37-0.45 at the launch; on
the H100, round 30, no shorter: 0.66-0.85 at the launch, 0.76-1.21 at the commit).
Judging a launch by the commit's round trip would keep the gate shut for good, so while it
is shut for the time alone, now and then a question that has a reason goes at the launch
anyway (`probes`, one per PROBE_EVERY commits, backing off to PROBE_MOST): it measures the launch's
round trip, and the gate opens when that fits.
"""

from __future__ import annotations

from collections.abc import Callable

from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig

# On the H200 the reply was still ~0.9 ms away when a 1.2 ms step wanted it (~1.6 ms at 8
# rows, 1.5 ms steps): not waited for, and never waiting paid 1.18-1.20x against 1.00-1.05x for
# waiting it all or a tenth of the step every time, at one stream (bench/RESULTS.md, round 9).
# A CPU target's reply (~0.5 ms on loopback) is due within 30 % of its step and is waited for,
# so its drafts are verified.
PATIENCE_SHARE = 0.3
_EMA = 0.2  # weight of a new sample
# While only the timing keeps questions at the commit, after this many commits so judged the
# next question that has a reason to wait for the launch goes then anyway, to measure the
# launch's round trip (a probe costs at most one step's asked-for drafts: its reply comes a
# step late and serves the steps after).
# Each probe that finds the gate still shut doubles the interval, up to PROBE_MOST; the gate
# found open resets it. On the H100 a launch's round trip (0.66-0.85 ms) never fit the
# 0.2-0.5 ms from a launch to its commit: 27-28 probes a pass at a fixed 32 (round 30).
PROBE_EVERY = 32
PROBE_MOST = 1024
COVER_WEIGHT = 0.125
COVER_RARE = 0.05
COVER_EVERY = 16


class Patience:
    """The timings and the rule; the remote drafter feeds it (executor thread only)."""

    def __init__(
        self,
        config: RemoteDrafterConfig,
        lookahead: int,
        worth: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.config = config
        # The config's derived values, read every step (its properties compute them each time).
        self._stall_s = config.stall_s
        self._patience_s = config.patience_s
        self._deadline_s = config.deadline_ms / 1000
        self.lookahead = lookahead
        self.worth = worth  # the step's `Drafter.wait_worth_s` (the "gain" rule's budget)
        self.step_s: float | None = None  # EMA of a drafting step: drafts taken -> submit
        self.rtt_s: float | None = None  # EMA of a round trip: sent -> reply arrived
        self.launch_rtt_s: float | None = None  # the same, of questions sent at a launch
        self.gap_s: float | None = None  # EMA of a step's commit -> the next launch (host)
        self.span_s: float | None = None  # EMA of a launch -> that step's commit
        self.probes = 0  # questions sent at a launch only to measure its round trip
        self._shut = 0  # questions kept at the commit by the timing alone since the last probe
        self._probe_every = PROBE_EVERY  # doubles with each probe while the gate stays shut
        # rows -> (share of the `covered` peeks there that were true, questions since a peek)
        self._cover: dict[int, tuple[float, int]] = {}
        self._drafted_at: float | None = None
        self._committed_at: float | None = None
        self._launched_at: float | None = None

    def drafted(self, now: float, device_busy: bool) -> None:
        """A step took its drafts. A two-batch half's drafts -> submit spans only part of a
        period: not timed."""
        self._drafted_at = None if device_busy else now

    def committed(self, now: float) -> None:
        """The step that last took drafts committed (`submit`): one step-time sample, unless it
        is longer than the stall time (a step that failed left `drafted` set); and one
        launch-to-commit sample."""
        self._committed_at = now
        if self._launched_at is not None:
            span, self._launched_at = now - self._launched_at, None
            if span < self._stall_s:
                self.span_s = _ema(self.span_s, span)
        if self._drafted_at is None:
            return
        took, self._drafted_at = now - self._drafted_at, None
        if took < self._stall_s:
            self.step_s = _ema(self.step_s, took)

    def launched(self, now: float) -> None:
        """The step after the last commit was launched: one gap sample."""
        self._launched_at = now
        if self._committed_at is not None:
            gap, self._committed_at = now - self._committed_at, None
            if gap < self._stall_s:
                self.gap_s = _ema(self.gap_s, gap)

    def at_launch(self, device_busy: bool, covered: Callable[[], bool], rows: int = 1) -> bool:
        """Whether a question asked as a step commits should wait for the next launch (see
        the module docstring): auto patience, nothing on the device, a look-ahead (the reply
        serves the step after next), a round trip that, sent at the launch, still ends before
        that step commits (the launch's own round trip once measured, else the commit's; a
        probe now and then while that shuts the gate), and a next step that will not use the
        reply: it would not wait for it (its remainder at the launch is longer than its
        share), or (auto) `covered()`, every request's drafts come from a kept proposal (at
        `rows` requests: see `_covered`). `--drafter-ask-at launch` skips the timings
        (always), `commit` says never."""
        if self._patience_s is not None or device_busy or self.lookahead == 0:
            return False
        if self.config.ask_at in ("commit", "launch"):  # the A/B switches: never, always
            return self.config.ask_at == "launch"
        step, rtt, span = self.step_s, self.rtt_s, self.span_s
        if step is None or rtt is None or span is None:
            return False
        late = self.launch_rtt_s if self.launch_rtt_s is not None else rtt
        fits = late <= span
        if fits:
            self._probe_every = PROBE_EVERY
        elif self._shut + 1 < self._probe_every:
            self._shut += 1
            return False
        gap = self.gap_s or 0.0
        unused = self._budget(step) < rtt - gap
        if not (unused or (self.config.ask_at == "auto" and self._covered(covered, rows))):
            return False
        if not fits:
            self._shut = 0
            self._probe_every = min(2 * self._probe_every, PROBE_MOST)
            self.probes += 1
        return True

    def _covered(self, covered: Callable[[], bool], rows: int) -> bool:
        """`covered()`, but not at a row count where it has become rare (COVER_RARE), except
        for every COVER_EVERY-th question there (see the module docstring)."""
        share, since = self._cover.get(rows, (1.0, 0))
        if share < COVER_RARE and since + 1 < COVER_EVERY:
            self._cover[rows] = (share, since + 1)
            return False
        hit = covered()
        self._cover[rows] = (share + COVER_WEIGHT * (hit - share), 0)
        return hit

    def timings(self) -> dict[str, float | None]:
        """The five EMAs in seconds (None before a first sample): what the auto rules weigh
        (keys: metrics.DRAFTER_TIMINGS)."""
        return {
            "round_trip": self.rtt_s,
            "drafting_step": self.step_s,
            "commit_to_launch": self.gap_s,
            "launch_round_trip": self.launch_rtt_s,
            "launch_to_commit": self.span_s,
        }

    def replied(self, seconds: float, at_launch: bool = False) -> None:
        """A reply arrived `seconds` after its question was sent (`at_launch`: at a launch)."""
        if at_launch:
            self.launch_rtt_s = _ema(self.launch_rtt_s, seconds)
        else:
            self.rtt_s = _ema(self.rtt_s, seconds)

    @property
    def auto(self) -> bool:
        """Whether the patience is auto (no `--drafter-patience-ms`)."""
        return self._patience_s is None

    def wait_s(
        self, sent_at: float, now: float, device_busy: bool, at_launch: bool = False
    ) -> float | None:
        """How long a step at `now` waits for the reply to a question sent at `sent_at` (at a
        launch: due after the launch's round trip, once measured)."""
        patience = self._patience_s
        if patience is None:
            rtt = self.launch_rtt_s if at_launch and self.launch_rtt_s is not None else self.rtt_s
            if self.step_s is None or rtt is None or device_busy or self.lookahead == 0:
                return None
            budget = self._budget(self.step_s)
            patience = budget if sent_at + rtt - now <= budget else 0.0
        return None if patience >= self._deadline_s else patience

    def _budget(self, step_s: float) -> float:
        """How long a step may wait for a reply on its way (see the module docstring): the
        step's worth of its drafts under the "gain" rule, once the policy prices it (capped
        by the deadline), else a share of a drafting step."""
        if self.config.wait_rule == "gain":
            worth = self.worth()
            if worth is not None:
                return min(max(worth, 0.0), self._deadline_s)
        return PATIENCE_SHARE * step_s


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _EMA) * old + _EMA * sample
