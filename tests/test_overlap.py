"""Overlapped steps are lossless: a step launched before the previous one's tokens are read
gives, token for token, what synchronous steps give — with late EOS, preemption, cancellation,
sampled neighbours and the switch to and from speculative (synchronous) steps. And a
synchronous step's output is rendered while the next step runs, not in its host work.

Real engines (tiny-random on the CPU, fp32). The CPU computes a step synchronously, but the
executor's bookkeeping is the GPU's: optimistic commits, placeholders fed from the previous
step's argmax, results read one step late.
"""

from __future__ import annotations

import time

import pytest
from engine_driver import counter as _counter
from engine_driver import run_to_completion, tiny_engine
from lossless_prompts import lossless_prompts

from specwire.target_service.output import Chunk, Complete
from specwire.target_service.request import SamplingConfig

PROMPTS = lossless_prompts(24)


def _engine(drafter="none", overlap=True, **kw):
    return tiny_engine(drafter, overlap=overlap, **kw)


def _overlapped(engine) -> float:
    return _counter(engine, "overlapped_steps")


@pytest.fixture(scope="module")
def baseline():
    eng = _engine(overlap=False)
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert _overlapped(eng) == 0
    return out


def test_overlapped_equals_synchronous(baseline):
    eng = _engine()
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    # Nearly every step overlapped (all are plain greedy steps).
    assert _overlapped(eng) >= 0.9 * _counter(eng, "steps") > 0


def test_late_eos_drops_the_extra_row(baseline):
    """EOS is only seen when a step's tokens are read, after the next step was launched with
    the request in it: that row is computed and dropped, nothing more is emitted."""
    # Make tokens that really occur mid-output end-of-sequence tokens.
    eos = {out[5] for out in baseline[:6]}
    expected, ends = [], 0
    for out in baseline:
        cut = next((i for i, t in enumerate(out) if t in eos), None)
        expected.append(out if cut is None else out[: cut + 1])
        ends += cut is not None
    assert any(len(e) < len(b) for e, b in zip(expected, baseline, strict=True))
    results = {}
    for overlap in (False, True):
        eng = _engine(overlap=overlap)
        eng.executor.make_stream.eos_ids = eos
        done = run_to_completion(eng, PROMPTS, max_new_tokens=20)
        results[overlap] = [c.token_ids for c in done]
        reasons = [c.finish_reason for c in done]
        assert reasons.count("eos") == ends
    assert results[True] == results[False] == expected


def test_preemption_while_a_step_is_in_flight(baseline):
    """Too few KV blocks: requests are preempted (and recomputed) while their last token is
    still being computed; the recompute feeds it from the step in flight."""
    eng = _engine(num_kv_blocks=24, max_batch_size=8)
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert _counter(eng, "preemptions") > 0
    assert _overlapped(eng) > 0


def test_cancel_while_in_flight_keeps_the_others(baseline):
    eng = _engine()
    tok = eng.loaded.tokenizer
    ex = eng.executor
    streams = [
        ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20, speculate=False))
        for p in PROMPTS[:8]
    ]
    ex.run_until_idle(max_steps=6)  # every plain step leaves the next one in flight
    assert _overlapped(eng) > 0 and not ex.idle
    victim = streams[3].request.request_id
    ex.cancel(victim)
    ex.run_until_idle()
    for i, s in enumerate(streams):
        events = []
        while not s.events.empty():
            events.append(s.events.get())
        last = events[-1]
        assert isinstance(last, Complete)
        if i == 3:
            assert last.finish_reason == "cancelled"
        else:
            assert last.token_ids == baseline[i]
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1


def test_sampled_neighbours_turn_overlap_off_and_back_on(baseline):
    """A sampled request needs its logits on the host: while one runs, steps are synchronous;
    greedy neighbours are unchanged and the seeded sample equals the same seed without overlap."""
    outs = {}
    for overlap in (False, True):
        eng = _engine(overlap=overlap)
        tok = eng.loaded.tokenizer
        ex = eng.executor
        sampled = ex.submit(
            eng.new_request(
                tok.encode("a sampled neighbour"),
                max_new_tokens=6,
                sampling=SamplingConfig(temperature=0.8, seed=7),
            )
        )
        greedy = [
            ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20, speculate=False))
            for p in PROMPTS[:6]
        ]
        ex.run_until_idle()
        got = []
        for s in [sampled, *greedy]:
            events = []
            while not s.events.empty():
                events.append(s.events.get())
            assert isinstance(events[-1], Complete)
            got.append(events[-1].token_ids)
        assert got[1:] == baseline[:6]
        outs[overlap] = (got[0], _overlapped(eng))
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] > 0  # overlap resumed once the sampled request finished


def test_adaptive_policy_switches_between_drafting_and_overlap(baseline):
    """With a cost table that makes drafting pay only sometimes, steps alternate between
    speculative (synchronous) and plain (overlapped) ones; output is unchanged."""
    eng = _engine(drafter="ngram")
    policy = eng.executor.scheduler.policy
    policy.adaptive = True
    policy.measure_costs = False  # a GPU's table: the CPU forward is no host time there
    # Steep costs past 12 tokens: big batches verify without drafts, small ones draft.
    policy.seed_costs({1: 1e-3, 4: 1e-3, 8: 1.1e-3, 12: 1.2e-3, 16: 4e-3, 64: 16e-3, 1024: 0.3})
    # The drafter hears every launch, overlapped or synchronous (`Drafter.launched`, where a
    # remote drafter sends a question it held back), right after it.
    events: list[str] = []
    forward = eng.runner.forward

    def launch(*args, **kw):
        events.append("launch")
        return forward(*args, **kw)

    eng.runner.forward = launch
    eng.drafter.launched = lambda: events.append("launched")
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS, max_new_tokens=20)]
    assert out == baseline
    assert _overlapped(eng) > 0
    assert eng.executor.stats.draft_tokens > 0  # and some steps speculated
    assert events and events == ["launch", "launched"] * (len(events) // 2)


@pytest.mark.parametrize("overlap", [True, False])
def test_every_token_after_the_first_is_one_inter_token_latency(overlap):
    """TTFT once per request, an inter-token latency for every later token — whether the
    step is synchronous (`emit`) or overlapped (`resolve`); both observe a whole step's
    latencies at once."""
    eng = _engine(overlap=overlap)
    done = run_to_completion(eng, PROMPTS[:6], max_new_tokens=12)
    metrics = eng.executor.metrics
    labels = {"model": metrics.model}

    def sample(name: str) -> float:
        return metrics.registry.get_sample_value(name, labels)

    tokens = sum(len(c.token_ids) for c in done)
    assert sample("specwire_time_to_first_token_seconds_count") == len(done) == 6
    assert sample("specwire_inter_token_latency_seconds_count") == tokens - len(done) > 0
    assert sample("specwire_inter_token_latency_seconds_sum") > 0
    assert (_overlapped(eng) > 0) == overlap


@pytest.mark.parametrize("overlap", [True, False])
def test_steps_of_requests_without_speculation_are_no_evidence_about_it(overlap):
    """On a server with a drafter, requests that all turned speculation off decode plainly in
    the speculative mode: the executor reports their steps as ones where nobody may draft, so
    speculation's rate and a synchronous step's host time learn nothing from them."""
    eng = _engine(drafter="ngram", overlap=overlap)
    policy = eng.executor.scheduler.policy
    policy.adaptive = True
    policy.mode_window = policy.first_window = 4  # windows end well within this run
    policy.seed_costs({1: 1e-3, 4: 1e-3, 8: 1.1e-3, 64: 16e-3, 1024: 0.3})
    tok = eng.loaded.tokenizer
    ex = eng.executor
    for p in PROMPTS[:8]:
        ex.submit(eng.new_request(tok.encode(p), max_new_tokens=20, speculate=False))
    ex.run_until_idle()
    assert policy.mode == "spec" and policy.rates == {} and policy.host == {}
    assert ex.stats.draft_tokens == 0


def test_a_synchronous_steps_output_is_rendered_while_the_next_step_runs():
    """A synchronous step's tokens go to the output thread when the next step is launched, not
    at its commit: rendered at once, the output thread took the GIL at the executor's first
    syscall and its rendering ran inside the next step's host work (bench/RESULTS.md, round
    41). So at every launch the step just committed is not rendered yet, even after a wait
    that lets go of the GIL; and nothing held is lost: every token reaches the stream. Run on
    the executor's own thread (run_until_idle releases the output at every step)."""
    eng = _engine(drafter="ngram", overlap=True)
    ex = eng.executor
    tok = eng.loaded.tokenizer
    req = eng.new_request(tok.encode(PROMPTS[0]), max_new_tokens=24)
    seen: list[tuple[int, int]] = []  # per launch: (tokens committed, tokens rendered)
    forward = ex.runner.forward

    def launch(rows, tables):
        # A call that lets go of the GIL on the way to the launch, as a remote drafter's
        # syscalls or a torch call do: an output thread holding work renders it meanwhile.
        time.sleep(0.02)
        stream = ex.streams.get(req.request_id)
        if stream is not None and req.output_ids:
            seen.append((len(req.output_ids), stream.num_rendered))
        return forward(rows, tables)

    ex.runner.forward = launch
    ex.start()
    try:
        stream = ex.submit(req)
        events = []
        while not events or not isinstance(events[-1], Complete):
            events.append(stream.events.get(timeout=30))
    finally:
        ex.shutdown()
    assert ex.stats.draft_tokens > 0  # synchronous, drafting steps
    assert len(seen) >= 3
    assert all(rendered < committed for committed, rendered in seen), seen
    done = events[-1]
    streamed = [t for e in events if isinstance(e, Chunk) for t in e.token_ids]
    assert streamed == done.token_ids and len(streamed) == done.completion_tokens > 0
