"""How long a step waits for the remote drafter (`--drafter-patience-ms`) and when it asks
(`--drafter-ask-at`): what a step does with a reply it did not wait for, against real drafter
services on loopback. The rule itself, with explicit times: test_patience_rule.py."""

from __future__ import annotations

import time

import pytest
from procs import wait_until
from remote_harness import (
    MODES,
    REPETITIVE,
    Harness,
    make_request,
    never,
    reply_kept,
)

from specwire.common.errors import UserError
from specwire.target_service.config import TargetConfig
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig
from specwire.target_service.request import Request


@pytest.mark.parametrize("mode", MODES)
def test_with_no_patience_a_late_reply_serves_the_step_after(servers, mode):
    """--drafter-patience-ms 0: a step does not wait for the drafts asked for as the previous
    step committed. It goes without them (counted `deferred`), the reply stays awaited, and
    when it comes it is kept: the next step drafts from it, unasked, once what that step
    committed is the proposal's first token. A proposal the target went past is dropped and the
    drafter is asked afresh."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(f"grpc://{server.address}", mode=mode, patience_ms=0)
    store = server.engine.store
    a = make_request("a", REPETITIVE)  # 1 2 3 4 1 2 3 4 1 2
    assert h.step([a]) == [[3, 4, 1, 2]]  # no proposal yet: asked and waited for
    a.output_ids += [3, 4, 1, 2, 1]  # all accepted, a bonus token the look-ahead missed (3)
    h.drafter.submit([a])
    assert h.step([a]) == [[]]  # went without: the reply is 100 ms away
    assert h.counters()["deferred"] == 1 and not reply_kept(h.drafter)  # still awaited
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the deferred reply")
    asked = list(store.get("a").tokens)
    assert asked == a.token_ids
    # The proposal for "... 1 2 1" follows the latest earlier "1" (then "2 1", repeating):
    # 2 1 2 1 2 ... The draftless step committed its first token; the next step drafts its
    # next ones without a question.
    a.output_ids += [2]
    assert h.step([a]) == [[1, 2, 1, 2]]
    assert store.get("a").tokens == asked and h.counters()["lookahead"] == 1
    a.output_ids += [3, 7]  # one accepted, then a token the proposal did not foresee
    assert h.step([a]) == [[]]  # asked afresh (7 never occurred: nothing to propose)
    assert store.get("a").tokens == a.token_ids
    c = h.counters()
    assert c["late"] == c["failed"] == c["stale"] == 0 and c["deferred"] == 1


def patience_now(h: Harness) -> float | None:
    """How long a step now would wait for a question asked just now."""
    now = time.monotonic()
    return h.drafter.patience.wait_s(now, now, h.drafter.device_busy)


def timed_step(h: Harness, a: Request, forward_s: float, commit: list[int]) -> list[list[int]]:
    """One drafting step as the executor runs it: drafts, a forward of `forward_s`, commit,
    submit (which times the step: drafts taken -> submit)."""
    drafts = h.step([a])
    time.sleep(forward_s)
    a.output_ids += commit
    h.drafter.submit([a])
    return drafts


@pytest.mark.parametrize("mode", MODES)
def test_auto_patience_waits_only_for_a_reply_due_within_its_share_of_a_step(servers, mode):
    """Auto patience: before a step and a round trip were timed a step waits the deadline.
    Then it waits (at most 30 % of a drafting step) only for a reply expected within that
    share: a slow step (a CPU target's) waits for a quick drafter; a fast step (a GPU's) does
    not wait at all for a drafter slower than its share, whose reply is deferred."""
    quick = servers(max_draft_len=16)
    h = servers.harness(f"grpc://{quick.address}", mode=mode)
    a = make_request("a", REPETITIVE)
    h.drafter.submit([a])
    assert patience_now(h) is None  # nothing timed yet
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the first reply")
    a.output_ids += [3]
    timed_step(h, a, 0.2, [4, 1, 2, 1])  # round trip ~ms, a 0.2 s step: waits up to ~60 ms
    assert 0.06 <= patience_now(h) < 0.1
    assert h.step([a]) != [[]]  # the reply was waited for
    c = h.counters()
    assert c["prefetched"] == 2 and c["deferred"] == c["late"] == 0

    slow = servers(max_draft_len=16, delay_ms=400)
    h = servers.harness(f"grpc://{slow.address}", mode=mode)
    b = make_request("b", REPETITIVE)
    timed_step(h, b, 0.05, [3, 4, 1, 2, 1])  # asked and waited: a 0.4 s round trip, 50 ms step
    assert patience_now(h) == 0  # due in ~0.4 s, not within 15 ms
    assert h.step([b]) == [[]]  # not waited for
    assert h.counters()["deferred"] == 1 and not reply_kept(h.drafter)


@pytest.mark.parametrize("mode", MODES)
def test_auto_patience_waits_where_a_late_reply_would_be_wasted_or_waiting_is_free(servers, mode):
    """Auto patience still waits (up to the deadline) for a drafter asked without a
    look-ahead (a model drafter's proposal holds only the drafts asked for: one token later it
    is too short to use), and while another step runs on the device (the two-batch overlap)."""
    slow = servers(max_draft_len=16, delay_ms=150)
    h = servers.harness(f"grpc://{slow.address}", mode=mode, lookahead=0)
    a = make_request("a", REPETITIVE)
    timed_step(h, a, 0.02, [3, 4, 1, 2, 1])  # a 20 ms step, a 150 ms round trip
    assert patience_now(h) is None  # the deadline
    assert h.step([a]) != [[]]  # waited for
    c = h.counters()
    assert c["prefetched"] == 1 and c["deferred"] == 0

    h = servers.harness(f"grpc://{slow.address}", mode=mode)  # look-ahead: auto (n-gram)
    b = make_request("b", REPETITIVE)
    timed_step(h, b, 0.02, [3, 4, 1, 2, 1])
    assert patience_now(h) == 0  # would not wait...
    h.drafter.device_busy = True  # ...but the other half runs on the device meanwhile
    assert patience_now(h) is None
    assert h.step([b]) != [[]] and h.counters()["deferred"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_question_the_next_step_would_not_wait_for_goes_out_once_it_is_launched(servers, mode):
    """Auto patience, a round trip longer than the patience's share of a step but shorter than
    a step: the question asked as a step commits could only serve the step after next, so the
    drafter holds it back (no host time on the critical path) and sends it when the executor
    says the next step is on the device (`launched`). That step goes without drafts, as it
    would have without waiting; the reply drafts the step after."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    store = server.engine.store
    a = make_request("a", REPETITIVE)
    timed_step(h, a, 0.25, [3, 4, 1, 2, 1])  # asked and waited (~0.1 s); a 0.25 s step
    assert h.drafter.patience.at_launch(device_busy=False, covered=never)
    assert not h.drafter.patience.at_launch(
        device_busy=True, covered=never
    )  # a step in flight: send now
    assert reply_kept(h.drafter)  # nothing in flight: the question was held back
    assert len(store.get("a").tokens) == len(REPETITIVE)  # the drafter has not heard yet
    h.drafter.prepare_draft_tokens([a], h.resources)  # the next step's drafts
    assert a.draft_tokens == []  # the look-ahead missed the bonus token: none
    assert h.counters()["deferred"] == 1 and h.counters()["at_launch"] == 0
    h.drafter.launched()  # the step is on the device: the question goes out now
    assert h.counters()["at_launch"] == 1 and not reply_kept(h.drafter)
    commit_rtt = h.drafter.timings()["round_trip"]
    assert h.drafter.timings()["launch_round_trip"] is None
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the reply to the held question")
    assert store.get("a").tokens == a.token_ids
    # Its round trip (the drafter's 100 ms delay and more) is timed as a launch's, apart.
    assert h.drafter.timings()["launch_round_trip"] >= 0.1
    assert h.drafter.timings()["round_trip"] == commit_rtt
    a.output_ids += [2]  # the draftless step committed the proposal's first token
    assert h.step([a]) == [[1, 2, 1, 2]]  # drafted from its look-ahead, unasked; launched
    c = h.counters()
    assert c["at_launch"] == 1 and c["lookahead"] == 1 and c["late"] == c["failed"] == 0


@pytest.mark.parametrize("ask_at", ["auto", "timed"])
def test_a_question_no_next_step_needs_goes_out_once_it_is_launched(servers, ask_at):
    """Auto patience, a round trip the next step would wait for (20 ms against a 0.25 s step).
    A commit that accepted every draft and the proposal's bonus token leaves the next step
    drafting from the kept look-ahead: it needs no reply, so (auto) the question waits for
    the launch. A commit that leaves the proposal asks at once: the next step may wait for
    that reply. `--drafter-ask-at timed` asks at once either way."""
    server = servers(max_draft_len=16, delay_ms=20)
    h = servers.harness(f"grpc://{server.address}", ask_at=ask_at)
    a = make_request("a", REPETITIVE)
    assert timed_step(h, a, 0.25, [3, 4, 1, 2, 3]) == [[3, 4, 1, 2]]  # all, and the bonus
    held = ask_at == "auto"
    assert h.drafter.unanswered() == (0 if held else 1)
    if held:  # nothing went out: the drafter has not heard of the commit yet
        assert len(server.engine.store.get("a").tokens) == len(REPETITIVE)
    assert h.step([a]) == [[4, 1, 2, 3]]  # the look-ahead, either way; then launched
    assert h.counters()["at_launch"] == (1 if held else 0)
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the reply")
    assert server.engine.store.get("a").tokens == a.token_ids  # the question went out
    time.sleep(0.25)
    a.output_ids += [4, 3]  # the step leaves the proposal at its second draft
    h.drafter.submit([a])
    assert h.drafter.unanswered() == 1  # asked at the commit: the next step may wait for it
    assert h.step([a]) != [[]]  # waited for (within its share) and drafted from the reply
    c = h.counters()
    assert c["at_launch"] == (1 if held else 0) and c["deferred"] == c["late"] == 0


def test_a_drafter_that_wedges_while_questions_wait_for_launch_is_still_dropped(servers):
    """While the drafter holds each question back for the next launch, steps never ask a
    question of their own, so the stall check they made must still run: a stream drafter that
    stops answering is dropped after `stall_s` and the connection re-opened, as when steps
    ask. (Unary calls have no stream to wedge: each is given up at its deadline.)"""
    server = servers(max_draft_len=16, delay_ms=40)
    h = servers.harness(f"grpc://{server.address}", deadline_ms=100)  # stall: 2 s
    a = make_request("a", REPETITIVE)
    a.max_new_tokens = 10_000

    def one_step() -> None:
        timed_step(h, a, 0.1, [1])  # a 0.1 s step: a 40 ms reply is past its 30 ms share

    for _ in range(3):
        one_step()
    assert h.drafter.patience.at_launch(device_busy=False, covered=never)
    server.engine.delay_s = 2.5  # wedged: past the deadline and the stall time
    end = time.monotonic() + 15
    while h.counters()["failed"] == 0 and time.monotonic() < end:
        one_step()
    c = h.counters()
    assert c["failed"] >= 1 and c["at_launch"] >= 1
    server.engine.delay_s = 0.04
    wait_until(lambda: h.counters()["reconnects"] >= 2, timeout=10, what="a new connection")


@pytest.mark.parametrize("mode", MODES)
def test_while_questions_wait_for_launch_a_dead_drafter_counts_failed(servers, mode):
    """A step that holds the question for the launch goes without drafts; when that is because
    the link is down it counts `failed`, as a step asking itself would, not `deferred`."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    a = make_request("a", REPETITIVE)
    timed_step(h, a, 0.25, [3, 4, 1, 2, 1])  # the question is held for the launch
    assert h.drafter.patience.at_launch(device_busy=False, covered=never)
    server.stop(None)
    h.drafter.launched()  # the held question goes out to a drafter that is gone
    # (stream: the reader sees the stream end; unary: the failed call, once collected)
    wait_until(
        lambda: reply_kept(h.drafter) and not h.drafter.connection.connected,
        timeout=10,
        what="the link dropped",
    )
    a.output_ids += [2]
    h.drafter.submit([a])  # held again: nothing new was timed
    h.drafter.prepare_draft_tokens([a], h.resources)
    c = h.counters()
    assert a.draft_tokens == [] and c["failed"] >= 1 and c["deferred"] == 0


def test_a_unary_finished_notice_waits_for_the_draft_call_in_flight(servers):
    """Unary calls are served side by side: a request's finished notice sent while a Draft
    call naming it is still in flight could be applied first, and that call would re-create
    the session. So the notice goes once the call is done, and the session is freed."""
    server = servers(max_draft_len=16, delay_ms=300)
    h = servers.harness(f"grpc://{server.address}", mode="unary", patience_ms=0)
    store = server.engine.store
    a = make_request("a", REPETITIVE)
    h.step([a])  # the drafter now holds "a"
    a.output_ids += [3, 4, 1, 2, 1]
    h.drafter.submit([a])  # a Draft call naming "a", 300 ms away
    h.resources.free(a)  # "a" finished meanwhile
    assert not h.drafter._notices and "a" in store  # the notice waits for the call
    wait_until(lambda: "a" not in store, timeout=10, what="the session freed after the call")
    store.check_integrity()


@pytest.mark.parametrize("mode", MODES)
def test_a_deferred_reply_is_given_up_after_the_deadline(servers, mode):
    """A deferred reply that has not come a deadline after it was asked for is given up on
    (late): the next `submit` is no longer held back by it (a stream still carries one message
    at a time: its slot frees when the reply comes or the stream is declared stalled)."""
    server = servers(delay_ms=1500)
    h = servers.harness(f"grpc://{server.address}", mode=mode, deadline_ms=100, patience_ms=0)
    a = make_request("a", REPETITIVE)
    h.drafter.submit([a])
    assert h.step([a]) == [[]]
    assert h.counters()["deferred"] == 1 and not reply_kept(h.drafter)
    time.sleep(0.15)  # past the deadline
    assert reply_kept(h.drafter)  # given up: nothing awaited any more
    assert h.counters()["late"] == 1


def test_patience_must_lie_between_zero_and_the_deadline():
    with pytest.raises(UserError, match="patience must be between 0 and the deadline"):
        RemoteDrafterConfig("grpc://h:1", deadline_ms=50, patience_ms=60)
    assert RemoteDrafterConfig("h:1", deadline_ms=50, patience_ms=0).patience_s == 0
    assert RemoteDrafterConfig("h:1", deadline_ms=50).patience_s is None  # auto
    with pytest.raises(UserError, match="--drafter-patience-ms must be between 0"):
        TargetConfig(drafter_deadline_ms=50, drafter_patience_ms=-0.5)
    with pytest.raises(
        UserError, match="--drafter-ask-at must be one of auto, timed, commit, launch"
    ):
        TargetConfig(drafter_ask_at="later")
    with pytest.raises(UserError, match="ask-at must be one of auto, timed, commit, launch"):
        RemoteDrafterConfig("h:1", ask_at="later")
