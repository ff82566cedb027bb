"""Two questions in flight on the remote drafter's stream (`--drafter-max-inflight`, default
2; 1 is the old one at a time): a step that commits while the previous question is unanswered
asks again instead of asking nothing, so a reply a step late still leaves a newer one on the
way. Against real drafter services on loopback; the executor-level test (lossless) is in
test_remote_e2e.py."""

from __future__ import annotations

import pytest
from procs import wait_until
from remote_harness import REPETITIVE, make_request, reply_kept

from specwire.common.errors import UserError
from specwire.target_service.config import TargetConfig
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig


def count_sends(conn) -> list[int]:
    """The steps of every message the connection sends on its stream, from now on."""
    sent, send = [], conn.send

    def counted(msg, awaited=True):
        sent.append(msg.step)
        return send(msg, awaited)

    conn.send = counted
    return sent


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_a_commit_asks_again_while_the_previous_question_is_unanswered(servers, max_inflight):
    """A drafter 100 ms away, a step that never waits (patience 0). The step after a question
    goes without; its commit asks a second question only with max_inflight 2 (with 1 it asks
    nothing and its tokens ride on the next message). The stream answers both in order; the
    second reply, made from everything committed, drafts the next step unasked; with one question
    that step must ask (and wait)."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(f"grpc://{server.address}", patience_ms=0, max_inflight=max_inflight)
    conn, store = h.drafter.connection, server.engine.store
    sent = count_sends(conn)
    a = make_request("a", REPETITIVE)  # 1 2 3 4 1 2 3 4 1 2
    assert h.step([a]) == [[3, 4, 1, 2]]  # no proposal yet: asked and waited for
    a.output_ids += [3, 4, 1, 2, 9]  # all accepted, then a token nobody foresaw
    h.drafter.submit([a])  # question 1
    assert h.step([a]) == [[]]  # went without: the reply is 100 ms away
    a.output_ids += [1]
    h.drafter.submit([a])  # question 2, with max_inflight 2 only
    assert conn.inflight == max_inflight and len(sent) == 1 + max_inflight
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the replies")
    c = h.counters()
    assert c["prefetched"] == max_inflight and c["late"] == c["failed"] == c["stale"] == 0
    if max_inflight == 2:
        # The drafter holds everything committed; the newest proposal starts where the
        # request is now and drafts this step unasked (after "... 2 9 1": the latest earlier
        # "1" was followed by "2 9 1 2").
        assert store.get("a").tokens == a.token_ids
        assert h.step([a]) == [[2, 9, 1, 2]]
        assert len(sent) == 3  # no message went out for it
    else:
        # The one reply answers for the prefix before the "1"; it proposed nothing after the
        # unforeseen 9, so this step asks afresh and waits for a drafter 100 ms away.
        assert len(store.get("a").tokens) == len(a.token_ids) - 1
        assert h.step([a]) == [[2, 9, 1, 2]]
        assert store.get("a").tokens == a.token_ids and len(sent) == 3
    assert conn.inflight == 0


def test_unary_calls_keep_one_question_at_a_time(servers):
    """Unary calls are answered side by side, not in order: max_inflight applies to the
    stream only."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(f"grpc://{server.address}", mode="unary", patience_ms=0, max_inflight=2)
    assert h.drafter.max_inflight == 1
    a = make_request("a", REPETITIVE)
    h.step([a])
    a.output_ids += [3, 4, 1, 2, 9]
    h.drafter.submit([a])
    h.step([a])
    a.output_ids += [1]
    h.drafter.submit([a])  # the first call is unanswered: nothing goes out
    wait_until(lambda: reply_kept(h.drafter), timeout=10, what="the reply")
    assert len(server.engine.store.get("a").tokens) == len(a.token_ids) - 1


def test_max_inflight_must_be_between_one_and_four():
    for bad in (0, 5):
        with pytest.raises(UserError, match="drafter max in flight must be between 1 and 4"):
            RemoteDrafterConfig("h:1", max_inflight=bad)
        with pytest.raises(UserError, match="--drafter-max-inflight must be between 1 and 4"):
            TargetConfig(drafter_max_inflight=bad)
