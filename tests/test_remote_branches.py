"""Branches: the other ways a sequence may go, which a remote drafter sends next to its proposal
(drafter.proto `Branch`), so a step that rejects a draft has the next step's drafts at once
instead of a round trip later. The n-gram index's alternatives, the target's use of a kept
branch (`RemoteSessions.drafts_from_run`), what the target asks for, and what the drafter
service lets through; lossless end to end in test_remote_e2e.py."""

from __future__ import annotations

import time

import grpc
import pytest
from remote_harness import MODES, make_request

from specwire.common.drafting import Branch, SessionDrafter
from specwire.common.errors import UserError
from specwire.common.ngram import NGramIndex
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.target_service.config import TargetConfig
from specwire.target_service.drafters.remote_sessions import RemoteSessions

# Two earlier ways on after "1 2": "3 4 9" and "5 6 9". The suffix "9 1 2" last went on with 5.
FORKED = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]


# -- the n-gram index ------------------------------------------------------------------------


def test_alternatives_are_the_other_tokens_that_followed_the_suffix_with_what_came_after():
    ix = NGramIndex(3)
    ix.extend(FORKED)
    proposal = ix.propose(4)
    assert proposal == [5, 6, 9, 1]
    # Position 0: after "... 1 2", besides 5 (the proposal's own) "3" followed, then "4 9 1 2".
    # Positions 1-3 ("1 2 5", "2 5 6", "5 6 9"...) never went on another way.
    assert ix.alternatives(proposal, positions=4, per_position=4, horizon=9) == [
        (0, 3, [4, 9, 1, 2, 5, 6, 9, 1])
    ]
    # Position 4, past the proposal, has no token of its own: what followed "9 1" is offered,
    # continued past the end over the sequence as it would be (... 9 1 2 | 5 6 9 1 | 2):
    # the same period as the copy it follows.
    assert ix.alternatives(proposal, positions=5, per_position=4, horizon=9)[1:] == [
        (4, 2, [5, 6, 9, 1])
    ]
    # The horizon bounds each branch: at position p, at most horizon - p - 1 tokens.
    assert ix.alternatives(proposal, 5, 4, horizon=4) == [(0, 3, [4, 9, 1])]
    assert ix.alternatives(proposal, positions=0, per_position=4, horizon=9) == []
    assert ix.alternatives(proposal, 5, per_position=0, horizon=9) == []


def test_alternatives_at_later_positions_longest_ngram_first_and_capped_per_position():
    ix = NGramIndex(3)
    ix.extend([7, 1, 8, 7, 1, 5, 7, 1, 6, 7])
    proposal = ix.propose(3)  # "7" last went on with "1 6 7"
    assert proposal == [1, 6, 7]
    # Position 1 ("7 1"): 6 is the proposal's; 5 then 8 (latest first) are the others.
    found = ix.alternatives(proposal, positions=2, per_position=4, horizon=3)
    assert found == [(1, 5, [7]), (1, 8, [7])]
    assert ix.alternatives(proposal, positions=2, per_position=1, horizon=5) == [(1, 5, [7, 1, 6])]


# -- the target's kept runs --------------------------------------------------------------------


def _sessions_with_run(prompt: list[int], tokens: list[int], branches, asked: int = 9):
    sessions = RemoteSessions()
    req = make_request("a", prompt)
    sessions.synced["a"] = req.num_tokens
    sessions.keep("a", req.num_tokens, tokens, None, asked=asked, branches=branches)
    return sessions, req


def test_a_rejected_draft_continues_from_the_branch_that_foresaw_it():
    branches = [Branch(0, 3, [4, 9, 1, 2, 5, 6, 9, 1]), Branch(2, 8, [8] * 20)]
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1, 2, 5, 6, 9, 1], branches)
    assert sessions.drafts_from_run(req) == ([5, 6, 9, 1], None, "asked")
    req.output_ids += [3]  # the first draft rejected; the target's own token was 3
    assert sessions.drafts_from_run(req) == ([4, 9, 1, 2], None, "branch")
    assert sessions.runs["a"].anchor == len(FORKED) + 1  # the branch is the run now
    req.output_ids += [4, 9, 1]  # three more tokens, as the branch had them
    assert sessions.drafts_from_run(req) == ([2, 5, 6, 9], None, "lookahead")
    req.output_ids += [2, 5]  # less is left than a step may verify: ask for more
    assert sessions.drafts_from_run(req) is None


def test_peeking_at_a_run_finds_the_same_drafts_and_changes_nothing():
    """`peek=True` (the remote drafter's check at a commit whether the next step needs a
    reply) answers as the step's own call will, yet neither adopts a branch nor drops a run the
    target left, so the step's call still does both (and counts them)."""
    branches = [Branch(0, 3, [4, 9, 1, 2, 5, 6, 9, 1])]
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1, 2, 5, 6, 9, 1], branches)
    kept = sessions.runs["a"]
    req.output_ids += [3]  # the branch's token
    assert sessions.drafts_from_run(req, peek=True) == ([4, 9, 1, 2], None, "branch")
    assert sessions.runs["a"] is kept  # not adopted
    assert sessions.drafts_from_run(req) == ([4, 9, 1, 2], None, "branch")
    assert sessions.runs["a"] is not kept  # adopted by the step's call
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1], [])
    req.output_ids += [7]  # a token nobody foresaw
    assert sessions.drafts_from_run(req, peek=True) is None and "a" in sessions.runs
    assert sessions.drafts_from_run(req) is None and "a" not in sessions.runs


def test_a_branch_past_the_proposal_and_an_older_reply_after_a_branch():
    sessions, req = _sessions_with_run(FORKED, [5, 6], [Branch(2, 7, [8, 8])])
    req.output_ids += [5, 6, 7]  # past the whole proposal, with the token the branch foresaw
    assert sessions.drafts_from_run(req) == ([8, 8], None, "branch")  # all it had: used
    anchor = sessions.runs["a"].anchor
    sessions.keep("a", len(FORKED), [5, 6, 9], None, asked=9)  # a reply from before the step
    assert sessions.runs["a"].anchor == anchor  # the branch, newer, stays
    # A branch that leaves no room (at the last position asked for) is never taken.
    sessions, req = _sessions_with_run(FORKED, [5, 6], [Branch(1, 7, [8])], asked=2)
    req.output_ids += [5, 7]
    assert sessions.drafts_from_run(req) is None


def test_a_branch_is_cut_to_what_was_asked_and_must_match_all_committed_since():
    branches = [Branch(2, 8, [8] * 20)]  # a drafter that sent too much: 9 - 2 - 1 = 6 kept
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1], branches)
    req.output_ids += [5, 6, 8, 8]  # two accepted, then 8 where the branch said, then its 8
    assert sessions.drafts_from_run(req) == ([8, 8, 8, 8], None, "branch")
    assert len(sessions.runs["a"].tokens) == 6
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1], branches)
    req.output_ids += [5, 6, 8, 2]  # past the branch's token the target went elsewhere
    assert sessions.drafts_from_run(req) is None and "a" not in sessions.runs
    sessions, req = _sessions_with_run(FORKED, [5, 6, 9, 1], branches)
    req.output_ids += [5, 7]  # a token no branch foresaw
    assert sessions.drafts_from_run(req) is None and "a" not in sessions.runs
    sessions.check_integrity()


# -- through a real drafter service --------------------------------------------------------------


@pytest.mark.parametrize("branches_at", ["later", "reply"])
@pytest.mark.parametrize("mode", MODES)
def test_after_a_rejection_the_next_step_drafts_at_once_from_the_reply_it_had(
    servers, mode, branches_at
):
    """The drafter answers 100 ms late and the step does not wait (patience 0): the only
    drafts it can have come from the branch the previous reply carried, or (`later`, on a
    stream) sent right after it, while the step ran on the device."""
    server = servers(max_draft_len=16, delay_ms=100)
    h = servers.harness(
        f"grpc://{server.address}", mode=mode, patience_ms=0, branches_at=branches_at
    )
    a = make_request("a", FORKED)
    assert h.step([a]) == [[5, 6, 9, 1]]  # the first question is waited for
    split = branches_at == "later" and mode != "unary"  # a unary call has one response
    # Split: the drafts came alone, and the step did not wait for the branches.
    assert bool(h.drafter.sessions.runs["a"].branches) is not split
    h.await_branches()
    assert h.drafter.sessions.runs["a"].branches  # (a reply of their own, when split)
    assert not h.drafter.connection.branches_due
    a.output_ids += [3]  # draft 5 rejected: the target's token is 3
    h.drafter.submit([a])
    assert h.step([a]) == [[4, 9, 1, 2]]
    c = h.counters()
    assert c["branched"] == 1 and c["late"] == c["failed"] == c["stale"] == 0


class RecordingDrafter(SessionDrafter):
    """An n-gram drafter that records what the target asks of its branches, and offers
    malformed ones when told to."""

    name = "recording"
    capabilities = ("branches",)

    def __init__(self, junk: bool = False) -> None:
        self.asked: list[tuple[int, int, int]] = []  # (positions, per_position, horizon)
        self.junk = junk

    def new_state(self) -> NGramIndex:
        return NGramIndex(3)

    def extend(self, state, tokens):
        state.extend(tokens)

    def propose(self, state, budget, want_probs=False):
        if self.junk and state.tokens[0] == 99:
            return ([1 << 40], None)  # not a token id the wire can carry
        return (state.propose(budget), None)

    def alternatives(self, state, proposal, positions, per_position, horizon):
        self.asked.append((positions, per_position, horizon))
        if not self.junk:
            return state.alternatives(proposal, positions, per_position, horizon)
        return [
            (0, proposal[0], [1]),  # the proposal's own token: not another way
            (positions, 7, [1]),  # a position not asked for
            (len(proposal), 7, [1]),  # past the proposal's budget: no room for drafts
            (0, "x", [1]),  # not a token
            7,  # not a branch at all
            (0.5, 7, [1]),  # not a position
            (0, 1 << 40, [1]),  # not a token id the wire can carry
            (0, 8, []),  # nothing to draft from
            *((1, 10 + i, [2] * 50) for i in range(per_position + 3)),  # too many, too long
            (1, 10, [3]),  # said already
        ]


def test_the_target_asks_a_drafter_that_offers_branches_while_its_messages_are_small(servers):
    rec = RecordingDrafter()
    server = servers(instance=rec, max_draft_len=16)
    h = servers.harness(f"grpc://{server.address}")
    # Auto: a drafter offering branches is asked for a look-ahead (4(K+1)), which lets a
    # branch hold a whole step's drafts.
    assert h.drafter.lookahead == 20 and h.drafter.branches == -1
    h.step([make_request("a", FORKED)])
    h.await_branches()  # (they follow the drafts: found once these are on their way)
    # Positions 0 and 1, 4 each; K + look-ahead = 24 tokens, capped at the drafter's 16.
    assert rec.asked == [(2, 4, 16)]
    h.step([make_request(f"r{i}", FORKED) for i in range(9)])  # 9 sequences: none (auto)
    h.await_branches()
    assert rec.asked == [(2, 4, 16)]
    fixed = servers.harness(f"grpc://{server.address}", branches=2, lookahead=5)
    fixed.step([make_request(f"s{i}", FORKED) for i in range(9)])
    fixed.await_branches()
    assert rec.asked[1:] == [(2, 2, 9)] * 9
    off = servers.harness(f"grpc://{server.address}", branches=0)
    off.step([make_request("t", FORKED)])
    off.await_branches()
    assert len(rec.asked) == 10
    # Nor without look-ahead enough for a branch at the second position to fill a step.
    short = servers.harness(f"grpc://{server.address}", branches=4, lookahead=1)
    assert short.drafter.branches == 0
    capped = servers(instance=RecordingDrafter(), max_draft_len=4)  # no room past K = 4
    assert servers.harness(f"grpc://{capped.address}", branches=4).drafter.branches == 0
    # A drafter that does not offer them is never asked (the model drafter has none).
    plain = servers(max_draft_len=16, drafter="model:tiny-random")
    assert servers.harness(f"grpc://{plain.address}", vocab=512, fp="").drafter.branches == 0


def test_the_drafter_service_passes_only_well_formed_branches_and_proposals(servers):
    """A plugin's malformed branches are dropped one by one; a proposal the wire cannot carry
    costs that sequence its draft, not the call."""
    server = servers(instance=RecordingDrafter(junk=True), max_draft_len=16)
    update = drafter_pb2.SequenceUpdate(
        request_id="a", new_tokens=FORKED, max_draft_tokens=6, max_branches=2, branch_positions=7
    )
    bad = drafter_pb2.SequenceUpdate(request_id="b", new_tokens=[99, 1, 99], max_draft_tokens=6)
    with grpc.insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        reply = stub.Draft(drafter_pb2.DraftRequest(step=1, sequences=[update, bad]))
    draft, dropped = sorted(reply.drafts, key=lambda d: d.request_id)
    assert list(draft.tokens) == [5, 6, 9, 1, 2, 5]
    got = [(b.position, b.token, list(b.tokens)) for b in draft.branches]
    assert got == [(1, 10, [2] * 4), (1, 11, [2] * 4)]  # 2 per position, 6 - 1 - 1 tokens
    assert dropped.request_id == "b" and list(dropped.tokens) == [] and not dropped.branches


@pytest.mark.parametrize("mode", ["stream", "relay", "socket"])
def test_branches_that_come_with_their_drafts_reply_attach_to_its_proposal(servers, mode):
    """A question asked at a commit whose drafts and branches have both arrived before the
    target looks (one read may bring both): the drafts' proposal is kept first, then its
    branches attach to it."""
    server = servers(max_draft_len=16)
    h = servers.harness(f"grpc://{server.address}", mode=mode)
    a = make_request("a", FORKED)
    h.drafter.submit([a])
    time.sleep(0.3)  # both responses are on their way back, none read yet
    h.await_branches()
    run = h.drafter.sessions.runs["a"]
    assert run.anchor == len(FORKED) and run.tokens[:4] == [5, 6, 9, 1]
    assert [(b.position, b.token) for b in run.branches] == [(0, 3)]
    assert h.drafter.unanswered() == 0 and not h.drafter.connection.branches_due


def test_a_stream_asked_for_branches_later_sends_the_drafts_then_the_same_branches(servers):
    """drafter.proto `branches_later`: the first response is the drafts alone, the second
    (`branches_only`, same step) the branches an inline answer would have carried."""
    server = servers(max_draft_len=16)
    update = drafter_pb2.SequenceUpdate(
        request_id="a", new_tokens=FORKED, max_draft_tokens=9, max_branches=4, branch_positions=2
    )
    inline = drafter_pb2.SequenceUpdate(
        request_id="b", new_tokens=FORKED, max_draft_tokens=9, max_branches=4, branch_positions=2
    )
    questions = [
        drafter_pb2.DraftStreamRequest(step=1, sequences=[update], branches_later=True),
        drafter_pb2.DraftStreamRequest(step=2, sequences=[inline]),
    ]
    with grpc.insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        first, second, third = list(stub.DraftStream(iter(questions)))
    assert (first.step, first.branches_only, second.step, second.branches_only) == (1, 0, 1, 1)
    (draft,) = first.drafts
    assert list(draft.tokens) == [5, 6, 9, 1, 2, 5, 6, 9, 1] and not draft.branches
    (later,) = second.drafts
    assert (later.request_id, later.base_len, list(later.tokens)) == ("a", len(FORKED), [])
    assert not third.branches_only and third.drafts[0].branches  # asked inline: one response
    assert list(later.branches) == list(third.drafts[0].branches)
    assert [(b.position, b.token) for b in later.branches] == [(0, 3)]


def test_drafter_branches_flag_is_checked():
    with pytest.raises(UserError, match="--drafter-branches must be between 0 and 16"):
        TargetConfig(drafter_branches=17)
    with pytest.raises(UserError, match="--drafter-branches"):
        TargetConfig(drafter_branches=-2)
    with pytest.raises(UserError, match="--drafter-branches-at must be one of later, reply"):
        TargetConfig(drafter_branches_at="soon")


class GarbageDrafter(SessionDrafter):
    """Answers by the sequence's first token: 1 a good draft, 2 an infinite id, 3 tokens that
    raise while read, 4 malformed distributions, 5 branches that raise while read."""

    name = "garbage"
    capabilities = ("branches", "draft_probs")

    def new_state(self) -> list[int]:
        return []

    def extend(self, state, tokens):
        state.extend(tokens)

    def propose(self, state, budget, want_probs=False):
        def raising():
            yield 1
            raise RuntimeError("broken iterator")

        kind = state[0]
        if kind == 2:
            return ([float("inf")], None)
        if kind == 3:
            return (raising(), None)
        if kind == 4:
            return ([1, 2], [([1, 2], [0.5]), ("x", None)])
        return ([1, 2], [([1], [1.0]), ([2], [1.0])] if want_probs else None)

    def alternatives(self, state, proposal, positions, per_position, horizon):
        if state[0] == 5:
            return [(0, 9, [float("inf")]), (0, 8, iter([3, 4]))]
        return [(0, 7, [3])]


def test_a_drafters_garbage_costs_its_own_sequence_never_the_call(servers):
    server = servers(instance=GarbageDrafter(), max_draft_len=16)
    updates = [
        drafter_pb2.SequenceUpdate(
            request_id=f"s{kind}", new_tokens=[kind, 0], max_draft_tokens=4, max_branches=2,
            branch_positions=2,
        )
        for kind in (1, 2, 3, 4, 5)
    ]  # fmt: skip
    with grpc.insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        msg = drafter_pb2.DraftRequest(step=1, sequences=updates, want_probs=True)
        got = {d.request_id: d for d in stub.Draft(msg).drafts}
    assert list(got["s1"].tokens) == [1, 2] and len(got["s1"].probs) == 2
    assert [(b.position, b.token, list(b.tokens)) for b in got["s1"].branches] == [(0, 7, [3])]
    assert list(got["s2"].tokens) == list(got["s3"].tokens) == []  # no draft for them alone
    assert list(got["s4"].tokens) == [1, 2] and not got["s4"].probs  # point masses
    assert [(b.token, list(b.tokens)) for b in got["s5"].branches] == [(8, [3, 4])]
