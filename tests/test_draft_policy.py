"""The draft-length policy: one k per step from acceptance estimates and a step-cost table."""

from __future__ import annotations

import math

import pytest

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
    _teach(p, bad, drafted=4, accepted=0, times=p.max_misses - 1)
    assert p.request_cap(bad, 4) == 4  # not yet: lookup drafts miss for a while, then match
    _teach(p, bad, drafted=4, accepted=0, times=2)  # 17 steps, 17 misses in a row
    _teach(p, good, drafted=4, accepted=4, times=15)
    assert p.request_cap(good, 4) == 4
    assert p.request_cap(bad, 4) == 0
    _teach(p, bad, drafted=0, accepted=0, times=14)
    assert p.request_cap(bad, 4) == 0
    _teach(p, bad, drafted=0, accepted=0, times=1)  # its 32nd step: explored again
    assert p.request_cap(bad, 4) == 4
    _teach(p, bad, drafted=4, accepted=1, times=1)  # a draft accepted: it drafts again
    assert p.request_cap(bad, 4) == 4


def test_costs_follow_real_steps():
    p = _policy({8: 1e-3, 64: 2e-3})
    for _ in range(50):
        p.observe_sync(rows=2, tokens=5, seconds=3e-3, device_wait=1e-3)
    assert abs(p.sync_cost(2, 5) - 3e-3) < 1e-4  # 2 ms of host + 1 ms on the device
    # Unmeasured row counts scale from the nearest measured bucket.
    assert abs(p.sync_cost(8, 5) - (8e-3 + 1e-3)) < 1e-4


def _window(p: DraftLengthPolicy, tokens_per_s: float, rows: int = 8) -> int:
    """One measured window of the policy's current mode at `tokens_per_s` with `rows` rows;
    its length in steps."""
    for steps in range(1, p.mode_window + 1):
        if p.observe_rate(10, 10 / tokens_per_s, rows):
            return steps
    raise AssertionError("a window outlived mode_window steps")


def test_the_mode_follows_measured_rates():
    """Speculating first; then plain decoding is measured; the faster one runs, and the other
    is re-measured now and then: rarely when it is far behind (a probe window costs the gap),
    every `probe_every` windows when the two are close."""
    p = _policy({1: 1e-3, 8: 1e-3, 64: 1e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    for r in reqs:
        _teach(p, r, drafted=4, accepted=3, times=5)
    assert p.mode == "spec" and p.step_draft_len(reqs) > 0
    _window(p, 4000.0)  # speculating: 4,000 tok/s
    assert p.mode == "plain" and p.step_draft_len(reqs) == 0  # not measured yet: try it
    _window(p, 6000.0)  # plain: 6,000 tok/s (overlapped steps under load)
    modes = []
    for _ in range(4 * p.max_probe_every):
        modes.append(p.mode)
        _window(p, 6000.0 if p.mode == "plain" else 4000.0)
    # A third behind: one probe per `max_probe_every` windows (~1 % of the throughput; 3 or 4
    # in these windows, by where the first one falls: its time is set when both modes were
    # first measured, or when the winner last changed).
    assert p.probe_interval(8) == p.max_probe_every
    assert 3 <= modes.count("spec") <= 4
    modes = []
    for _ in range(4 * p.max_probe_every):
        modes.append(p.mode)
        _window(p, 6000.0 if p.mode == "plain" else 5950.0)
    # Within 1 %: probing costs next to nothing, so it is done every `probe_every` windows.
    assert p.probe_interval(8) == p.probe_every
    assert 8 <= modes.count("spec") <= 4 * p.max_probe_every // (p.probe_every + 1)  # EMA lag
    # Speculation gets faster at this load: one probe is enough to switch back.
    while p.mode != "spec":
        _window(p, 6000.0)
    _window(p, 20000.0)
    _window(p, 20000.0)
    assert p.mode == "spec" and p.rates[("spec", 8)] > p.rates[("plain", 8)]


def test_rates_are_compared_at_the_same_load():
    """One stream speculating (1,100 tok/s) is not compared with 64 streams decoding plainly
    (12,000 tok/s): at each load the mode that wins there runs."""
    p = _policy({1: 1e-3, 64: 1e-3})
    _window(p, 1100.0, rows=1)  # spec at batch 1
    _window(p, 800.0, rows=1)  # plain at batch 1
    assert p.mode == "spec"
    _window(p, 9000.0, rows=64)  # spec at batch 64: plain not measured there yet
    assert p.mode == "plain"
    _window(p, 12000.0, rows=64)
    assert p.mode == "plain"  # 12,000 > 9,000 at 64 rows
    _window(p, 800.0, rows=1)  # plain at batch 1 again: spec wins there
    assert p.mode == "spec"


def test_a_new_load_goes_by_what_other_loads_imply():
    """Plain decoding beat speculation at 16 rows and speculation beat it at 2: at 32 and 64
    rows plain runs at once, at 1 row speculation does, with no window spent measuring the
    mode the other loads rule out — until its probe is due."""
    p = _policy({1: 1e-3, 64: 1e-3})
    _window(p, 9000.0, rows=16)  # spec at 16
    _window(p, 12000.0, rows=16)  # plain at 16: wins
    assert p.mode == "plain"
    modes = []
    for _ in range(p.max_probe_every):
        modes.append(p.mode)
        _window(p, 14000.0, rows=64)
    assert modes == ["plain"] * p.max_probe_every  # spec never measured at 64 meanwhile
    assert p.mode == "spec"  # the probe, once due
    _window(p, 1000.0, rows=2)  # spec at 2 (this window's mode)
    assert p.mode == "plain"  # nothing implies a winner at 2 yet: measure plain there
    _window(p, 700.0, rows=2)
    assert p.mode == "spec"
    _window(p, 1100.0, rows=2)
    modes = []
    for _ in range(4):
        _window(p, 800.0 if p.mode == "spec" else 600.0, rows=1)
        modes.append(p.mode)
    assert modes == ["spec"] * 4  # implied by 2 rows; plain never measured at 1


def test_a_near_tie_goes_to_plain_decoding():
    """Speculation measured 3 % faster is within the noise of a window: plain decoding (which
    cannot lose to serving without a drafter) runs; 10 % faster, speculation runs."""
    p = _policy({8: 1e-3})
    _window(p, 6180.0)  # spec
    _window(p, 6000.0)  # plain
    assert p.mode == "plain"
    p = _policy({8: 1e-3})
    _window(p, 6600.0)
    _window(p, 6000.0)
    assert p.mode == "spec"


def test_probes_survive_a_load_wobbling_across_a_bucket_edge():
    """Windows averaging 5 rows (bucket 8) whose first step has 4 (bucket 4): the window start
    must not undo the probe the last window's end chose — the losing mode is still re-measured
    once per `max_probe_every` windows."""
    p = _policy({1: 1e-3, 8: 1e-3})
    four = [_req(f"r{i}") for i in range(4)]
    for r in four:
        _teach(p, r, drafted=4, accepted=3, times=5)
    _window(p, 4000.0, rows=4)  # spec at 4
    _window(p, 6000.0, rows=4)  # plain at 4: wins there
    modes = []
    for _ in range(4 * p.max_probe_every):
        p.step_draft_len(four)  # the window's first step
        modes.append(p.mode)
        rate = 6000.0 if p.mode == "plain" else 4000.0
        while not p.observe_rate(10, 10 / rate, 5):
            pass
    assert 3 <= modes[2:].count("spec") <= 5  # one probe per 32 windows (after learning)


def test_a_window_starts_in_the_mode_best_at_its_load():
    """Speculation wins with one stream, plain decoding with 64: when 64 requests arrive while
    the policy is speculating, the very next step decodes plainly (no window of the old
    load's mode), and back at one stream the next step speculates again."""
    p = _policy({1: 1e-3, 8: 1e-3, 64: 1e-3})
    _window(p, 1100.0, rows=1)  # spec at 1
    _window(p, 800.0, rows=1)  # plain at 1
    _window(p, 9000.0, rows=64)  # spec at 64
    _window(p, 12000.0, rows=64)  # plain at 64
    one = [_req("solo")]
    many = [_req(f"r{i}") for i in range(64)]
    for r in one + many:
        _teach(p, r, drafted=4, accepted=3, times=5)
    _window(p, 800.0, rows=1)  # plain at 1 again; spec wins there
    assert p.mode == "spec" and p.step_draft_len(one) > 0
    # Still at a window boundary (no step observed since): 64 rows now start the window.
    assert p.step_draft_len(many) == 0 and p.mode == "plain"
    for _ in range(p.mode_window):
        p.observe_rate(64, 64 / 12000.0, 64)
    assert p.step_draft_len(one) > 0 and p.mode == "spec"


def test_new_requests_start_from_the_population_estimate():
    """A request never seen before is judged by what drafts did for the others: after many
    requests whose drafts all failed, a fresh one is not given drafts where a policy with no
    history would give it some."""
    costs = {1: 1e-3, 2: 1.2e-3, 4: 1.4e-3, 8: 1.6e-3}
    assert _policy(costs).step_draft_len([_req("fresh")]) > 0
    p = _policy(costs)
    for i in range(40):
        _teach(p, _req(f"old{i}"), drafted=4, accepted=0, times=5)
    assert p.step_draft_len([_req("fresh")]) == 0


def test_a_losing_probe_is_a_short_window_and_a_first_look_is_whole():
    """A mode's first window at a load is whole (a few steps would misjudge it); once both
    modes have a rate there, the winner's windows are whole, and a probe of the loser ends
    after `first_window` steps when it trails by more than `early_exit` (and then moves the
    loser's rate by its share of a whole window) — but runs whole when close (a close call
    needs the whole window's precision)."""
    p = _policy({8: 1e-3})
    assert _window(p, 2000.0) == p.mode_window  # spec's first look at 8 rows
    assert p.mode == "plain"
    assert _window(p, 6000.0) == p.mode_window  # plain's first look
    assert p.mode == "plain"  # 6,000 beats 2,000
    lengths = []
    while p.mode == "plain":
        lengths.append(_window(p, 6000.0))
    assert set(lengths) == {p.mode_window}  # the winner's windows are whole
    before = p.rates[("spec", 8)]
    assert _window(p, 1000.0) == p.first_window  # the probe, a sixth of plain's rate
    assert p.mode == "plain"
    moved = (before - p.rates[("spec", 8)]) / (before - 1000.0 / 8)
    assert abs(moved - 0.5 * p.first_window / p.mode_window) < 1e-9
    while p.mode == "plain":
        _window(p, 6000.0)
    assert _window(p, 5000.0) == p.mode_window  # within early_exit of plain: measured whole


def test_only_a_probe_is_cut_short_and_only_at_its_first_window():
    """The winner's own window is never cut, however badly a stretch of it goes; a probe that
    looks fine at `first_window` steps runs whole even if it turns bad later (stopping the
    first time it looks bad would stop noisy probes at their worst and bias them down)."""
    p = _policy({8: 1e-3})
    _window(p, 2000.0)  # spec's first look
    _window(p, 6000.0)  # plain's first look: plain wins
    assert p.mode == "plain"
    steps = 0
    while not p.observe_rate(10, 10 / 1000.0, 8):  # plain, the winner, at 1,000 tok/s
        steps += 1
    assert steps + 1 == p.mode_window
    while p.mode == "plain":
        _window(p, 6000.0)
    steps = 0  # the probe: fine for `first_window` steps, then slow
    while not p.observe_rate(10, 10 / (6000.0 if steps < p.first_window else 500.0), 8):
        steps += 1
    assert steps + 1 == p.mode_window


def test_a_first_window_longer_than_the_window_is_refused():
    import pytest

    with pytest.raises(ValueError, match="first_window <= mode_window"):
        DraftLengthPolicy(4, first_window=40, mode_window=32)


def test_an_unknown_load_decodes_plainly_first_and_a_far_behind_first_look_is_cut():
    """Speculation won at one stream; 32 streams arrive, where nothing is known or implied:
    plain decoding runs first (it cannot lose to serving without a drafter), then speculation
    is probed — cut after `first_window` steps when it trails by more than `first_look_exit`
    (a synchronous step at that load costs several overlapped ones), whole when closer."""
    p = _policy({1: 1e-3, 256: 1e-3})
    one = [_req("solo")]
    many = [_req(f"r{i}") for i in range(32)]
    assert p.step_draft_len(one) > 0 and p.mode == "spec"  # the very first window: spec
    _window(p, 1100.0, rows=1)
    _window(p, 800.0, rows=1)  # plain at 1: spec wins there
    assert p.mode == "spec"
    assert p.step_draft_len(many) == 0 and p.mode == "plain"  # unknown here: plain first
    assert _window(p, 12000.0, rows=32) == p.mode_window
    assert p.mode == "spec"  # the probe of speculation at 32
    assert _window(p, 5000.0, rows=32) == p.first_window  # 58 % behind: cut short
    assert p.mode == "plain" and p.rates[("spec", 32)] < p.rates[("plain", 32)]
    q = _policy({1: 1e-3, 256: 1e-3})
    q.step_draft_len(one)
    _window(q, 1100.0, rows=1)
    _window(q, 800.0, rows=1)
    q.step_draft_len(many)
    _window(q, 12000.0, rows=32)  # plain first
    assert q.mode == "spec"
    assert _window(q, 8000.0, rows=32) == q.mode_window  # a third behind: a whole first look


def test_back_at_a_load_where_only_plain_was_measured_speculation_is_probed():
    """Plain decoding was measured at 16 rows and speculation not (the load moved on before
    the probe ran there): when a window starts at 16 again with nothing implied, speculation
    runs as a probe — one that a wide gap cuts short."""
    p = _policy({1: 1e-3, 256: 1e-3})
    one = [_req("solo")]
    p.step_draft_len(one)
    _window(p, 1100.0, rows=1)
    _window(p, 800.0, rows=1)  # spec wins at 1
    sixteen = [_req(f"r{i}") for i in range(16)]
    assert p.step_draft_len(sixteen) == 0  # plain first at 16
    _window(p, 9000.0, rows=16)
    assert p.mode == "spec"  # the probe chosen for 16 ...
    _window(p, 1100.0, rows=1)  # ... ran at one stream instead: the load moved away
    assert p.step_draft_len(one) > 0 and p.mode == "spec"
    _window(p, 1100.0, rows=1)
    assert ("spec", 16) not in p.rates and ("plain", 16) in p.rates
    assert p.step_draft_len(sixteen) > 0 and p.mode == "spec"  # back at 16: the probe
    assert _window(p, 3000.0, rows=16) == p.first_window


def test_inside_a_plain_window_every_step_is_plain_whatever_its_rows():
    """`plain_until_window_ends` lets the scheduler skip collecting rows: it holds only while
    a plain window runs, never at a window's first step (where the load may change the mode)."""
    p = _policy({1: 1e-3, 256: 1e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    assert not p.plain_until_window_ends  # spec, at the start
    _window(p, 4000.0)
    assert p.mode == "plain" and not p.plain_until_window_ends  # a window's first step
    p.observe_rate(10, 10 / 6000.0, 8)
    assert p.plain_until_window_ends and p.step_draft_len(reqs) == 0
    p.wait_worth_s = 1e-3  # as a drafting step leaves it
    assert p.plain_step() and p.wait_worth_s is None  # the skipped step prices no wait
    assert not DraftLengthPolicy(4, adaptive=False).plain_until_window_ends


def _one_stream(p: DraftLengthPolicy, kinds: list[str]) -> dict[str, int]:
    """Serve one request of each kind in turn, one at a time, 96 tokens each: a plain step
    makes 1 token in 1.2 ms; a speculative step takes 1.5 ms and makes 3 tokens on a "good"
    request (drafts accepted), 1 on a "poor" one. The tokens each kind got while speculating."""
    spec = dict.fromkeys(kinds, 0)
    for i, kind in enumerate(kinds):
        req, done = _req(f"{kind}{i}"), 0
        while done < 96:
            p.step_draft_len([req])
            made = min(3 if kind == "good" else 1, 96 - done) if p.mode == "spec" else 1
            spec[kind] += made if p.mode == "spec" else 0
            p.observe_rate(made, 1.5e-3 if p.mode == "spec" else 1.2e-3, 1)
            done += made
    return spec


def test_one_stream_speculates_through_a_poor_request():
    """At one stream a window holds a third of one request, so its rate says as much about
    that request's drafts as about the mode. Good and poor requests alternate; speculating
    throughout is 1.2x plain decoding (poor requests lose 20 %, good ones gain 2.4x). One
    poor request must not send the policy back to plain decoding until a probe happens to land
    on a good one: the good requests are served speculatively."""
    p = _policy({1: 1e-3, 64: 1e-3})
    spec = _one_stream(p, ["good", "poor"] * 40)
    assert spec["good"] >= 0.9 * 40 * 96
    assert p.rates[("spec", 1)] > p.rates[("plain", 1)] * (1.0 + p.spec_margin)


def test_one_stream_whose_drafts_never_pay_decodes_plainly():
    """The longer memory at one stream keeps the guarantee: where speculation loses on every
    request, it runs only in its first look and the probes."""
    p = _policy({1: 1e-3, 64: 1e-3})
    spec = _one_stream(p, ["poor"] * 40)
    assert spec["poor"] <= 0.1 * 40 * 96
    assert p.mode == "plain"


def test_a_plain_step_is_priced_as_overlapped_not_synchronous():
    """fp32 at 64 rows on the H200 (round 13, run C): an overlapped plain step took ~7.6 ms, a
    synchronous verify step 2.8 ms of host plus the device time of its tokens. Pricing k = 0
    like a synchronous step (host + device) chose drafts that lost (0.95x of no drafter); priced
    as what it is, plain wins there, while at one row, where the device time barely grows with
    tokens, drafting still wins."""
    p = _policy({1: 1.1e-3, 8: 1.15e-3, 64: 7.4e-3, 128: 9.0e-3, 256: 12.0e-3, 512: 20.0e-3})
    reqs = [_req(f"r{i}") for i in range(64)]
    for r in reqs:  # n-gram-like: a draft on 2 steps of 3, about half of the drafts accepted
        r.step_draft_cap = 4
        for _ in range(30):
            p.observe(r, 4, 1)
            p.observe(r, 0, 0)
            p.observe(r, 4, 2)
    for _ in range(20):
        p.observe_sync(rows=64, tokens=256, seconds=14.8e-3, device_wait=12.0e-3)
        p.observe_plain(rows=64, tokens=64, seconds=7.6e-3)
    assert abs(p.plain_cost(64, 64) - 7.6e-3) < 1e-5
    assert p.sync_cost(64, 64) > p.plain_cost(64, 64) + 2e-3  # the old price of k = 0
    assert p.step_draft_len(reqs) == 0
    one = [reqs[0]]
    for _ in range(20):
        p.observe_sync(rows=1, tokens=4, seconds=1.45e-3, device_wait=1.15e-3)
        p.observe_plain(rows=1, tokens=1, seconds=1.15e-3)
    assert p.step_draft_len(one) == 4


def test_exposed_host_of_plain_steps_raises_their_price():
    """Where the host outlasts the device even with the overlap (small batches in bf16), a plain
    step costs its period, not its device time."""
    p = _policy({8: 1.2e-3, 64: 1.3e-3})
    for _ in range(40):
        p.observe_plain(rows=8, tokens=8, seconds=1.5e-3)
    assert abs(p.plain_cost(8, 8) - 1.5e-3) < 1e-5
    assert abs(p.plain_cost(64, 64) - 1.3e-3) < 1e-9  # unmeasured load: device time alone


def _learnt(p: DraftLengthPolicy, reqs: list[Request]) -> None:
    for r in reqs:
        r.step_draft_cap = 4
        for _ in range(20):
            p.observe(r, 4, 3)


def test_a_prefill_step_does_not_price_decode_steps():
    """A synchronous step that prefills 32 prompts spends far more host time than a decode step
    of 32 rows; taught by it, the policy would never draft at 32 rows (and never re-measure)."""
    p = _policy({32: 1.0e-3, 64: 1.05e-3, 256: 1.2e-3, 4096: 9e-3})
    reqs = [_req(f"r{i}") for i in range(32)]
    _learnt(p, reqs)
    p.observe_sync(rows=32, tokens=4000, seconds=20e-3, device_wait=8e-3)  # prefill
    assert p.sync_cost(32, 160) < 2e-3
    assert p.step_draft_len(reqs) == 4
    p.observe_sync(rows=32, tokens=160, seconds=2.4e-3, device_wait=1.2e-3)  # decode
    assert abs(p.sync_cost(32, 160) - 2.4e-3) < 1e-4


def test_a_host_time_that_vetoes_drafting_is_re_measured_now_and_then():
    """Plain decoding wins only because a synchronous step's host time was measured high: the
    policy drafts once every `host_refresh_every` such decisions, so the estimate can come down
    (a drafting step is the only thing that measures it)."""
    p = _policy({8: 1.0e-3, 64: 1.05e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    _learnt(p, reqs)
    for _ in range(10):
        p.observe_sync(rows=8, tokens=40, seconds=5e-3, device_wait=1e-3)  # a stale high reading
    ks = [p.step_draft_len(reqs) for _ in range(2 * p.host_refresh_every)]
    assert ks.count(0) == len(ks) - 2 and ks[p.host_refresh_every - 1] == 4
    # One reading at the usual host time is enough: a bucket's host time is the least of its
    # last few, so a burst of slow steps cannot hold drafting off for hundreds of steps.
    p.observe_sync(rows=8, tokens=40, seconds=1.3e-3, device_wait=1e-3)
    assert p.step_draft_len(reqs) == 4


def test_drafting_that_loses_on_the_device_alone_is_never_forced():
    """The refresh drafts only where the device time alone would let drafting pay."""
    p = _policy({64: 7.4e-3, 128: 9.0e-3, 256: 12.0e-3, 512: 20.0e-3})
    reqs = [_req(f"r{i}") for i in range(64)]
    for r in reqs:
        r.step_draft_cap = 4
        for _ in range(20):
            p.observe(r, 4, 0)
    assert [p.step_draft_len(reqs) for _ in range(3 * p.host_refresh_every)] == [0] * 192


def _no_speculation(rid: str) -> Request:
    """A request that turned speculation off (`SpeculationParams.disable`, or max_draft_len 0)."""
    return Request(request_id=rid, prompt_ids=[1, 2, 3], max_new_tokens=100, max_draft_len=0)


def test_steps_where_no_request_may_draft_do_not_count_for_speculation():
    """Requests that all turned speculation off decode plainly in the speculative mode too:
    counted there, a stretch of them pulled speculation's measured rate to plain decoding's
    (and biased the paired benchmark, whose second half has speculation off)."""
    p = _policy({8: 1e-3, 64: 1e-3})
    assert _window(p, 6000.0) == p.mode_window and p.mode == "plain"  # speculating first
    assert _window(p, 4000.0) == p.mode_window and p.mode == "spec"  # speculation wins
    assert p.rates == {("spec", 8): pytest.approx(750.0), ("plain", 8): pytest.approx(500.0)}
    before = dict(p.rates)
    for _ in range(3 * p.mode_window):
        assert not p.observe_rate(10, 10 / 4000.0, 8, may_draft=False)
    assert p.rates == before and p.mode == "spec"
    # The speculative window goes on where it was: it ends after a whole window of its own.
    assert _window(p, 6000.0) == p.mode_window
    assert p.rates == {("spec", 8): pytest.approx(750.0), ("plain", 8): pytest.approx(500.0)}


def test_steps_where_no_request_may_draft_count_in_the_plain_mode():
    """In the plain mode such a step is plain decoding like any other."""
    p = _policy({8: 1e-3, 64: 1e-3})
    _window(p, 6000.0)  # speculating first; plain decoding is measured next
    assert p.mode == "plain"
    ended = [p.observe_rate(10, 10 / 4000.0, 8, may_draft=False) for _ in range(p.mode_window)]
    assert ended == [False] * (p.mode_window - 1) + [True]
    assert p.rates[("plain", 8)] == pytest.approx(500.0)


def test_a_step_where_no_request_may_draft_teaches_device_time_not_host_time():
    """Such a step does no drafting work on the host: taught by it, a row bucket's host time
    (the least of its last few) would price drafting steps at a plain step's host work."""
    p = _policy({8: 1e-3, 64: 2e-3})
    for _ in range(4):
        p.observe_sync(rows=2, tokens=5, seconds=3e-3, device_wait=1e-3)
    assert p.sync_cost(2, 5) == pytest.approx(3e-3)  # 2 ms of host + 1 ms on the device
    p.observe_sync(rows=2, tokens=2, seconds=1.5e-3, device_wait=1.5e-3, may_draft=False)
    # Host time as before; the device time of the token bucket (8) moved by one EMA step.
    assert p.sync_cost(2, 5) == pytest.approx(2e-3 + 1e-3 + p.ema * 0.5e-3)


def test_decisions_where_no_request_may_draft_leave_the_host_refresh_due_as_before():
    """A stale high host time vetoes drafting; the refresh drafting step is due after
    `host_refresh_every` vetoes. Decisions for rows that may not draft cannot re-measure the
    host time, so they do not count towards it (nor teach any acceptance)."""
    p = _policy({8: 1.0e-3, 64: 1.05e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    _learnt(p, reqs)
    for _ in range(10):
        p.observe_sync(rows=8, tokens=40, seconds=8e-3, device_wait=1e-3)  # a stale high reading
    for _ in range(40):  # plain steps leave 0.5 ms of host work exposed
        p.observe_plain(rows=8, tokens=8, seconds=1.5e-3)
    off = [_no_speculation(f"off{i}") for i in range(8)]
    for _ in range(10):  # a stretch of requests with speculation off, as the executor reports it
        assert p.step_draft_len(off) == 0
        for r in off:
            r.step_draft_cap = 0
            p.observe(r, 0, 0)
        assert not p.observe_rate(8, 8 / 4000.0, 8, may_draft=False)
    n = p.host_refresh_every
    assert [p.step_draft_len(reqs) for _ in range(2 * n)] == ([0] * (n - 1) + [4]) * 2


def test_a_step_where_no_row_may_draft_is_not_priced(monkeypatch):
    """Where no decode row may draft (speculation off for each), k is 0 at once: the step is
    plain whatever k, so the acceptance sums (most of the policy's work a step) are not made;
    rows that may draft are priced again afterwards."""
    p = _policy({8: 1.0e-3, 64: 1.01e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    _learnt(p, reqs)
    assert p.step_draft_len(reqs) == 4
    p.presum(reqs)
    monkeypatch.setattr(p.acceptance, "sums", lambda *a: pytest.fail("priced a plain step"))
    off = [_no_speculation(f"off{i}") for i in range(8)]
    assert p.step_draft_len(off) == 0 and p.wait_worth_s is None
    monkeypatch.undo()
    assert p.step_draft_len(reqs) == 4


def test_a_drafting_step_says_how_long_a_wait_for_its_drafts_is_worth():
    """`wait_worth_s`: the wait after which the drafting step commits tokens exactly as fast as
    the same synchronous step without drafts would (the remote drafter's "gain" patience)."""
    p = _policy({1: 0.7e-3, 8: 0.75e-3, 64: 1.0e-3})
    for _ in range(8):
        p.observe_sync(rows=1, tokens=5, seconds=1.05e-3, device_wait=0.75e-3)  # 0.3 ms host
    good = _req("good")
    _teach(p, good, drafted=4, accepted=3, times=20)
    k = p.step_draft_len([good])
    assert k == 4
    worth = p.wait_worth_s
    committed, fed = p.expected_tokens(good, k)
    with_drafts = committed / (p.sync_cost(1, math.ceil(fed)) + worth)
    without = 1.0 / p.sync_cost(1, 1)
    assert with_drafts == pytest.approx(without)
    assert worth > 0.5e-3  # ~3 tokens for ~1.05 ms against 1 for ~1 ms: worth a long wait
    # A poorer request is worth a shorter wait; one whose drafts never pay, none at all.
    fair = _req("fair")
    _teach(p, fair, drafted=4, accepted=1, times=20)
    assert p.step_draft_len([fair]) > 0
    assert 0 < p.wait_worth_s < worth
    p = _policy({1: 1e-3, 8: 2e-3, 64: 8e-3})
    poor = _req("poor")
    _teach(p, poor, drafted=4, accepted=0, times=20)
    assert p.step_draft_len([poor]) == 0 and p.wait_worth_s is None
    static = DraftLengthPolicy(4, adaptive=False)
    assert static.step_draft_len([_req("a")]) == 4 and static.wait_worth_s is None


def test_the_price_of_a_wait_leaves_out_the_waits_it_allowed():
    """Steps that waited for their drafter are dearer to draft (the host time prices k), but
    the price of a wait is set against the host time without the drafter's part: else each
    wait it allowed would raise the next price and lengthen the waits."""
    prices = []
    for waited in (0.0, 0.4e-3):
        p = _policy({1: 0.7e-3, 8: 0.75e-3, 64: 1.0e-3})
        for _ in range(8):
            p.observe_sync(
                rows=1, tokens=5, seconds=1.05e-3 + waited, device_wait=0.75e-3, draft_wait=waited
            )
        good = _req("good")
        _teach(p, good, drafted=4, accepted=3, times=20)
        assert p.step_draft_len([good]) == 4
        prices.append((p.wait_worth_s, p.sync_cost(1, 5)))
    (bare, cost), (after_waits, dearer) = prices
    assert after_waits == pytest.approx(bare)
    assert dearer == pytest.approx(cost + 0.4e-3)


def test_the_snapshot_says_what_the_policy_ran_and_learnt():
    """What the metrics export: steps per mode as windows close, steps per draft length run,
    each mode's rate per load and the current mode."""
    p = _policy({1: 1e-3, 8: 1e-3, 64: 1e-3})
    spec = _window(p, 4000.0)  # speculating first
    plain = _window(p, 6000.0)  # then plain decoding is measured, and wins
    for k in (4, 4, 0):
        p.ran(k)
    snap = p.snapshot()
    assert snap["mode"] == p.mode == "plain"
    assert snap["mode_steps"] == {"spec": spec, "plain": plain}
    assert snap["rates"][("spec", 8)] == pytest.approx(4000.0 / 8)
    assert snap["rates"][("plain", 8)] == pytest.approx(6000.0 / 8)
    assert snap["windows"] == {("spec", 8): 1, ("plain", 8): 1}
    assert snap["k_steps"] == [1, 0, 0, 0, 2]
    assert snap["device"] == {1: 1e-3, 8: 1e-3, 64: 1e-3}


def test_a_probe_of_speculation_drafts_whatever_the_host_estimate_says():
    """A stale high host time vetoes drafting in the speculative mode; a window that probes
    speculation must still draft, or it measures plain decoding under speculation's name and
    speculation never wins back (round 40, 8 streams on the H100: 8 drafting steps in 192
    probing steps)."""
    p = _policy({8: 1.0e-3, 64: 1.05e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    _learnt(p, reqs)
    for _ in range(10):
        p.observe_sync(rows=8, tokens=40, seconds=5e-3, device_wait=1e-3)  # a stale high reading
    _window(p, 4000.0)  # speculating first: the mode's window
    _window(p, 6000.0)  # plain measured, and it wins
    assert p.mode == "plain"
    while p.mode == "plain":  # ... until speculation is probed again
        _window(p, 6000.0)
    assert p.rates[("plain", 8)] > p.rates[("spec", 8)]  # a probe: plain still wins here
    assert [p.step_draft_len(reqs) for _ in range(p.first_window)] == [4] * p.first_window
    _window(p, 4000.0)  # the probe still loses (by a third): back to plain, no drafting there
    assert p.mode == "plain" and p.step_draft_len(reqs) == 0


def test_bursty_drafts_are_priced_by_the_populations_deeper_acceptance():
    """A drafter whose drafts are all wrong or all right (n-gram lookups: a match goes on or
    does not start) accepts a long draft far more often than a geometric prefix with the same
    per-draft rate says; the population's acceptance past the first draft learns that."""
    p = _policy({8: 1e-3, 64: 1.05e-3})
    reqs = [_req(f"r{i}") for i in range(8)]
    for i in range(200):
        for r in reqs:
            r.step_draft_cap = 4
            p.observe(r, 4, 4 if i % 2 else 0)
    deeper = p.snapshot()["deeper"]
    assert len(deeper) == 3 and min(deeper) > 0.95  # once the first is right, so is the rest
    committed, fed = p.expected_tokens(_req("new"), 4)  # a new request: the population's
    a = p.snapshot()["accept"]  # the per-draft rate: about half
    assert 0.3 < a < 0.7
    geometric = 1 + a + a**2 + a**3 + a**4
    assert committed > geometric + 0.5 and committed == pytest.approx(1 + 4 * a, abs=0.2)
    assert fed == 5.0


def test_in_the_speculative_mode_only_steps_that_could_draft_count():
    """An overlapped step in the speculative mode is one the cost model gave k = 0: the step
    the plain mode runs. It does not count for speculation's rate (counted, a stretch of
    requests whose drafts miss pulled that rate to plain decoding's)."""
    p = _policy({8: 1e-3, 64: 1e-3})
    assert p.mode == "spec"
    closed = 0
    for _ in range(p.mode_window):  # each drafting step follows a few overlapped ones
        for _ in range(3):
            assert not p.observe_rate(8, 8 / 6000.0, 8, overlapped=True)
        closed += p.observe_rate(10, 10 / 9000.0, 8)
    assert closed == 1 and p.rates == {("spec", 8): pytest.approx(9000.0 / 8)}


def test_a_speculative_window_in_which_nothing_drafts_ends_without_a_rate():
    """When the cost model gives k = 0 to a window's worth of steps in a row, the window ends
    without a rate (else it would never end: a probe of speculation would never give up), and
    the next one starts in the mode best at its load."""
    p = _policy({8: 1e-3, 64: 1e-3})
    _window(p, 4000.0)  # speculating first
    _window(p, 6000.0)  # plain measured: it wins
    while p.mode == "plain":  # until the next probe of speculation
        _window(p, 6000.0)
    rates = dict(p.rates)
    ends = [p.observe_rate(8, 8 / 6000.0, 8, overlapped=True) for _ in range(p.idle_handoff)]
    assert ends == [False] * (p.idle_handoff - 1) + [True]
    assert p.rates == rates  # no rate learnt from those steps
    p.step_draft_len([_req(f"r{i}") for i in range(8)])  # the next window starts: plain wins
    assert p.mode == "plain"
    assert _window(p, 6000.0) == p.mode_window  # and is measured as usual


def test_a_static_policy_stays_in_the_speculative_mode():
    """A static policy drafts K whatever it measures: its mode (and what its metrics say)
    stays speculative after any number of windows."""
    p = DraftLengthPolicy(4, adaptive=False)
    for _ in range(4 * p.mode_window):
        assert not p.observe_rate(8, 8 / 6000.0, 8)
        p.observe_rate(8, 8 / 6000.0, 8, overlapped=True)
    assert p.mode == "spec" and p.rates == {} and p.snapshot()["mode"] == "spec"


def test_a_request_none_of_whose_drafts_is_accepted_stops_drafting():
    """Even where the population's drafts past the first are nearly always accepted once the
    first is (a lookup drafter), a request whose drafts all miss stops drafting."""
    p = _policy({8: 1e-3, 64: 1.05e-3})
    good = [_req(f"g{i}") for i in range(8)]
    for _ in range(40):
        for r in good:
            r.step_draft_cap = 4
            p.observe(r, 4, 4)
    assert min(p.snapshot()["deeper"]) > 0.9
    bad = _req("bad")
    bad.step_draft_cap = 4
    for _ in range(30):
        p.observe(bad, 4, 0)
    assert p.request_cap(bad, 4) == 0 and p.request_cap(good[0], 4) == 4


def test_when_the_winner_changes_the_mode_it_beat_is_probed_on_the_new_gap():
    """Speculation far ahead sets the next probe of plain decoding up to `max_probe_every`
    windows away; when speculation then loses by a little, it is probed again within the
    interval that small gap sets, not at that far probe time."""
    p = _policy({8: 1e-3, 64: 1e-3})
    _window(p, 9000.0)  # speculating first
    _window(p, 4000.0)  # plain: far behind
    assert p.mode == "spec" and p.probe_interval(8) == p.max_probe_every
    while p.mode == "spec":  # until plain's next probe: then the one after is far away
        _window(p, 9000.0)
    _window(p, 4000.0)
    assert p.mode == "spec"
    while p.rates[("spec", 8)] > p.rates[("plain", 8)] * (1 + p.spec_margin):
        _window(p, 3900.0 if p.mode == "spec" else 4000.0)  # speculation's requests turn poor
    assert p.mode == "plain"
    gap = p.probe_interval(8)
    assert gap < p.max_probe_every
    windows = 0
    while p.mode == "plain":
        _window(p, 4000.0)
        windows += 1
    assert windows <= gap + 1


def test_drafts_longer_than_the_policys_k_are_learnt_from_without_failing():
    """A row may verify more drafts than the policy's K (a request's own longer limit does not
    exist, but a drafter may return more than asked): the deeper acceptance keeps to K."""
    p = _policy({8: 1e-3})
    r = _req("long")
    for _ in range(2 * p.acceptance.deeper_every):
        p.observe(r, 9, 9)
    deeper = p.snapshot()["deeper"]
    assert len(deeper) == p.max_draft_len - 1 and min(deeper) > 0.9  # all passed


def test_a_window_whose_load_moves_to_where_its_mode_loses_ends_there():
    """A pass ramping up: a speculative window chosen at 16 rows (speculation wins there) goes
    on while the load climbs to 32 rows, where speculation is known to trail plain decoding by
    30 %. After `load_shift_steps` steps there it ends (its rate still counts, at its own
    load) and plain decoding runs; a step or two across the edge, or a gap under
    `early_exit`, changes nothing."""
    p = _policy({16: 1e-3, 32: 1e-3})
    _window(p, 16 * 2000.0, rows=16)  # spec at 16
    _window(p, 16 * 1500.0, rows=16)  # plain at 16: spec wins there
    _window(p, 32 * 700.0, rows=32)  # spec at 32 (implied loser: measured as a probe)
    _window(p, 32 * 1000.0, rows=32)  # plain at 32: wins by 30 %
    sixteen = [_req(f"r{i}") for i in range(16)]
    for r in sixteen:
        _teach(p, r, drafted=4, accepted=3, times=5)
    assert p.step_draft_len(sixteen) > 0 and p.mode == "spec"  # a window planned at 16
    assert not p.observe_rate(16, 16 / (16 * 2000.0), 16)
    # Two steps across the edge and back: a wobble, not a move.
    assert not p.observe_rate(32, 32 / (32 * 700.0), 32)
    assert not p.observe_rate(32, 32 / (32 * 700.0), 32)
    assert not p.observe_rate(16, 16 / (16 * 2000.0), 16)
    ended = [p.observe_rate(32, 32 / (32 * 700.0), 32) for _ in range(p.load_shift_steps)]
    assert ended == [False] * (p.load_shift_steps - 1) + [True]
    assert p.mode == "plain"
    assert p.step_draft_len([_req(f"s{i}") for i in range(32)]) == 0


def test_a_window_whose_load_moves_stays_where_its_mode_trails_by_little():
    p = _policy({16: 1e-3, 32: 1e-3})
    _window(p, 16 * 2000.0, rows=16)
    _window(p, 16 * 1500.0, rows=16)
    _window(p, 32 * 950.0, rows=32)  # spec at 32 trails plain by 5 %: under `early_exit`
    _window(p, 32 * 1000.0, rows=32)
    sixteen = [_req(f"r{i}") for i in range(16)]
    assert p.step_draft_len(sixteen) > 0 and p.mode == "spec"
    steps = 1 + sum(1 for _ in iter(lambda: p.observe_rate(32, 32 / (32 * 950.0), 32), True))
    assert steps == p.mode_window  # a whole window


def test_a_request_its_estimate_holds_at_k0_drafts_again_after_a_while():
    """A step without a draft budget teaches nothing, so an estimate low enough to choose
    k = 0 would hold its request there for good; a lookup drafter's requests miss for a while
    and then match for long runs. In the speculative mode, every `recover_every` steps without
    a budget move the request's estimate half way back to the population's; in the plain mode
    (nobody drafts, whatever the estimates) it stays."""
    p = _policy({1: 1e-3, 64: 1e-3})
    assert p.mode == "spec"
    for i in range(20):  # the population: drafts that are there and mostly accepted
        _teach(p, _req(f"g{i}"), drafted=4, accepted=4, times=5)
    cold, held = _req("cold"), _req("held")
    for r in (cold, held):  # asked for drafts, its drafter had none for a long while
        r.step_draft_cap = 4
        for _ in range(40):
            p.observe(r, 0, 0)
    low = p.expected_tokens(cold, 4)[0]
    population = p.expected_tokens(_req("new"), 4)[0]
    assert low < 1.1 < population
    every = p.acceptance.recover_every
    _teach(p, cold, drafted=0, accepted=0, times=0)  # (sets the budget to 0)
    for _ in range(every - 1):
        p.observe(cold, 0, 0)
    assert p.expected_tokens(cold, 4)[0] == low  # nothing learnt yet
    p.observe(cold, 0, 0)
    recovered = p.expected_tokens(cold, 4)[0]
    assert low < recovered < population
    for _ in range(3 * every):
        p.observe(cold, 0, 0)
    assert p.expected_tokens(cold, 4)[0] > recovered
    # In the plain mode the same steps leave the estimate where it was.
    p.mode = "plain"
    held_low = p.expected_tokens(held, 4)[0]
    assert held_low < 1.1
    _teach(p, held, drafted=0, accepted=0, times=0)
    for _ in range(4 * every):
        p.observe(held, 0, 0)
    assert p.expected_tokens(held, 4)[0] == held_low


def test_a_request_that_can_never_draft_is_not_recovered():
    """A request with speculation off (no draft length) never drafts whatever its estimate:
    its budgetless steps leave its estimate's table as it is (no rebuild on the step's hot
    path, so a paired benchmark's "off" pass pays nothing for the recovery)."""
    p = _policy({1: 1e-3, 64: 1e-3})
    off = Request(request_id="off", prompt_ids=[1, 2, 3], max_new_tokens=100, max_draft_len=0)
    off.step_draft_cap = 0
    p.observe(off, 0, 0)
    (table,) = p.acceptance.tables([off])
    for _ in range(5 * p.acceptance.recover_every):
        p.observe(off, 0, 0)
    assert p.acceptance.tables([off])[0] is table


def _drafting_policy() -> DraftLengthPolicy:
    """A policy that drafts, with a host time, so each drafting step prices a wait
    (`wait_worth_s`, a float of the step's summed tables) as well as its k."""
    p = _policy({1: 0.7e-3, 8: 0.75e-3, 64: 1.0e-3})
    for _ in range(8):
        p.observe_sync(rows=4, tokens=20, seconds=1.05e-3, device_wait=0.75e-3)
    return p


def test_sums_made_while_the_device_runs_price_the_next_step_as_a_fresh_sum_would():
    """`presum` sums the step's rows while the device runs it; the next `step_draft_len`
    corrects the sums for the requests that finished, joined or had their caps cut since and
    then decides exactly as it would have without them (same estimates: nothing observed in
    between)."""
    rows = {name: _req(name) for name in ("a", "b", "c", "d")}
    accepted = {"a": 4, "b": 1, "c": 3, "d": 2}
    pre, fresh = _drafting_policy(), _drafting_policy()
    for p in (pre, fresh):
        for name, r in rows.items():
            _teach(p, r, drafted=4, accepted=accepted[name], times=12)
    a, b, c, d = rows.values()
    # The same rows: the sums are used as they are.
    pre.presum([a, b, c])
    assert pre.step_draft_len([a, b, c]) == fresh.step_draft_len([a, b, c]) == 4
    assert pre.wait_worth_s == fresh.wait_worth_s > 0
    # b finished, d joined, c is three tokens from its end (one draft left of use).
    pre.presum([a, b, c])
    c.output_ids = [5] * (c.max_new_tokens - 2)
    assert c.useful_drafts == 1
    assert pre.step_draft_len([a, c, d]) == fresh.step_draft_len([a, c, d])
    assert pre.wait_worth_s == pytest.approx(fresh.wait_worth_s, rel=1e-12)
    # Without the corrections the price would differ: the check can fail.
    stale = _drafting_policy()
    for name, r in rows.items():
        _teach(stale, r, drafted=4, accepted=accepted[name], times=12)
    stale.step_draft_len([a, b])
    assert stale.wait_worth_s != pytest.approx(fresh.wait_worth_s, rel=1e-6)
