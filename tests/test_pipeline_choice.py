"""Pipelined or synchronous drafting steps, chosen per load by what each measured
(`--pipeline-choice measured`, pipeline_choice.py): the chooser alone, and inside the
draft-length policy. (A remote-drafter target that switches between them, lossless:
tests/test_remote_e2e.py.)"""

from __future__ import annotations

import pytest

from specwire.common.errors import UserError
from specwire.target_service.config import TargetConfig
from specwire.target_service.draft_policy import DraftLengthPolicy
from specwire.target_service.pipeline_choice import PIPELINED, SYNCHRONOUS, PipelineChoice
from specwire.target_service.request import Request


def _windows(
    c: PipelineChoice,
    load: int,
    rates: dict[bool, float],
    n: int,
    spec_rates: dict[bool, float] | None = None,
) -> list[bool]:
    """`n` speculative windows at `load`, each run as `c` plans it at the rate by the clock
    `rates` gives that variant (by the policy's count of drafting steps: `spec_rates`, else
    the same); the variants run, in order."""
    ran = []
    for _ in range(n):
        v = c.variant(load)
        c.record(load, v, rates[v], (spec_rates or rates)[v], floor=0.5, share=1.0, steps=32)
        ran.append(v)
    return ran


def test_each_load_runs_the_faster_variant_and_probes_the_slower_one():
    """Pipelined first (what --pipeline-drafts asked for), then the two alternate until each
    has `min_looks` windows; then the faster runs, and the slower one is re-measured on the
    interval its gap sets."""
    c = PipelineChoice()
    ran = _windows(c, 32, {PIPELINED: 860.0, SYNCHRONOUS: 970.0}, 46)
    assert ran[:7] == [PIPELINED, SYNCHRONOUS] * 3 + [SYNCHRONOUS]
    probes = ran[6:].count(PIPELINED)
    # An 11 % gap: a probe every 11 windows (0.11 / probe_budget 0.01), not every window.
    assert 2 <= probes <= 4, ran
    assert c.spec_rate(32) == pytest.approx(970.0)  # speculation's rate here: its best variant's
    assert c.steps[SYNCHRONOUS] > c.steps[PIPELINED] > 0
    # One load's verdict does not move another's measured one.
    ran = _windows(c, 1, {PIPELINED: 2300.0, SYNCHRONOUS: 2000.0}, 16)
    assert ran[6:].count(PIPELINED) >= 9 and c.spec_rate(1) == pytest.approx(2300.0)


def test_the_variants_are_compared_by_the_clock_not_by_their_drafting_steps():
    """A synchronous window prices more steps to k = 0 (its host time is on the critical
    path), so its drafting steps alone look faster than a pipelined window's; by the clock,
    every step counted, the pipelined one is faster, and that is the one that runs. The
    speculative mode's rate (against plain decoding) is then the pipelined one's by the
    policy's count."""
    c = PipelineChoice()
    clock = {PIPELINED: 2200.0, SYNCHRONOUS: 1900.0}
    drafting = {PIPELINED: 1700.0, SYNCHRONOUS: 2000.0}
    ran = _windows(c, 1, clock, 20, drafting)
    assert ran[6:].count(PIPELINED) >= 12, ran
    assert c.spec_rate(1) == pytest.approx(1700.0)


def test_the_winner_changing_is_followed():
    """The load's requests change (say, the drafts start missing): the other variant takes
    over once its probe shows it faster."""
    c = PipelineChoice()
    ran = _windows(c, 8, {PIPELINED: 1000.0, SYNCHRONOUS: 900.0}, 12)
    assert ran[6:].count(PIPELINED) >= 5, ran
    ran = _windows(c, 8, {PIPELINED: 500.0, SYNCHRONOUS: 900.0}, 40)
    assert ran[-10:].count(SYNCHRONOUS) >= 8, ran


def test_other_loads_imply_a_winner_where_one_variant_is_unmeasured():
    """Pipelining pays less as the batch grows: synchronous winning at 32 rows wins at 64
    (pipelined is not tried there until a probe is due); pipelined winning at 8 wins at 2.
    Nothing measured anywhere: pipelined."""
    c = PipelineChoice()
    assert c.variant(64) == PIPELINED
    _windows(c, 32, {PIPELINED: 800.0, SYNCHRONOUS: 1000.0}, 2)
    _windows(c, 8, {PIPELINED: 1500.0, SYNCHRONOUS: 1200.0}, 2)
    assert c.variant(64) == SYNCHRONOUS and c.variant(2) == PIPELINED
    assert c.variant(16) == PIPELINED  # neither implies anything at 16: pipelined
    ran = _windows(c, 64, {PIPELINED: 900.0, SYNCHRONOUS: 700.0}, 40)
    assert ran[0] == SYNCHRONOUS and PIPELINED in ran  # implied first, then probed
    assert ran[-5:].count(PIPELINED) >= 4  # and it wins there after all: measured beats implied


def _req(rid: str) -> Request:
    return Request(request_id=rid, prompt_ids=[1, 2, 3], max_new_tokens=100, max_draft_len=4)


def test_the_policy_runs_each_speculative_window_as_its_load_measured_fastest():
    """Inside the adaptive policy: each speculative window's variant is chosen when it starts
    (`pipelines`, which the executor reads), its rate counts toward that variant's, and the
    speculative mode's rate at a load is its best variant's. Pipelined steps are faster at one
    row, synchronous ones at 32."""
    p = DraftLengthPolicy(4, adaptive=True, pipelined=True, choose_pipelining=True)
    p.seed_costs({1: 1e-3, 256: 1e-3})
    p.spec_margin = -0.9  # keep speculating: this test is about its variants

    def run(rows: int, windows: int) -> list[bool]:
        reqs = [_req(f"r{i}") for i in range(rows)]
        fast = rows == 1  # pipelined wins at one row
        ran = []
        while windows:
            p.step_draft_len(reqs)
            mine = p.pipelines
            rate = 1100.0 if mine == fast else 900.0
            spec = p.mode == "spec"
            if p.observe_rate(10, 10 / (rate * rows), rows) and spec:
                ran.append(mine)  # the variant of the speculative window that just closed
                windows -= 1
        return ran

    run(1, 6)
    run(32, 8)
    c = p.choice
    assert c.rates[(PIPELINED, 1)] > c.rates[(SYNCHRONOUS, 1)]
    assert c.rates[(SYNCHRONOUS, 32)] > c.rates[(PIPELINED, 32)]
    # Where both are known, the faster runs, bar a probe now and then (an 18 % gap: one in
    # 18 windows).
    assert run(1, 12).count(PIPELINED) >= 10
    assert run(32, 12).count(SYNCHRONOUS) >= 10
    snap = p.snapshot()["pipelining"]
    assert snap["steps"]["pipelined"] > 0 and snap["steps"]["synchronous"] > 0
    assert ("synchronous", 32) in snap["rates"]


def test_the_policy_times_a_variant_by_the_clock_and_a_window_that_never_drafts_still_counts():
    """Inside the policy a window's plain steps (k = 0, overlapped) count toward its variant's
    rate by the clock, steps where no request may draft do not, and the speculative mode's
    rate is the policy's own count of the faster variant. A synchronous window whose every
    step went plain (its host time priced drafting out) ends by the idle rule: it is still
    recorded as that variant's clock rate, so the load moves on to measure the other."""
    p = DraftLengthPolicy(4, adaptive=True, pipelined=True, choose_pipelining=True)
    p.seed_costs({1: 1e-3, 256: 1e-3})
    p.spec_margin = -0.9
    p.rates[("plain", 8)] = 1.0  # plain decoding measured (and far behind): no probe of it
    reqs = [_req(f"r{i}") for i in range(8)]
    assert p.step_draft_len(reqs) > 0 and p.mode == "spec" and p.pipelines
    for _ in range(p.mode_window):  # a pipelined window: 32 drafting steps and 32 plain ones
        assert not p.observe_rate(40, 10e-3, 8, overlapped=True)  # 500 tok/s/row
        assert not p.observe_rate(9, 1e-3, 8, may_draft=False)  # not the variant's
        closed = p.observe_rate(40, 10e-3, 8)
    assert closed
    c = p.choice
    assert c.rates[(PIPELINED, 8)] == pytest.approx(500.0)  # 64 steps by the clock
    assert c.spec_rates[(PIPELINED, 8)] == pytest.approx(500.0)
    assert p.rates[("spec", 8)] == pytest.approx(500.0)
    # The next window at 8 measures synchronous steps; each of them went plain.
    p.step_draft_len(reqs)
    assert p.mode == "spec" and not p.pipelines
    for _ in range(p.idle_handoff - 1):
        assert not p.observe_rate(8, 4e-3, 8, overlapped=True)  # 250 tok/s/row
    assert p.observe_rate(8, 4e-3, 8, overlapped=True)  # the idle rule ends it
    assert c.rates[(SYNCHRONOUS, 8)] == pytest.approx(250.0)
    assert (SYNCHRONOUS, 8) not in c.spec_rates  # no drafting step to count
    p.step_draft_len(reqs)
    assert p.pipelines  # the alternation goes on (3 windows each before trusting either)


def test_a_synchronous_window_prices_drafting_with_the_host_time():
    """The host time of a synchronous drafting step is on its critical path: with a dear host,
    a synchronous window drafts nothing where a pipelined one (host hidden) drafts."""
    p = DraftLengthPolicy(4, adaptive=True, pipelined=True, choose_pipelining=True)
    p.seed_costs({1: 1e-3, 8: 1.05e-3, 256: 2e-3})
    p.exposed[8] = 0.0
    for _ in range(4):
        p.observe_sync(rows=8, tokens=40, seconds=20e-3, device_wait=1e-3)
    reqs = [_req(f"r{i}") for i in range(8)]
    for r in reqs:
        r.step_draft_cap = 4
        for _ in range(5):
            p.observe(r, 4, 1)
    p.rates[("plain", 8)] = 1.0  # plain decoding measured (and far behind): no probe of it
    assert p.step_draft_len(reqs) > 0 and p.pipelines
    for _ in range(p.mode_window):  # the pipelined window closes ...
        p.observe_rate(40, 10e-3, 8)
    # ... and the next one at 8 rows measures synchronous steps: priced with the host time.
    assert p.step_draft_len(reqs) == 0 and p.mode == "spec" and not p.pipelines


def test_the_choice_resolves_by_drafter_and_rejects_unknown_values():
    remote = TargetConfig(model="tiny-random", drafter="grpc://127.0.0.1:1")
    lookup = TargetConfig(model="tiny-random", drafter="ngram")
    assert remote.pipeline_choice == "measured" and lookup.pipeline_choice == "always"
    with pytest.raises(UserError, match="--pipeline-choice must be one of auto, measured"):
        TargetConfig(model="tiny-random", pipeline_choice="sometimes")
