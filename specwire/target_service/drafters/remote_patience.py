"""How long a step waits for the remote drafter's reply to the question asked as the previous
step committed (`--drafter-patience-ms`; see remote.py's docstring, "Patience").

Fixed: the flag's value. Auto: the reply is waited for only when it is due within
PATIENCE_SHARE of a drafting step's time, and then at most that long; otherwise not at all,
and the late reply serves the step after. `None` means "up to the deadline, then give it up",
which auto also answers before anything was timed, while another step keeps the device busy
(the two-batch overlap: waiting is nearly free), and for a drafter asked without a look-ahead
(its late proposal holds just the drafts asked for: one token later it is too short to use).

Three EMAs, all from the remote drafter's own calls: a drafting step (drafts taken -> the
step's `submit`), a round trip (sent -> the reply's arrival) and the host's gap between a
step's commit and the next launch (`submit` -> `launched`).

Sending at launch (`at_launch`). When the next step will not use the reply, the question asked
as a step commits serves only the step after next. Building and sending it then costs the
synchronous step ~50 us of host time on its critical path for nothing (and gRPC's threads
serialise it while the executor wants the GIL), so the drafter holds it back and sends it once
the next step has been launched, while the device runs; it is still in time when the round trip
plus that gap fits in a step. The next step will not use the reply when it would not wait for
it (the round trip is longer than its share: "timed"), or when every request's drafts come
from a kept proposal (the last step accepted what it was proposed: `covered`). Auto patience
only (a fixed one keeps the question at the commit); `--drafter-ask-at timed` keeps the first
reason only, `commit` turns it off and `launch` holds every such question (A/B switches:
`launch` tests whether the round trip, measured while questions go out at the commit, is
itself lengthened by the host work they then compete with).
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


class Patience:
    """The timings and the rule; the remote drafter feeds it (executor thread only)."""

    def __init__(self, config: RemoteDrafterConfig, lookahead: int) -> None:
        self.config = config
        self.lookahead = lookahead
        self.step_s: float | None = None  # EMA of a drafting step: drafts taken -> submit
        self.rtt_s: float | None = None  # EMA of a round trip: sent -> reply arrived
        self.gap_s: float | None = None  # EMA of a step's commit -> the next launch (host)
        self._drafted_at: float | None = None
        self._committed_at: float | None = None

    def drafted(self, now: float, device_busy: bool) -> None:
        """A step took its drafts. A two-batch half's drafts -> submit spans only part of a
        period: not timed."""
        self._drafted_at = None if device_busy else now

    def committed(self, now: float) -> None:
        """The step that last took drafts committed (`submit`): one step-time sample, unless it
        is longer than the stall time (a step that failed left `drafted` set)."""
        self._committed_at = now
        if self._drafted_at is None:
            return
        took, self._drafted_at = now - self._drafted_at, None
        if took < self.config.stall_s:
            self.step_s = _ema(self.step_s, took)

    def launched(self, now: float) -> None:
        """The step after the last commit was launched: one gap sample."""
        if self._committed_at is not None:
            gap, self._committed_at = now - self._committed_at, None
            if gap < self.config.stall_s:
                self.gap_s = _ema(self.gap_s, gap)

    def at_launch(self, device_busy: bool, covered: Callable[[], bool]) -> bool:
        """Whether a question asked as a step commits should wait for the next launch (see
        the module docstring): auto patience, nothing on the device, a look-ahead (the reply
        serves the step after next), a round trip that, sent at the launch, still ends within
        a step (with the gap to spare), and a next step that will not use the reply: it would
        not wait for it (its remainder at the launch is longer than its share), or (auto)
        `covered()`, every request's drafts come from a kept proposal. `--drafter-ask-at
        launch` skips the timings (always), `commit` says never."""
        if self.config.patience_s is not None or device_busy or self.lookahead == 0:
            return False
        if self.config.ask_at in ("commit", "launch"):  # the A/B switches: never, always
            return self.config.ask_at == "launch"
        step, rtt = self.step_s, self.rtt_s
        if step is None or rtt is None:
            return False
        gap = self.gap_s or 0.0
        if rtt + gap > step:
            return False
        if PATIENCE_SHARE * step < rtt - gap:
            return True
        return self.config.ask_at == "auto" and covered()

    def timings(self) -> dict[str, float | None]:
        """The three EMAs in seconds (None before a first sample): what the auto rules weigh."""
        return {
            "round_trip": self.rtt_s,
            "drafting_step": self.step_s,
            "commit_to_launch": self.gap_s,
        }

    def replied(self, seconds: float) -> None:
        """A reply arrived `seconds` after its question was sent."""
        self.rtt_s = _ema(self.rtt_s, seconds)

    def wait_s(self, sent_at: float, now: float, device_busy: bool) -> float | None:
        """How long a step at `now` waits for the reply to a question sent at `sent_at`."""
        patience = self.config.patience_s
        if patience is None:
            if self.step_s is None or self.rtt_s is None or device_busy or self.lookahead == 0:
                return None
            budget = PATIENCE_SHARE * self.step_s
            patience = budget if sent_at + self.rtt_s - now <= budget else 0.0
        return None if patience >= self.config.deadline_ms / 1000 else patience


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _EMA) * old + _EMA * sample
