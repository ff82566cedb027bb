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
    """Wraps the runner: records every launch's requests and which launches are unread, and
    fails the test if a launch holds a request of an unread one, or if more than two steps
    are ever unread (the graphs' two sets of staging buffers)."""

    def __init__(self, runner) -> None:
        self.unread: dict[int, set[str]] = {}  # id(StepLogits) -> its requests
        self.launches = 0
        self.most_unread = 0
        self.violations: list[str] = []
        forward, wait = runner.forward, runner.wait

        def watched_forward(rows, tables, *args, **kw):
            ids = {row.request.request_id for row in rows}
            for other in self.unread.values():
                if ids & other:
                    self.violations.append(f"launch {self.launches} reuses {ids & other}")
            logits = forward(rows, tables, *args, **kw)
            self.unread[id(logits)] = ids
            self.launches += 1
            self.most_unread = max(self.most_unread, len(self.unread))
            return logits

        def watched_wait(logits):
            self.unread.pop(id(logits), None)
            return wait(logits)

        runner.forward, runner.wait = watched_forward, watched_wait


@pytest.fixture(scope="module")
def baseline():
    eng = _engine(drafter="none", two_batch=False, overlap=False)
    return [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]


def test_two_batch_equals_plain_decoding(baseline):
    eng = _engine()
    watch = InFlightWatch(eng.runner)
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert watch.violations == []
    assert watch.most_unread == 2  # a half was launched while the other was unread
    assert _counter(eng, "two_batch_steps") >= 0.8 * _counter(eng, "steps") > 0
    stats = eng.executor.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0  # it did speculate


def test_off_by_default_and_with_no_overlap(baseline):
    for kw in ({"two_batch": False}, {"overlap": False}):
        eng = _engine(**kw)
        watch = InFlightWatch(eng.runner)
        out = [c.token_ids for c in run_to_completion(eng, PROMPTS[:8], max_new_tokens=20)]
        assert out == baseline[:8]
        assert _counter(eng, "two_batch_steps") == 0
        assert watch.most_unread <= 2  # plain overlapped steps: at most one ahead


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
    streams = [ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20)) for p in PROMPTS[:8]]
    ex.run_until_idle(max_steps=5)
    spec = ex._inflight_spec
    assert spec is not None and not ex.idle
    victim = next(s for s in streams if s.request.request_id in spec.ids)
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


def test_a_sampled_neighbour_turns_it_off_and_greedy_output_is_unchanged(baseline):
    """A sampled request's tokens come from its logits on the host, which the next half's
    launch would overwrite: while it runs, speculative steps are synchronous."""
    eng = _engine()
    tok, ex = eng.loaded.tokenizer, eng.executor
    sampled = ex.submit(
        eng.new_request(
            tok.encode("a sampled neighbour"),
            max_new_tokens=30,
            sampling=SamplingConfig(temperature=0.8, seed=7),
        )
    )
    greedy = [ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20)) for p in PROMPTS[:6]]
    ex.run_until_idle()
    assert isinstance(_events(sampled)[-1], Complete)
    assert [_events(s)[-1].token_ids for s in greedy] == baseline[:6]
    assert _counter(eng, "two_batch_steps") == 0
