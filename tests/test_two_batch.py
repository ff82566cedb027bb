"""The two-batch overlap (`--two-batch-rows N`) is lossless: speculative steps that alternate
two halves of the batch — one half scheduled, drafted and launched while the other is still in
flight — give, token for token, what plain synchronous decoding gives, with preemption,
cancellation, late EOS, a failing request and sampled neighbours.

Real engines (tiny-random on the CPU, fp32). The CPU computes a step when it is launched, but
the executor's bookkeeping is the GPU's: a step is read and committed one step late, and no
request runs in two steps at once. `InFlightWatch` checks that from the runner's side.
"""

from __future__ import annotations

import pytest
from engine_driver import counter as _counter
from engine_driver import run_to_completion, tiny_engine
from faulty_plugins import POISON_IDS
from lossless_prompts import lossless_prompts

from specwire.target_service.output import Complete, Failed
from specwire.target_service.request import SamplingConfig

PROMPTS = lossless_prompts(24)


def _engine(drafter="ngram", two_batch=True, **kw):
    kw.setdefault("two_batch_rows", 2 if two_batch else 0)
    return tiny_engine(drafter, **kw)


class InFlightWatch:
    """Wraps the runner and fails the test (`violations`) if a launch holds a request of an
    unread step (except a plain overlapped row fed on the device from that step:
    `feed_src`), if a launch would reuse the staging buffers of an unread step (launches
    alternate between two sets, as CUDA-graph replays do), or if more than two steps are
    ever unread."""

    def __init__(self, runner) -> None:
        self.unread: dict[int, tuple[set[str], int]] = {}  # id(StepLogits) -> (requests, twin)
        self.launches = 0
        self.most_unread = 0
        self.violations: list[str] = []
        forward, wait = runner.forward, runner.wait

        def watched_forward(rows, tables, *args, **kw):
            ids = {row.request.request_id for row in rows if row.feed_src < 0}
            twin = self.launches % 2
            for other, other_twin in self.unread.values():
                if ids & other:
                    self.violations.append(f"launch {self.launches} reuses {ids & other}")
                if twin == other_twin:
                    self.violations.append(f"launch {self.launches} reuses an unread twin")
            logits = forward(rows, tables, *args, **kw)
            self.unread[id(logits)] = ({row.request.request_id for row in rows}, twin)
            self.launches += 1
            self.most_unread = max(self.most_unread, len(self.unread))
            return logits

        def watched_wait(logits):
            self.unread.pop(id(logits), None)
            return wait(logits)

        runner.forward, runner.wait = watched_forward, watched_wait

    @property
    def in_flight(self) -> set[str]:
        """The requests of the steps launched and not read yet."""
        return set().union(*(ids for ids, _twin in self.unread.values()))


class RateLog:
    """Records what the executor reports to the draft-length policy (`observe_rate`)."""

    def __init__(self, policy) -> None:
        self.generated = 0
        observe = policy.observe_rate

        def logged(generated, seconds, rows, *args, **kwargs):
            self.generated += generated
            return observe(generated, seconds, rows, *args, **kwargs)

        policy.observe_rate = logged


@pytest.fixture(scope="module")
def baseline():
    eng = _engine(drafter="none", two_batch=False, overlap=False)
    return [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]


def test_two_batch_equals_plain_decoding(baseline):
    eng = _engine()
    watch = InFlightWatch(eng.runner)
    rates = RateLog(eng.executor.scheduler.policy)
    done = run_to_completion(eng, PROMPTS, max_new_tokens=20)
    out = [c.token_ids for c in done]
    assert out == baseline
    assert rates.generated == sum(len(t) for t in out)  # every token reported once
    assert watch.violations == []
    assert watch.most_unread == 2  # a half was launched while the other was unread
    assert _counter(eng, "two_batch_steps") >= 0.8 * _counter(eng, "steps") > 0
    stats = eng.executor.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0  # it did speculate


def test_off_by_default_and_with_no_overlap(baseline):
    for kw in ({"two_batch": False}, {"overlap": False}):
        eng = _engine(**kw)
        out = [c.token_ids for c in run_to_completion(eng, PROMPTS[:8], max_new_tokens=20)]
        assert out == baseline[:8]
        assert _counter(eng, "two_batch_steps") == 0


def test_preemption_never_touches_the_half_in_flight(baseline):
    """Too few KV blocks: requests are preempted and recomputed, but never one whose step is
    in flight (the device may still write its blocks)."""
    eng = _engine(num_kv_blocks=24)
    watch = InFlightWatch(eng.runner)
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert watch.violations == []
    assert _counter(eng, "preemptions") > 0
    assert _counter(eng, "two_batch_steps") > 0


def test_late_eos_is_applied_when_the_half_is_read(baseline):
    eos = {out[5] for out in baseline[:6]}
    expected = []
    for out in baseline:
        cut = next((i for i, t in enumerate(out) if t in eos), None)
        expected.append(out if cut is None else out[: cut + 1])
    assert expected != baseline
    eng = _engine()
    eng.executor.make_stream.eos_ids = eos
    done = run_to_completion(eng, PROMPTS, max_new_tokens=20)
    assert [c.token_ids for c in done] == expected
    assert _counter(eng, "two_batch_steps") > 0


def _events(stream) -> list:
    events = []
    while not stream.events.empty():
        events.append(stream.events.get())
    return events


def test_cancel_while_its_half_is_in_flight_keeps_the_others(baseline):
    eng = _engine()
    tok, ex = eng.loaded.tokenizer, eng.executor
    watch = InFlightWatch(eng.runner)
    streams = [ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20)) for p in PROMPTS[:8]]
    ex.run_until_idle(max_steps=5)
    assert watch.in_flight and not ex.idle  # a half is launched and not read
    victim = next(s for s in streams if s.request.request_id in watch.in_flight)
    ex.cancel(victim.request.request_id)
    ex.run_until_idle()
    for i, s in enumerate(streams):
        last = _events(s)[-1]
        assert isinstance(last, Complete)
        if s is victim:
            assert last.finish_reason == "cancelled"
        else:
            assert last.token_ids == baseline[i]
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1


def test_a_failing_request_fails_alone(baseline):
    """A plugin resource manager raises whenever a poisoned request is in a step: the launch
    fails, the half in flight is read, and the batch is bisected until only the poisoned
    request fails; the others finish as they would alone."""
    eng = _engine(drafter="faulty_plugins:PoisonDrafter")
    tok, ex = eng.loaded.tokenizer, eng.executor
    streams = [
        ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20, speculate=False))
        for p in PROMPTS[:6]
    ]
    poisoned = ex.submit(eng.new_request(POISON_IDS + [1, 2], max_new_tokens=20))
    ex.run_until_idle()
    assert isinstance(_events(poisoned)[-1], Failed)
    assert [_events(s)[-1].token_ids for s in streams] == baseline[:6]
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1


def _sampled(eng):
    return eng.new_request(
        eng.loaded.tokenizer.encode("a sampled neighbour"),
        max_new_tokens=30,
        sampling=SamplingConfig(temperature=0.8, seed=7),
    )


def test_a_sampled_neighbour_arriving_mid_flight_turns_it_off(baseline):
    """A sampled request's tokens come from its logits on the host, which the next half's
    launch would overwrite: when one arrives, the half in flight is read and speculative
    steps turn synchronous until it is gone. Greedy output is unchanged, and the sample
    equals the same seed's without the two-batch overlap."""
    samples = []
    for two_batch in (False, True):
        eng = _engine(two_batch=two_batch)
        tok, ex = eng.loaded.tokenizer, eng.executor
        watch = InFlightWatch(eng.runner)
        greedy = [ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20)) for p in PROMPTS[:6]]
        ex.run_until_idle(max_steps=4)
        assert bool(watch.in_flight) == two_batch  # a half launched and not read
        sampled = ex.submit(_sampled(eng))
        ex.run_until_idle()
        assert [_events(s)[-1].token_ids for s in greedy] == baseline[:6]
        samples.append(_events(sampled)[-1].token_ids)
        assert watch.violations == []
        assert (_counter(eng, "two_batch_steps") > 0) == two_batch
    assert samples[0] == samples[1]


def test_switching_between_plain_and_two_batch_steps(baseline):
    """The draft-length policy turns speculation off and on (a cost table that makes drafting
    pay only at some batch sizes): plain overlapped steps and two-batch halves alternate, each
    switch reading what is in flight. Output unchanged; every token reported to the policy
    exactly once."""
    eng = _engine()
    policy = eng.executor.scheduler.policy
    policy.adaptive = True
    policy.measure_costs = False  # a GPU's table: the CPU forward is no host time there
    policy.seed_costs({1: 1e-3, 4: 1e-3, 8: 1.1e-3, 12: 1.2e-3, 16: 4e-3, 64: 16e-3, 1024: 0.3})
    watch = InFlightWatch(eng.runner)
    rates = RateLog(policy)
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert _counter(eng, "two_batch_steps") > 0 and _counter(eng, "overlapped_steps") > 0
    assert rates.generated == sum(len(t) for t in out)
    assert watch.violations == []


@pytest.mark.parametrize("where", ["launch", "read"])
def test_a_step_that_raises_is_retried_after_the_other_half_is_read(baseline, where):
    """Every fifth launch (or read) of a half raises: the other half is read first (nothing
    else may use the staging buffers while it runs), then the failed rows are retried
    without drafts. Output unchanged, no launch while a twin is unread, every token reported
    once, no KV block leaked (run_to_completion)."""
    eng = _engine()
    ex = eng.executor
    watch = InFlightWatch(eng.runner)
    rates = RateLog(ex.scheduler.policy)
    calls = [0]

    def faulty(real):
        def call(*args, **kw):
            calls[0] += 1
            if calls[0] % 5 == 0 and watch.in_flight:  # while a half is on the device
                raise RuntimeError(f"injected {where} failure")
            return real(*args, **kw)

        return call

    if where == "launch":
        ex.drafts.prepare = faulty(ex.drafts.prepare)  # raises inside the launch's try
    else:
        ex.verifier.verify = faulty(ex.verifier.verify)  # raises while a half is read
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert watch.violations == []
    assert rates.generated == sum(len(t) for t in out)
    assert calls[0] > 5 and _counter(eng, "two_batch_steps") > 0
