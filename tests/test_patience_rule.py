"""The remote drafter's patience and send-at-launch rule (`remote_patience.Patience`) with
explicit times: no drafter, no clock. How a step acts on it, against real drafter services:
test_remote_patience.py."""

from __future__ import annotations

import pytest
from remote_harness import never

from specwire.common.errors import UserError
from specwire.target_service.config import TargetConfig
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig
from specwire.target_service.drafters.remote_patience import (
    COVER_EVERY,
    PATIENCE_SHARE,
    PROBE_EVERY,
    PROBE_MOST,
    Patience,
)


def always() -> bool:  # every request drafts from a kept proposal
    return True


def rule(patience_ms: float = -1, lookahead: int = 5, deadline_ms: float = 50) -> Patience:
    config = RemoteDrafterConfig("h:1", deadline_ms=deadline_ms, patience_ms=patience_ms)
    return Patience(config, lookahead)


def test_the_rule_waits_within_its_share_of_a_step_only_for_a_reply_due_in_it():
    p = rule()
    assert p.wait_s(0.0, 0.0, device_busy=False) is None  # nothing timed: the deadline
    p.drafted(10.0, device_busy=False)
    p.committed(10.002)  # a 2 ms step
    assert p.wait_s(0.0, 0.0, device_busy=False) is None  # no round trip timed yet
    p.replied(0.001)  # a 1 ms round trip
    share = PATIENCE_SHARE * 0.002
    # Asked 0.5 ms ago: due in 0.5 ms, within the 0.6 ms share -> wait up to the share.
    assert p.wait_s(20.0, 20.0005, device_busy=False) == pytest.approx(share)
    # Asked just now: due in 1 ms, past the share -> no wait at all.
    assert p.wait_s(20.0, 20.0, device_busy=False) == 0
    # ... unless the device is busy anyway, or a late reply would be too short to use.
    assert p.wait_s(20.0, 20.0, device_busy=True) is None
    assert rule(lookahead=0).wait_s(20.0, 20.0, device_busy=False) is None


def test_the_rule_keeps_emas_and_skips_what_is_not_a_step():
    p = rule()
    p.drafted(0.0, device_busy=False)
    p.committed(0.010)
    p.drafted(1.0, device_busy=False)
    p.committed(1.020)  # 0.8 * 10 ms + 0.2 * 20 ms
    assert p.step_s == pytest.approx(0.012)
    p.drafted(2.0, device_busy=True)  # a two-batch half: not timed
    p.committed(2.5)
    p.committed(3.0)  # nothing drafted since: nothing to time
    p.drafted(4.0, device_busy=False)
    p.committed(4.0 + p.config.stall_s + 1)  # a failed step left it set: not a sample
    assert p.step_s == pytest.approx(0.012)
    p.replied(0.002)
    p.replied(0.004)
    assert p.rtt_s == pytest.approx(0.0024)


def test_a_fixed_patience_is_used_as_is_and_the_whole_deadline_means_the_deadline():
    assert rule(patience_ms=5).wait_s(0.0, 0.0, device_busy=True) == pytest.approx(0.005)
    assert rule(patience_ms=0).wait_s(0.0, 0.0, device_busy=False) == 0
    assert rule(patience_ms=50).wait_s(0.0, 0.0, device_busy=False) is None


def timed_rule(ask_at: str = "auto", rtt: float = 0.005) -> Patience:
    """A rule that has timed a 10 ms drafting step, a launch 1 ms after its commit and that
    step's commit 8 ms after its launch, and a round trip of `rtt` (sent at the commit)."""
    p = Patience(RemoteDrafterConfig("h:1", deadline_ms=50, ask_at=ask_at), 5)
    p.drafted(0.0, device_busy=False)
    p.committed(0.010)
    p.launched(0.011)
    p.committed(0.019)
    p.replied(rtt)
    return p


def test_the_rule_holds_a_question_back_only_when_no_step_would_use_it_and_it_comes_in_time():
    """`at_launch`: auto patience only, a look-ahead, nothing on the device; the round trip
    less the commit-to-launch gap past the share of a step (the next step would not wait), or
    every request covered by a kept proposal (auto, not timed), and the round trip within the
    time from a launch to that step's commit (the step after still gets the reply)."""
    p = rule()
    assert not p.at_launch(device_busy=False, covered=never)  # nothing timed yet
    p = timed_rule()
    assert p.step_s == pytest.approx(0.010) and p.gap_s == pytest.approx(0.001)
    assert p.span_s == pytest.approx(0.008)
    # 5 ms: 4 ms past the gap > the 3 ms share; sent at the launch, in before its commit
    assert p.at_launch(device_busy=False, covered=never)
    assert not p.at_launch(device_busy=True, covered=never)
    assert not rule(lookahead=0).at_launch(device_busy=False, covered=never)
    fixed = rule(patience_ms=0)
    fixed.step_s, fixed.rtt_s, fixed.span_s = p.step_s, p.rtt_s, p.span_s
    assert not fixed.at_launch(device_busy=False, covered=never)  # fixed: asked at the commit
    commit = timed_rule("commit")
    assert not commit.at_launch(device_busy=False, covered=never)  # --drafter-ask-at commit
    p = timed_rule(rtt=0.0035)  # 2.5 ms after the gap: the next step would wait for it...
    assert not p.at_launch(device_busy=False, covered=never)
    assert p.at_launch(device_busy=False, covered=always)  # ...unless it drafts from proposals
    timed = timed_rule("timed", rtt=0.0035)
    assert not timed.at_launch(device_busy=False, covered=always)  # --drafter-ask-at timed
    launch = Patience(RemoteDrafterConfig("h:1", deadline_ms=50, ask_at="launch"), 5)
    assert launch.at_launch(device_busy=False, covered=never)  # always, nothing timed needed
    assert not launch.at_launch(device_busy=True, covered=always)  # a step in flight: now
    assert not commit.at_launch(device_busy=False, covered=always)
    assert not p.at_launch(device_busy=True, covered=always)
    p = timed_rule(rtt=0.0095)  # past the 8 ms a launch has: the step after would miss it
    assert not p.at_launch(device_busy=False, covered=never)
    assert not p.at_launch(device_busy=False, covered=always)
    p.launched(0.020)  # 1 ms after the commit at 19 ms: a gap sample
    p.launched(0.6)  # no commit since the last launch: not a gap
    assert p.gap_s == pytest.approx(0.001)


def test_where_every_request_is_rarely_covered_the_rule_peeks_only_now_and_then():
    """The peek at every request's kept proposal is taken per row count: at 8 rows, never
    true, it stops after a few dozen questions but for one in COVER_EVERY, and a true one
    there brings it back; at 1 row, true half the time, every question peeks."""
    p = timed_rule(rtt=0.0035)  # the next step would wait: only `covered` holds a question
    peeks = {1: 0, 8: 0}

    def counted(rows: int, answer: bool):
        def covered() -> bool:
            peeks[rows] += 1
            return answer

        return covered

    for i in range(200):
        assert not p.at_launch(device_busy=False, covered=counted(8, False), rows=8)
        assert p.at_launch(device_busy=False, covered=counted(1, i % 2 == 0), rows=1) == (
            i % 2 == 0
        )
    assert peeks[1] == 200  # one row: every question peeks
    # 23 peeks until the share falls below COVER_RARE (0.875 ** 23 < 0.05), then one in
    # COVER_EVERY
    assert peeks[8] == 23 + (200 - 23) // COVER_EVERY
    before = peeks[8]
    while peeks[8] == before:  # the next peek there says yes: the question is held
        held = p.at_launch(device_busy=False, covered=counted(8, True), rows=8)
    assert held
    for _ in range(5):  # and the questions right after peek again
        assert not p.at_launch(device_busy=False, covered=counted(8, False), rows=8)
    assert peeks[8] == before + 1 + 5


def test_a_gate_the_commits_round_trip_shuts_is_probed_and_opens_on_the_launchs():
    """While only the round trip keeps questions at the commit, every PROBE_EVERY-th goes at
    the launch; the launch's own round trip then decides, and the patience for a reply sent
    at a launch reckons with it."""
    p = timed_rule(rtt=0.0095)  # the next step would not wait (8.5 ms left > 3 ms share)
    answers = [p.at_launch(device_busy=False, covered=never) for _ in range(PROBE_EVERY)]
    assert answers == [False] * (PROBE_EVERY - 1) + [True] and p.probes == 1
    p.replied(0.004, at_launch=True)  # sent at the launch, the round trip is 4 ms
    assert p.launch_rtt_s == pytest.approx(0.004) and p.rtt_s == pytest.approx(0.0095)
    assert p.timings()["launch_round_trip"] == pytest.approx(0.004)
    assert p.at_launch(device_busy=False, covered=never) and p.probes == 1  # fits: no probe
    # A reply asked at a launch 2 ms ago is due within the 3 ms share: waited for; reckoned
    # with the commit's round trip it would be 7.5 ms away, not waited for.
    share = PATIENCE_SHARE * p.step_s
    assert p.wait_s(20.0, 20.002, device_busy=False, at_launch=True) == pytest.approx(share)
    assert p.wait_s(20.0, 20.002, device_busy=False) == 0
    for _ in range(10):
        p.replied(0.012, at_launch=True)  # the launch's round trip grew past its 8 ms
    # Shut again: probing resumes, every PROBE_EVERY-th question, and each probe that finds
    # the gate shut doubles the interval (64, 128, ...) up to PROBE_MOST.
    gaps = []
    for _ in range(7):
        n = 1
        while not p.at_launch(device_busy=False, covered=never):
            n += 1
        gaps.append(n)
    assert gaps == [min(PROBE_EVERY * 2**i, PROBE_MOST) for i in range(7)]
    assert p.probes == 1 + 7
    # A probe needs a reason too: a step that would wait for the reply keeps it at the commit.
    q = timed_rule("timed", rtt=0.0095)
    q.rtt_s = 0.0035  # would be waited for; the gate is shut by the (unmeasured) launch...
    q.span_s = 0.003  # ...since 3.5 ms does not fit in 3 ms
    assert not any(q.at_launch(device_busy=False, covered=always) for _ in range(PROBE_EVERY))
    assert q.probes == 0


def test_the_gain_rule_waits_as_long_as_the_policy_says_drafts_are_worth():
    """`--drafter-wait-rule gain`: the budget is the step's `wait_worth_s` (capped by the
    deadline), not a share of the step; without a price it falls back to the share."""
    worth: list[float | None] = [None]
    config = RemoteDrafterConfig("h:1", deadline_ms=50, wait_rule="gain")
    p = Patience(config, 5, lambda: worth[0])
    p.drafted(10.0, device_busy=False)
    p.committed(10.002)  # a 2 ms step
    p.replied(0.001)  # a 1 ms round trip
    share = PATIENCE_SHARE * 0.002
    assert p.wait_s(20.0, 20.0, device_busy=False) == 0  # unpriced: due past the share
    worth[0] = 0.0015  # the drafts pay for up to 1.5 ms of waiting
    assert p.wait_s(20.0, 20.0, device_busy=False) == pytest.approx(0.0015)
    assert p.wait_s(20.0, 20.0005, device_busy=False) == pytest.approx(0.0015)
    worth[0] = 0.0005  # due in 1 ms, worth 0.5: not waited for
    assert p.wait_s(20.0, 20.0, device_busy=False) == 0
    worth[0] = -0.001  # drafting does not pay even at once
    assert p.wait_s(20.0, 20.0, device_busy=False) == 0
    worth[0] = 1.0  # worth more than the deadline: the deadline
    assert p.wait_s(20.0, 20.0, device_busy=False) is None
    # The share rule ignores the price.
    shared = Patience(RemoteDrafterConfig("h:1", deadline_ms=50), 5, lambda: 0.0015)
    shared.step_s, shared.rtt_s = p.step_s, p.rtt_s
    assert shared.wait_s(20.0, 20.0005, device_busy=False) == pytest.approx(share)
    assert shared.wait_s(20.0, 20.0, device_busy=False) == 0


def test_the_gain_rule_asks_at_the_commit_when_the_next_step_would_wait():
    """A question the next step would wait for under its price is not held for the launch
    (the share rule holds it: its round trip is past the share)."""
    worth: list[float | None] = [0.006]
    config = RemoteDrafterConfig("h:1", deadline_ms=50, wait_rule="gain")
    p = Patience(config, 5, lambda: worth[0])
    p.drafted(0.0, device_busy=False)
    p.committed(0.010)
    p.launched(0.011)
    p.committed(0.019)
    p.replied(0.005)  # due 4 ms after the gap: within the 6 ms worth
    assert not p.at_launch(device_busy=False, covered=never)
    assert timed_rule().at_launch(device_busy=False, covered=never)  # the share: held
    worth[0] = 0.002  # worth less than its remaining 4 ms: held for the launch
    assert p.at_launch(device_busy=False, covered=never)


def test_an_unknown_wait_rule_is_one_clear_error():
    with pytest.raises(UserError, match="wait rule must be one of share, gain"):
        RemoteDrafterConfig("h:1", wait_rule="forever")
    with pytest.raises(UserError, match="--drafter-wait-rule must be one of share, gain"):
        TargetConfig(drafter_wait_rule="forever")
