"""The draft-length policy: one k per step from acceptance estimates and a step-cost table."""

from __future__ import annotations

from specwire.target_service.draft_policy import DraftLengthPolicy
from specwire.target_service.request import Request


def _req(rid: str) -> Request:
    return Request(request_id=rid, prompt_ids=[1, 2, 3], max_new_tokens=100, max_draft_len=4)


def _policy(costs: dict[int, float]) -> DraftLengthPolicy:
    p = DraftLengthPolicy(4, adaptive=True)
    p.seed_costs(costs)
    return p


def _teach(p: DraftLengthPolicy, req: Request, drafted: int, accepted: int, times: int) -> None:
    req.step_draft_cap = drafted
    for _ in range(times):
        p.observe(req, drafted, accepted)


def test_static_policy_always_drafts_the_maximum():
    p = DraftLengthPolicy(4, adaptive=False)
    assert p.step_draft_len([_req("a")]) == 4
    assert p.request_cap(_req("a"), 4) == 4


def test_drafts_when_verifying_more_tokens_is_nearly_free():
    p = _policy({1: 1.0e-3, 8: 1.01e-3, 64: 1.02e-3, 512: 1.1e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    for r in reqs:
        _teach(p, r, drafted=4, accepted=2, times=10)
    assert p.step_draft_len(reqs) == 4


def test_stops_drafting_when_tokens_are_dear_and_drafts_are_poor():
    # A compute-bound step: cost grows with tokens; drafts are almost never accepted.
    p = _policy({64: 1e-3, 128: 2e-3, 256: 4e-3, 512: 8e-3})
    reqs = [_req(f"r{i}") for i in range(64)]
    for r in reqs:
        _teach(p, r, drafted=4, accepted=0, times=10)
    assert p.step_draft_len(reqs) == 0


def test_a_request_whose_drafts_fail_stops_drafting_and_is_retried():
    p = _policy({1: 1e-3, 8: 1e-3})
    bad, good = _req("bad"), _req("good")
    _teach(p, bad, drafted=4, accepted=0, times=15)
    _teach(p, good, drafted=4, accepted=4, times=15)
    assert p.request_cap(good, 4) == 4
    assert p.request_cap(bad, 4) == 0
    _teach(p, bad, drafted=0, accepted=0, times=1)  # its 16th step: explored again
    assert p.request_cap(bad, 4) == 4


def test_costs_follow_real_steps():
    p = _policy({8: 1e-3, 64: 2e-3})
    for _ in range(50):
        p.observe_sync(rows=2, tokens=5, seconds=3e-3, device_wait=1e-3)
        p.observe_plain(tokens=5, period=1.5e-3)
    assert abs(p.sync_cost(2, 5) - 3e-3) < 1e-4  # 2 ms of host + 1 ms on the device
    assert abs(p.plain_cost(2, 5) - 1.5e-3) < 1e-4
    p.overlap = False  # a plain step that cannot overlap costs what a synchronous one does
    assert abs(p.plain_cost(2, 5) - 3e-3) < 1e-4
    # Unmeasured row counts scale from the nearest measured bucket.
    assert abs(p.sync_cost(8, 5) - (8e-3 + 1e-3)) < 1e-4


def _loaded(p: DraftLengthPolicy, rows: int, host: float, period: float) -> None:
    """Teach the policy a serving regime: synchronous steps cost `host` on the host plus the
    device time; an overlapped plain step of `rows` tokens takes `period`."""
    for _ in range(30):
        p.observe_sync(rows, rows * 3, host + 1e-3, 1e-3)
        p.observe_plain(rows, period)


def test_overlap_makes_plain_steps_win_under_load():
    """64 rows: the synchronous host work of a speculative step costs more than its drafts
    gain, while a plain step hides its host work behind the device: no drafting."""
    p = _policy({64: 1e-3, 128: 1.1e-3, 256: 1.3e-3, 512: 2e-3})
    reqs = [_req(f"r{i}") for i in range(64)]
    for r in reqs:
        for _ in range(5):  # half the steps accept one draft, half none: ~1.3 tokens a step
            _teach(p, r, drafted=4, accepted=1, times=1)
            _teach(p, r, drafted=4, accepted=0, times=1)
    _loaded(p, 64, host=4.8e-3, period=3.6e-3)
    assert p.step_draft_len(reqs) == 0
    # The same acceptance at batch 1, where host work is small: drafting pays.
    q = _policy({1: 1e-3, 2: 1.0e-3, 4: 1.0e-3, 8: 1.05e-3})
    one = [_req("solo")]
    _teach(q, one[0], drafted=4, accepted=1, times=10)
    _loaded(q, 1, host=0.35e-3, period=1.2e-3)
    assert q.step_draft_len(one) > 0


def test_new_requests_start_from_the_population_estimate():
    p = _policy({1: 1e-3, 8: 1e-3})
    for i in range(40):
        _teach(p, _req(f"old{i}"), drafted=4, accepted=0, times=5)
    fresh = _req("fresh")
    assert p._new_estimate().accept < 0.3  # the population learnt drafts fail
    # With only 0.1 of its drafts expected, even cheap drafting is not worth a sync step
    # that costs twice a plain one.
    _loaded(p, 1, host=1e-3, period=1e-3)
    assert p.step_draft_len([fresh]) == 0


def test_a_policy_that_stopped_drafting_looks_again():
    p = _policy({64: 1e-3, 512: 2e-3})
    p.explore_steps = 8
    reqs = [_req(f"r{i}") for i in range(64)]
    for r in reqs:
        _teach(p, r, drafted=4, accepted=0, times=10)
    _loaded(p, 64, host=5e-3, period=1e-3)
    ks = [p.step_draft_len(reqs) for _ in range(16)]
    assert ks.count(0) == 14 and all(k > 0 for k in ks[7::8])


def test_the_cost_of_leaving_overlapped_steps_is_paid_once():
    """A switch to speculation drains the pipeline: in plain mode a marginal gain does not pay
    for it, but the same gain keeps a policy that is already speculating where it is."""
    p = _policy({1: 1e-3, 2: 1e-3, 4: 1e-3, 8: 1e-3})
    solo = _req("solo")
    for _ in range(5):
        _teach(p, solo, drafted=4, accepted=1, times=1)
        _teach(p, solo, drafted=4, accepted=0, times=1)
    for _ in range(30):
        p.observe_sync(1, 3, 0.4e-3 + 1e-3, 1e-3)  # speculative: 1.4 ms for ~1.3 tokens
        p.observe_plain(1, 1.2e-3)  # plain: 1.2 ms a token
    p.speculating = True
    assert p.step_draft_len([solo]) > 0  # already speculating: 0.93 vs 0.83 tokens/ms
    p.speculating = False
    for _ in range(10):
        p.observe_switch(8e-3)  # a drain that costs 1 ms a step over the next 8
    assert p.step_draft_len([solo]) == 0
