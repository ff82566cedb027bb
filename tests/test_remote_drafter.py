"""RemoteDrafter against real drafter servers on loopback: handshake, deltas, fail-open,
reconnect + resync, deadlines, malformed replies."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from procs import free_port, start_service, stop_service, wait_until
from remote_harness import (
    FP,
    GRPC_MODES,
    MODES,
    REPETITIVE,
    VOCAB,
    Harness,
    make_request,
    reply_kept,
)

from specwire.common.errors import UserError
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.drafter_service.drafters import NGramDrafter
from specwire.target_service.drafters.remote import RemoteSessions
from specwire.target_service.request import PENDING

# -- handshake ------------------------------------------------------------------------------------


class AdvertisingNGram(NGramDrafter):
    def __init__(self, vocab_size: int, fingerprint: str) -> None:
        super().__init__()
        self.vocab_size, self.tokenizer_fingerprint = vocab_size, fingerprint


@pytest.mark.parametrize(
    ("vocab", "fp", "error"),
    [
        (VOCAB + 1, "", "vocabulary size 101, the target model has 100"),
        (0, "fp-other", "uses another tokenizer"),
    ],
)
def test_handshake_refuses_mismatched_drafters(servers, vocab, fp, error):
    server = servers(AdvertisingNGram(vocab, fp))
    with pytest.raises(UserError, match=error):
        Harness(f"grpc://{server.address}")


def test_handshake_accepts_matching_or_token_agnostic_drafters(servers):
    for vocab, fp in [(VOCAB, FP), (0, ""), (VOCAB, "")]:
        server = servers(AdvertisingNGram(vocab, fp))
        h = servers.harness(f"grpc://{server.address}")
        assert h.drafter.info.vocab_size == vocab


def test_handshake_refuses_unreachable_drafter_and_wrong_protocol(servers):
    with pytest.raises(UserError, match="unreachable"):
        Harness(f"grpc://127.0.0.1:{free_port()}", startup_wait_s=0.3)

    class FutureVersion(drafter_pb2_grpc.DrafterServiceServicer):
        def GetInfo(self, request, context):
            return drafter_pb2.GetInfoResponse(protocol_version=2, name="future")

    server, port = custom_server(FutureVersion())
    try:
        with pytest.raises(UserError, match="protocol version 2"):
            Harness(f"grpc://127.0.0.1:{port}")
    finally:
        server.stop(None)


# -- deltas, finished ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_drafts_flow_as_deltas_and_finished_frees_the_session(servers, mode):
    server = servers()
    # No look-ahead: every step asks (the look-ahead has its own test below).
    h = servers.harness(f"grpc://{server.address}", mode=mode, lookahead=0)
    a, b = make_request("a", REPETITIVE), make_request("b", [5, 6, 7, 5, 6], k=2)
    assert h.step([a, b]) == [[3, 4, 1, 2], [7, 5]]
    store = server.engine.store
    a.output_ids += [3, 4]
    b.output_ids += [7]
    assert h.step([a, b]) == [[1, 2, 3, 4], [5, 6]]
    assert store.get("a").tokens == a.token_ids and store.get("b").tokens == b.token_ids
    assert h.drafter.spec_resource_manager.synced == {"a": 12, "b": 6}
    h.resources.free(b)  # sends b's `finished` at once, without waiting for a step
    wait_until(lambda: "b" not in store, timeout=10, what="b's session to be freed")
    a.output_ids += [1]
    h.step([a])
    assert "a" in store
    c = h.counters()
    assert c["reconnects"] == 1 and all(c[k] == 0 for k in c if k != "reconnects")


@pytest.mark.parametrize("mode", MODES)
def test_lookahead_drafts_the_next_step_without_asking_when_all_is_accepted(servers, mode):
    """The target asks for K drafts + 4(K+1) more (n-gram, auto; the drafter caps the whole
    at 16 here). A step that accepts every draft and whose bonus token is the proposal's next
    one takes the next drafts from the kept proposal: nothing is sent, the drafter's session
    does not move. Any other outcome asks."""
    server = servers(max_draft_len=16)
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    assert h.drafter.lookahead == 20  # 4(K + 1) for an n-gram drafter
    store = server.engine.store
    a = make_request("a", REPETITIVE)  # 1 2 3 4 1 2 3 4 1 2
    assert h.step([a]) == [[3, 4, 1, 2]]
    assert store.get("a").tokens == REPETITIVE
    a.output_ids += [3, 4, 1, 2, 3]  # all four accepted, bonus 3 = the proposal's 5th token
    assert h.step([a]) == [[4, 1, 2, 3]]  # the proposal's tokens 6..9
    assert store.get("a").tokens == REPETITIVE  # not asked: the drafter heard nothing
    assert h.counters()["lookahead"] == 1
    a.output_ids += [4, 9]  # one accepted, then a bonus token the proposal did not foresee
    assert h.step([a]) == [[]]  # asked afresh: 9 never occurred before, no n-gram match
    assert store.get("a").tokens == a.token_ids  # the delta went out with the question
    a.output_ids += [1]
    assert h.step([a]) == [[2, 3, 4, 9]]  # "1" -> what followed the latest 1
    c = h.counters()
    assert c["lookahead"] == 1 and c["late"] == c["failed"] == c["stale"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_auto_lookahead_covers_several_steps_for_a_reply_that_comes_late(servers, mode):
    """The auto look-ahead holds four more steps' worth (4(K+1)): a proposal drafts the step
    after next and the ones after that too, so a reply that arrives a step late (a round trip
    longer than a step) still finds the target on its path. With one step's worth (K+1, a
    9-token proposal) the third step below has to ask."""

    def period(n: int, count: int) -> list[int]:  # REPETITIVE goes on 1 2 3 4 1 2 ...
        return [(n + j) % 4 + 1 for j in range(count)]

    server = servers(max_draft_len=32)  # the drafter's default: room for K + 4(K+1) = 24
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    short = servers.harness(f"grpc://{server.address}", mode=mode, lookahead=5)
    store = server.engine.store
    a, b = make_request("a", REPETITIVE), make_request("b", REPETITIVE)
    assert h.step([a]) == short.step([b]) == [[3, 4, 1, 2]]
    for _ in range(3):  # every draft accepted, each bonus token the proposal's next one
        a.output_ids += period(a.num_tokens, 5)
        b.output_ids += period(b.num_tokens, 5)
        assert h.step([a]) == short.step([b]) == [period(a.num_tokens, 4)]
    assert store.get("a").tokens == REPETITIVE  # never asked again: the drafter heard nothing
    assert h.counters()["lookahead"] == 3
    # The 9-token proposal ran out at the third step, which asked (20 tokens held); the
    # fourth drew from that reply's look-ahead.
    assert store.get("b").tokens == b.token_ids[:20]
    assert short.counters()["lookahead"] == 2


@pytest.mark.parametrize("mode", MODES)
def test_lookahead_follows_a_request_whose_drafts_keep_being_accepted(servers, mode):
    """A repetitive sequence accepted step after step, the drafter answering in 20 ms: each
    step asks the moment the previous one committed (`submit`) and goes on at once, drafting
    from the look-ahead of the proposal kept from the step before, never waiting for the
    drafter; the reply arrives during the "forward" (a sleep here) and is kept for the next
    step. The drafter still receives every committed token."""
    server = servers(max_draft_len=16, delay_ms=20)
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    a = make_request("a", REPETITIVE)
    period = [1, 2, 3, 4]
    drafts = h.step([a])
    for _ in range(12):
        assert len(drafts[0]) == 4
        committed = drafts[0] + [period[(a.num_tokens + 4) % 4]]  # all accepted + bonus
        assert committed == [period[(a.num_tokens + j) % 4] for j in range(5)]
        a.output_ids += committed
        h.drafter.submit([a])
        drafts = h.step([a])  # at once: the submit's reply is still on its way
        # The step's "forward", during which the reply arrives: wait for it rather than for a
        # fixed time (a loaded machine may take longer than 20 ms to deliver it).
        wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the submit's reply")
    assert drafts == [[period[(a.num_tokens + j) % 4] for j in range(4)]]
    c = h.counters()
    # Every step drafted from a look-ahead (a path that never waits), none went without.
    assert c["lookahead"] == 12 and c["late"] == c["failed"] == 0
    h.drafter.submit([a])
    wait_until(
        lambda: server.engine.store.get("a").tokens == a.token_ids,
        timeout=10,
        what="the drafter to hold every committed token",
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_late_submit_reply_costs_one_deadline_not_a_second_question(servers, mode):
    """The drafts asked for as the last step committed (`submit`) come late: with a patience
    of the whole deadline the step waits one deadline for them and goes without drafts; it does
    not ask again and wait twice."""
    server = servers(delay_ms=300)
    h = servers.harness(f"grpc://{server.address}", mode=mode, deadline_ms=100, patience_ms=100)
    a = make_request("a", REPETITIVE)
    assert h.step([a]) == [[]]  # late
    time.sleep(0.4)  # its reply arrives (and is dropped)
    a.output_ids += [3]
    h.drafter.submit([a])
    t0 = time.monotonic()
    assert h.step([a]) == [[]]
    assert time.monotonic() - t0 < 0.19  # one 100 ms deadline, not two
    assert h.counters()["late"] == 2


def test_a_proposal_from_an_older_prefix_never_replaces_a_newer_one():
    """Replies can arrive out of order (unary calls): the proposal kept for a request is the
    one made from the longest prefix."""
    sessions = RemoteSessions()
    sessions.synced["a"] = 12
    sessions.keep("a", 12, [5, 6], None, asked=2)
    sessions.keep("a", 10, [7, 8], None, asked=2)
    assert sessions.runs["a"].anchor == 12 and sessions.runs["a"].tokens == [5, 6]
    sessions.keep("gone", 3, [1], None, asked=1)  # not held: freed meanwhile
    assert "gone" not in sessions.runs


def test_a_pipelined_step_drafts_past_the_step_in_flight_as_the_proposal_goes():
    """A pipelined step is staged while the step before is unread (its token `PENDING`, its
    drafts `drafts_in_flight`): its drafts continue the kept proposal past that step as far
    as the step's drafts agree with it, then past the proposal's next token (the bonus it
    foresees). Too short a proposal, or one the committed tokens left, drafts nothing."""
    sessions = RemoteSessions()
    req = make_request("a", [1, 2, 3], k=3)
    sessions.synced["a"] = 3
    sessions.keep("a", 3, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], None, asked=10)
    req.output_ids = [PENDING]
    req.drafts_in_flight = [10, 11, 12]  # all as proposed: 13 is the bonus foreseen
    assert sessions.drafts_from_run(req, peek=True)[0] == [14, 15, 16]
    req.drafts_in_flight = [10, 99, 12]  # it leaves the proposal at the second: 11 the bonus
    assert sessions.drafts_from_run(req, peek=True)[0] == [12, 13, 14]
    req.drafts_in_flight = []  # a 1-token row in flight: 10 the bonus
    assert sessions.drafts_from_run(req, peek=True)[:2] == ([11, 12, 13], None)
    # Committed since the proposal (10, 11), then a row in flight that drafted 12..14.
    req.output_ids = [10, 11, PENDING]
    req.drafts_in_flight = [12, 13, 14]
    assert sessions.drafts_from_run(req, peek=True)[0] == [16, 17, 18]
    req.drafts_in_flight = [12, 13, 14, 15, 16, 17]  # past the proposal's end: ask again
    assert sessions.drafts_from_run(req, peek=True) is None
    # Outside pipelined steps the placeholder is just a token the proposal did not foresee.
    req.drafts_in_flight = None
    assert sessions.drafts_from_run(req, peek=True) is None
    req.output_ids = [10, 7, PENDING]  # the target left the proposal: dropped
    req.drafts_in_flight = []
    assert sessions.drafts_from_run(req) is None and "a" not in sessions.runs


def test_a_pipelined_steps_hypothesis_is_counted_once_the_step_in_flight_is_read():
    """Each pipelined step staged from a kept proposal assumes the step in flight's outcome;
    the request's next staging (that step read by then) counts the assumption held or
    failed: exactly the proposal's tokens up to the bonus it foresaw, or anything else. A
    peek counts nothing; a request not staged right after goes uncounted."""
    sessions = RemoteSessions()
    req = make_request("a", [1, 2, 3], k=2)
    sessions.synced["a"] = 3
    sessions.keep("a", 3, list(range(10, 30)), None, asked=20)

    def counts():
        return sessions.hypotheses_held, sessions.hypotheses_failed

    req.output_ids, req.drafts_in_flight = [PENDING], [10, 11]
    assert sessions.drafts_from_run(req, peek=True)[0] == [13, 14]
    assert not sessions.hypotheses  # a peek assumes nothing
    assert sessions.drafts_from_run(req)[0] == [13, 14]  # assumes: 10, 11 accepted, 12 bonus
    # That step committed as assumed; the next (drafts 13, 14) is in flight.
    req.output_ids = [10, 11, 12, PENDING]
    req.stats.record(2, 2)
    req.drafts_in_flight = [13, 14]
    assert sessions.drafts_from_run(req)[0] == [16, 17]
    assert counts() == (1, 0)
    # It accepted 13 only, and its bonus was not the proposal's 15.
    req.output_ids = [10, 11, 12, 13, 99, PENDING]
    req.stats.record(2, 1)
    req.drafts_in_flight = []
    assert sessions.drafts_from_run(req) is None  # the target left the proposal
    assert counts() == (1, 1)
    # A new proposal; its hypothesis is followed by two steps before the next staging.
    sessions.keep("a", 8, list(range(40, 60)), None, asked=20)
    req.output_ids = [10, 11, 12, 13, 99, PENDING]
    req.drafts_in_flight = []
    assert sessions.drafts_from_run(req)[0] == [41, 42]
    req.output_ids = [10, 11, 12, 13, 99, 40, 41, PENDING]
    req.stats.record(0, 0)
    req.stats.record(1, 1)
    req.drafts_in_flight = []
    sessions.drafts_from_run(req)
    assert counts() == (1, 1)  # not knowable: uncounted
    sessions.free(req)
    assert not sessions.hypotheses


# -- fail-open, reconnect, resync -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_killed_drafter_fails_open_then_reconnects_and_resyncs(servers, mode):
    port = free_port()
    server = servers(port=port)
    h = servers.harness(f"grpc://127.0.0.1:{port}", mode=mode, deadline_ms=1000)
    a, b = make_request("a", REPETITIVE), make_request("b", [9, 8, 9, 8])
    assert h.step([a, b]) == [[3, 4, 1, 2], [9, 8, 9, 8]]

    server.stop(None)  # killed mid-use: sessions gone
    # One token committed each: the kept proposals no longer hold a full next draft, so the
    # steps must ask the (dead) drafter.
    a.output_ids += [3]
    b.output_ids += [9]
    t0 = time.monotonic()
    assert h.step([a, b]) == [[], []]
    assert h.step([a, b]) == [[], []]
    assert time.monotonic() - t0 < 5  # failing fast, never hanging on the dead drafter
    assert h.counters()["failed"] >= 1

    a.output_ids += [4]
    restarted = servers(port=port)
    # The background reconnect finds it; the step after resends full prefixes (base_len 0).
    wait_until(lambda: h.step([a, b])[0] == [1, 2, 3, 4], timeout=15, what="drafts to resume")
    assert restarted.engine.store.get("a").tokens == a.token_ids
    assert h.counters()["reconnects"] >= 2


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_right_after_a_reconnect_is_reconnected_too(servers, mode, monkeypatch):
    """The connection fails again the moment the background reconnect has marked it up (a
    fresh stream that breaks at once, a unary call that fails): that failure must start a
    new reconnect, not find the old loop still flagged as running and leave the connection
    down for good."""
    from specwire.target_service.drafters.remote_connection import RemoteConnection

    server = servers()
    h = servers.harness(f"grpc://127.0.0.1:{server.port}", mode=mode, deadline_ms=1000)
    conn = h.drafter.connection
    connect = RemoteConnection.connect

    def connect_then_fail(self, *args, **kw):
        connect(self, *args, **kw)
        if self.connections == 2:  # the first reconnect: fail again, right away
            self.disconnect("failed again at once")

    monkeypatch.setattr(RemoteConnection, "connect", connect_then_fail)
    conn.disconnect("first failure")
    wait_until(lambda: conn.connections >= 3, timeout=10, what="a second reconnect")
    with conn.cv:
        assert conn.connected
    a = make_request("a", REPETITIVE)
    wait_until(lambda: h.step([a])[0] == [3, 4, 1, 2], timeout=10, what="drafts after it")


# A drafter service in its own process, so the test can SIGKILL it (no graceful goodbye).
SERVE_NGRAM = (
    "import sys; from specwire.drafter_service.config import DrafterServiceConfig as C; "
    "from specwire.drafter_service.server import serve; "
    "s = serve(C(host='127.0.0.1', port=int(sys.argv[1]), max_draft_len=4)); "
    "print('drafter ready', flush=True); s.wait()"
)


def test_sigkilled_drafter_process_fails_open_and_drafts_resume_after_restart():
    port = free_port()
    cmd = [sys.executable, "-c", SERVE_NGRAM, str(port)]
    proc, _ = start_service(cmd, None, "drafter ready", timeout=60)
    h = Harness(f"grpc://127.0.0.1:{port}", deadline_ms=1000)
    try:
        a = make_request("a", REPETITIVE)
        assert h.step([a]) == [[3, 4, 1, 2]]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        a.output_ids += [3]  # the kept proposal no longer holds a full draft: ask the drafter
        wait_until(lambda: h.step([a]) == [[]] and h.counters()["failed"] > 0, timeout=10)
        a.output_ids += [4]
        proc, _ = start_service(cmd, None, "drafter ready", timeout=60)
        wait_until(lambda: h.step([a]) == [[1, 2, 3, 4]], timeout=15, what="drafts to resume")
        assert h.counters()["reconnects"] >= 2
    finally:
        h.drafter.close()
        stop_service(proc)


def test_session_lost_on_the_drafter_is_resynced(servers):
    server = servers()
    h = servers.harness(f"grpc://{server.address}")
    a = make_request("a", REPETITIVE)
    assert h.step([a]) == [[3, 4, 1, 2]]
    server.engine.store.finish("a")  # e.g. expired on the drafter
    a.output_ids += [3]
    assert h.step([a]) == [[]]  # drafter answers resync
    assert h.counters()["resynced"] == 1
    assert h.drafter.spec_resource_manager.synced_len("a") == 0
    assert h.step([a]) == [[4, 1, 2, 3]]  # full prefix went out, drafts resume


# -- deadlines --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_slow_drafter_is_late_and_the_step_does_not_wait(servers, mode):
    server = servers(delay_ms=1500)
    h = servers.harness(f"grpc://{server.address}", mode=mode, deadline_ms=50)
    a = make_request("a", REPETITIVE)
    for _ in range(2):  # stream: the 2nd step sends nothing while the 1st is unanswered
        t0 = time.monotonic()
        assert h.step([a]) == [[]]
        assert time.monotonic() - t0 < 1.0  # generous bound; timings live in bench/
    assert h.counters()["late"] == 2 and h.counters()["failed"] == 0


def test_late_reply_is_never_applied_to_a_newer_step(servers):
    class SlowFirst(drafter_pb2_grpc.DrafterServiceServicer):
        def DraftStream(self, request_iterator, context):
            for req in request_iterator:
                first = req.step == 1
                if first:
                    time.sleep(0.4)
                yield drafter_pb2.DraftStreamResponse(
                    step=req.step,
                    drafts=[
                        drafter_pb2.SequenceDraft(
                            request_id=s.request_id,
                            base_len=s.base_len + len(s.new_tokens),
                            tokens=[7, 7, 7] if first else [1],
                        )
                        for s in req.sequences
                    ],
                )

    server, port = custom_server(SlowFirst())
    try:
        h = Harness(f"127.0.0.1:{port}", deadline_ms=100)
        a = make_request("a", REPETITIVE)
        assert h.step([a]) == [[]]
        # The late reply for step 1 arrives while nobody waits (its stream slot frees).
        wait_until(lambda: h.drafter.connection.inflight == 0, timeout=10, what="step 1's reply")
        assert h.step([a]) == [[1]]
        assert h.counters()["late"] == 1
        h.drafter.close()
    finally:
        server.stop(None)


def test_silent_stream_is_dropped_and_reopened():
    class HangsFirstStream(drafter_pb2_grpc.DrafterServiceServicer):
        streams = 0

        def DraftStream(self, request_iterator, context):
            HangsFirstStream.streams += 1
            for req in request_iterator:
                if HangsFirstStream.streams == 1:
                    continue  # reads, never answers: a wedged drafter
                yield drafter_pb2.DraftStreamResponse(
                    step=req.step,
                    drafts=[
                        drafter_pb2.SequenceDraft(
                            request_id=s.request_id,
                            base_len=s.base_len + len(s.new_tokens),
                            tokens=[2] if s.base_len == 0 else [],  # proves the full resend
                        )
                        for s in req.sequences
                    ],
                )

    server, port = custom_server(HangsFirstStream())
    h = Harness(f"127.0.0.1:{port}", deadline_ms=20)  # stall_s = max(1 s, 20 x deadline)
    try:
        a = make_request("a", REPETITIVE)
        wait_until(lambda: h.step([a]) == [[2]], timeout=10, interval=0.05, what="a new stream")
        c = h.counters()
        assert c["late"] >= 1 and c["failed"] >= 1 and c["reconnects"] >= 2
    finally:
        h.drafter.close()
        server.stop(None)


def test_a_stream_that_fails_before_it_is_registered_is_reopened(monkeypatch):
    """A drafter that fails every stream at once, and a reader that finishes before the
    connection has registered its stream (forced here: the call waits for its reader): the
    connection must not stay marked up on a dead stream until the stall check."""
    from specwire.target_service.drafters import remote_channel

    class FailsStreams(drafter_pb2_grpc.DrafterServiceServicer):
        def DraftStream(self, request_iterator, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "not today")

    init = remote_channel.DraftStreamCall.__init__

    def init_then_wait_for_the_reader(self, stub, read):
        done = threading.Event()

        def read_then_tell(stream, call):
            try:
                read(stream, call)
            finally:
                done.set()

        init(self, stub, read_then_tell)
        done.wait(5)

    monkeypatch.setattr(remote_channel.DraftStreamCall, "__init__", init_then_wait_for_the_reader)
    server, port = custom_server(FailsStreams())
    h = Harness(f"127.0.0.1:{port}")
    try:
        conn = h.drafter.connection
        wait_until(lambda: conn.connections >= 2, timeout=10, what="the dead stream reopened")
    finally:
        h.drafter.close()
        server.stop(None)


# -- malformed replies ------------------------------------------------------------------------


class Malformed(drafter_pb2_grpc.DrafterServiceServicer):
    """Answers each step with one of everything that can be wrong."""

    def Draft(self, request, context):
        n = {s.request_id: s.base_len + len(s.new_tokens) for s in request.sequences}
        d = drafter_pb2.SequenceDraft
        dist = drafter_pb2.TokenDistribution(ids=[5, 6], probs=[0.75, 0.25])
        return drafter_pb2.DraftResponse(
            step=request.step,
            drafts=[
                d(request_id="nobody", base_len=3, tokens=[1]),  # unknown request
                d(request_id="a", base_len=n["a"] - 1, tokens=[1, 2]),  # stale
                d(request_id="b", base_len=n["b"], tokens=[10**6, 5], probs=[dist]),  # junk ids
                d(request_id="b", base_len=n["b"], tokens=[3]),  # duplicate
                d(request_id="c", base_len=n["c"], resync=True),
                d(request_id="e", base_len=n["e"], tokens=[5], probs=[dist]),
            ],
        )

    def DraftStream(self, request_iterator, context):
        for req in request_iterator:
            reply = self.Draft(req, context)
            yield drafter_pb2.DraftStreamResponse.FromString(reply.SerializeToString())


@pytest.mark.parametrize("mode", GRPC_MODES)
def test_malformed_replies_are_counted_and_dropped(mode):
    server, port = custom_server(Malformed())
    try:
        h = Harness(f"127.0.0.1:{port}", mode=mode)
        reqs = [make_request(rid, [1, 2, 3]) for rid in "abcde"]
        drafts = h.step(reqs)
        # Junk ids pass through: the executor refuses them (and counts them), not the drafter.
        assert drafts == [[], [10**6, 5], [], [], [5]]
        assert reqs[1].draft_probs is None  # probs of the wrong length are dropped
        assert reqs[4].draft_probs == [([5, 6], [0.75, 0.25])]
        c = h.counters()
        assert (c["unknown_request"], c["stale"], c["resynced"]) == (1, 2, 1)
        assert c["late"] == c["failed"] == 0
        h.drafter.close()
    finally:
        server.stop(None)


class SendsBranchesWithDrafts(drafter_pb2_grpc.DrafterServiceServicer):
    """A drafter written before `branches_later`: it offers branches and always sends them
    with its drafts, in one response."""

    def __init__(self) -> None:
        self.later: list[bool] = []  # what each question asked

    def GetInfo(self, request, context):
        caps = ["stream", "branches"]
        return drafter_pb2.GetInfoResponse(protocol_version=1, name="old", capabilities=caps)

    def Draft(self, request, context):
        self.later.append(request.branches_later)
        if len(self.later) > 1:
            time.sleep(0.2)  # later questions answer late: a step that does not wait has
            # only the proposals it holds
        out = drafter_pb2.DraftResponse(step=request.step)
        for s in request.sequences:
            if not s.finished:
                d = out.drafts.add(request_id=s.request_id, base_len=s.base_len + len(s.new_tokens))
                d.tokens.extend([5, 6, 9, 1, 2, 5, 6, 9, 1][: s.max_draft_tokens])
                if s.max_branches:
                    d.branches.add(position=0, token=3, tokens=[4, 9, 1, 2])
        return out

    def DraftStream(self, request_iterator, context):
        for req in request_iterator:
            reply = self.Draft(req, context)
            yield drafter_pb2.DraftStreamResponse.FromString(reply.SerializeToString())


@pytest.mark.parametrize("mode", GRPC_MODES)
def test_a_drafter_that_sends_branches_with_its_drafts_is_still_served(mode):
    """A stream asks for the branches after the drafts (`branches_later`); a drafter that
    ignores that and sends them in the drafts' reply is used as before, and the target does
    not keep waiting for branches that never come: a later step's drafts forget them."""
    old = SendsBranchesWithDrafts()
    server, port = custom_server(old)
    try:
        h = Harness(f"127.0.0.1:{port}", mode=mode, patience_ms=0)
        a = make_request("a", [1, 2, 3])
        assert h.step([a]) == [[5, 6, 9, 1]]
        stream = mode != "unary"
        assert old.later == [stream]  # (one response per unary call: never asked)
        assert h.drafter.sessions.runs["a"].branches  # with the drafts
        a.output_ids += [3]  # the first draft rejected: the branch drafts the next step
        h.drafter.submit([a])
        assert h.step([a]) == [[4, 9, 1, 2]]
        wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the submit's reply")
        assert h.counters()["branched"] == 1 and old.later[-1] is stream
        # Nine new sequences ask for no branches (auto): once that answer is in, no branch of
        # any earlier question is still awaited.
        h.step([make_request(f"r{i}", [1, 2, 3]) for i in range(9)])
        assert old.later[-1] is False and not h.drafter.connection.branches_due
        h.drafter.close()
    finally:
        server.stop(None)


class _Info(drafter_pb2_grpc.DrafterServiceServicer):
    def GetInfo(self, request, context):
        return drafter_pb2.GetInfoResponse(
            protocol_version=1, name="custom", capabilities=["stream"]
        )


def custom_server(servicer) -> tuple[grpc.Server, int]:
    """A raw gRPC server around a hand-written servicer (GetInfo defaults to a valid one)."""
    if type(servicer).GetInfo is drafter_pb2_grpc.DrafterServiceServicer.GetInfo:
        servicer.GetInfo = _Info().GetInfo
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_close_stops_the_reader_thread(servers):
    server = servers()
    h = Harness(f"grpc://{server.address}")
    h.step([make_request("a", REPETITIVE)])
    h.drafter.close()
    wait_until(
        lambda: not any(t.name.startswith("drafter-") for t in threading.enumerate()),
        timeout=5,
        what="drafter threads to stop",
    )
