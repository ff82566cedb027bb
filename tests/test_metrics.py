"""Metrics and the request log through the public seams: a real target on loopback, scraped
over HTTP at /metrics, after a mix of finished and cancelled streams."""

from __future__ import annotations

import json
import logging
import sys
import urllib.request
from collections import defaultdict

import pytest
from procs import free_port, output_tail, running_service, wait_until
from prometheus_client.parser import text_string_to_metric_families

from specwire.common.client import GenerationClient, build_request
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer

MODEL = "tiny-random"
SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
PROMPT = [5, 6, 7, 8] * 3  # repetitive: the n-gram drafter drafts from the first step


class Scrape:
    """One scrape of /metrics: `value(name, **labels)` sums the matching samples."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as reply:
            self.families = list(text_string_to_metric_families(reply.read().decode()))

    def samples(self, name: str):
        return [s for f in self.families for s in f.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        found = [
            s.value
            for s in self.samples(name)
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert found, f"no sample {name}{labels}"
        return sum(found)

    def by_position(self, name: str) -> list[float]:
        pos = {int(s.labels["position"]): s.value for s in self.samples(name)}
        return [pos[i] for i in range(len(pos))]


@pytest.fixture()
def target(tiny):
    """A fresh target (counters start at zero) with two batch slots and its /metrics URL."""
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    cfg = TargetConfig(
        model=MODEL, drafter="ngram", max_draft_len=4, max_batch_size=2, progress=False
    )
    engine = build_engine(cfg, loaded=tiny)
    srv.attach(engine)
    http = engine.executor.metrics.serve(0, "127.0.0.1")
    with GenerationClient(f"127.0.0.1:{srv.port}", timeout=60) as client:
        yield client, f"http://127.0.0.1:{http.server_port}/metrics", engine
    http.shutdown()
    http.server_close()
    srv.stop(0)


def _open(client: GenerationClient, rid: str, first_chunk: bool = True, **kwargs):
    """Start a long stream; with `first_chunk`, return once its first chunk arrived."""
    call = client.stub.Generate(
        build_request(token_ids=PROMPT, ignore_eos=True, request_id=rid, **kwargs)
    )
    if first_chunk:
        assert next(call).WhichOneof("response") == "chunk"
    return call


def test_gauges_go_idle_and_histograms_count_every_request_after_cancels(target, caplog):
    client, url, engine = target
    caplog.set_level(logging.DEBUG, logger="specwire.target_service.requests")
    total_blocks = engine.kv.num_blocks
    # Finished requests: three alone and one with n=2 (two completions).
    for i in range(3):
        res = client.generate(
            token_ids=PROMPT, max_new_tokens=16, ignore_eos=True, request_id=f"ok-{i}"
        )
        assert res.finish_reason == "length"
    replies = list(
        client.stream(
            build_request(token_ids=PROMPT, max_new_tokens=6, ignore_eos=True, n=2, request_id="n2")
        )
    )
    assert sum(r.WhichOneof("response") == "complete" for r in replies) == 2
    # Two long streams fill both batch slots; a third waits in the queue.
    long = dict(max_new_tokens=1500, speculate=False)
    a, b = _open(client, "cancel-a", **long), _open(client, "cancel-b", **long)
    queued = _open(client, "cancel-queued", first_chunk=False, max_new_tokens=8)
    wait_until(
        lambda: (
            (s := Scrape(url)).value("specwire_waiting_requests") == 1
            and s.value("specwire_running_requests") == 2
        ),
        timeout=30,
        interval=0.05,
        what="two running requests and one waiting",
    )
    assert Scrape(url).value("specwire_kv_free_blocks") < total_blocks - 1
    # Cancel the queued one first and see it leave the queue while the batch is still full,
    # so it never gets a token; then the running two, mid-stream.
    queued.cancel()
    wait_until(
        lambda: Scrape(url).value("specwire_waiting_requests") == 0,
        timeout=30,
        interval=0.05,
        what="the cancelled request to leave the queue",
    )
    a.cancel()
    b.cancel()  # nothing runs after these cancels: the gauges must not wait for a step
    requests = 8  # 3 cancelled + 3 + 2 finished

    def idle() -> bool:
        s = Scrape(url)
        return (
            s.value("specwire_running_requests") == 0
            and s.value("specwire_waiting_requests") == 0
            and s.value("specwire_request_success_total") == requests
        )

    wait_until(idle, timeout=30, interval=0.05, what="the target to go idle")
    s = Scrape(url)
    # Gauges are back at idle values.
    assert s.value("specwire_kv_free_blocks") == total_blocks - 1
    assert s.value("specwire_kv_cache_usage_ratio") == 0
    # Every request ended once, under its reason; every per-request histogram counted it.
    assert s.value("specwire_request_success_total", reason="length") == 5
    assert s.value("specwire_request_success_total", reason="cancelled") == 3
    for name in (
        "specwire_e2e_request_latency_seconds",
        "specwire_request_prompt_tokens",
        "specwire_request_generation_tokens",
    ):
        assert s.value(f"{name}_count") == requests, name
    assert s.value("specwire_request_prompt_tokens_sum") == requests * len(PROMPT)
    # Seven requests got a first token (the queued one never ran); each was scheduled once.
    assert s.value("specwire_time_to_first_token_seconds_count") == 7
    assert s.value("specwire_request_queue_time_seconds_count") == 7
    assert s.value("specwire_prompt_tokens_total") == 7 * len(PROMPT)
    # Without stop strings every committed token reached its client.
    assert s.value("specwire_generated_tokens_total") == s.value(
        "specwire_request_generation_tokens_sum"
    )
    assert s.value("specwire_inter_token_latency_seconds_count") > 0
    # Acceptance per draft position: position i is drafted (and accepted) only after i - 1.
    drafted = s.by_position("specwire_draft_tokens_by_position_total")
    accepted = s.by_position("specwire_accepted_tokens_by_position_total")
    # (greedy tiny-random continues PROMPT so that the n-gram drafter's first guesses land)
    assert len(drafted) == len(accepted) == 4 and accepted[0] > 0
    assert all(acc <= d for acc, d in zip(accepted, drafted, strict=True))
    assert drafted == sorted(drafted, reverse=True) and accepted == sorted(accepted, reverse=True)
    assert sum(drafted) == s.value("specwire_draft_tokens_total")
    assert sum(accepted) == s.value("specwire_accepted_tokens_total")
    # Speculative steps are synchronous: each is one of the steps, timed on its own too.
    assert 0 < s.value("specwire_sync_step_seconds_count") <= s.value("specwire_steps_total")
    # The draft-length policy says what steps ran with: static on the CPU, so K, or 0 for a
    # step no request drafts in (a prefill: overlapped); a drafting step is synchronous.
    chosen = {
        int(x.labels["k"]): x.value
        for x in s.samples("specwire_draft_policy_draft_len_steps_total")
    }
    assert sorted(chosen) == list(range(5)) and chosen[4] > 0
    assert chosen[1] == chosen[2] == chosen[3] == 0
    assert chosen[0] + chosen[4] <= s.value("specwire_steps_total")
    assert chosen[4] <= s.value("specwire_sync_step_seconds_count")
    assert s.value("specwire_draft_policy_mode", mode="spec") == 1.0
    assert s.value("specwire_draft_policy_mode", mode="plain") == 0.0
    # (a static policy measures no windows: it drafts K whatever it would measure)
    assert s.value("specwire_draft_policy_steps_total") == 0.0
    # ... and its acceptance estimates: per draft, has a draft, and past the first draft (K = 4)
    estimates = {x.labels["estimate"] for x in s.samples("specwire_draft_policy_acceptance")}
    assert estimates == {"a", "p", "d1", "d2", "d3"}
    # Every sample of every family carries the model label.
    assert all(
        sample.labels.get("model") == MODEL
        for family in s.families
        if family.name.startswith("specwire_")
        for sample in family.samples
    )
    # The request log: admitted and (for cancels) cancelled at DEBUG, one INFO line at the end.
    logged = defaultdict(list)
    for rec in caplog.records:
        if rec.name == "specwire.target_service.requests":
            logged[rec.levelname].append(rec)
    ids = {"cancel-a", "cancel-b", "cancel-queued", "ok-0", "ok-1", "ok-2", "n2/0", "n2/1"}
    assert sorted(r.request_id for r in logged["DEBUG"] if "admitted" in r.getMessage()) == sorted(
        ids
    )
    assert {r.request_id for r in logged["DEBUG"] if "cancelled" in r.getMessage()} == {
        "cancel-a",
        "cancel-b",
        "cancel-queued",
    }
    finished = {r.request_id: r for r in logged["INFO"]}
    assert len(logged["INFO"]) == requests and set(finished) == ids
    assert finished["cancel-queued"].ttft_s is None
    assert finished["cancel-queued"].completion_tokens == 0
    for rid in ids - {"cancel-queued"}:
        rec = finished[rid]
        assert rec.ttft_s is not None and rec.ttft_s <= rec.total_s
        assert rec.prompt_tokens == len(PROMPT)
    assert finished["ok-0"].finish_reason == "length" and finished["ok-0"].completion_tokens == 16
    assert finished["cancel-a"].finish_reason == "cancelled"
    assert sum(r.draft_tokens for r in finished.values()) == s.value("specwire_draft_tokens_total")


def test_cli_json_request_log_and_labelled_metrics():
    """`specwire --log-format json target --metrics-port P`: the finished request's log line is
    a JSON object with its fields, and the metrics port serves the labelled families."""
    port = free_port()
    cmd = SPECWIRE + [
        "--log-format",
        "json",
        "--log-level",
        "INFO",
        "target",
        "--model",
        MODEL,
        "--port",
        "0",
        "--no-progress",
        "--max-context-len",
        "256",
        "--metrics-port",
        str(port),
    ]
    with running_service(cmd, None, r"listening on ([\d.]+:\d+)", timeout=120) as (proc, m):
        with GenerationClient(m.group(1), timeout=60) as client:
            res = client.generate(
                token_ids=PROMPT, max_new_tokens=5, ignore_eos=True, request_id="json-1"
            )
        assert res.finish_reason == "length"
        s = Scrape(f"http://127.0.0.1:{port}/metrics")
        assert s.value("specwire_request_success_total", reason="length", model=MODEL) == 1
        assert s.value("specwire_time_to_first_token_seconds_count", model=MODEL) == 1
        wait_until(lambda: "json-1" in output_tail(proc), timeout=10, what="the request log line")
        lines = [ln.removeprefix("[stderr] ") for ln in output_tail(proc).splitlines()]
    records = [json.loads(ln) for ln in lines if ln.startswith("{")]
    mine = [r for r in records if r.get("request_id") == "json-1"]
    assert len(mine) == 1, lines
    rec = mine[0]
    assert rec["level"] == "INFO" and rec["logger"] == "specwire.target_service.requests"
    assert rec["finish_reason"] == "length"
    assert rec["prompt_tokens"] == len(PROMPT) and rec["completion_tokens"] == 5
    assert 0 <= rec["ttft_s"] <= rec["total_s"]
    assert rec["draft_tokens"] >= rec["accepted_tokens"] >= 0
    assert "acceptance_rate" in rec


def test_observing_a_step_of_latencies_at_once_equals_one_at_a_time() -> None:
    """`observe_many` (a whole step's inter-token latencies, one lock per bucket) exports
    exactly what observing each value does, bucket edges included."""
    from prometheus_client import CollectorRegistry, Histogram

    from specwire.target_service.metrics import observe_many

    values = [0.0, 0.001, 0.0015, 0.002, 0.0025, 0.05, 0.05, 3.0, 1e9]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("lat", "x", buckets=(0.001, 0.002, 0.05, 1.0), registry=one)
    h2 = Histogram("lat", "x", buckets=(0.001, 0.002, 0.05, 1.0), registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values)
    observe_many(h2, [])

    def samples(reg):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        }

    assert samples(many) == samples(one)
    assert samples(one)[("lat_bucket", (("le", "0.002"),))] == 4.0


def test_batched_step_metrics_are_exported_by_the_next_scrape() -> None:
    """The executor's per-step updates are buffered (`TargetMetrics.batched`): a scrape adds
    whatever is buffered before reading, so it sees every update made before it, once."""
    from specwire.target_service.metrics import TargetMetrics

    m = TargetMetrics("m")
    labels = {"model": "m"}

    def value(name: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    m.on_step(0.0012, 0.0003)
    m.on_generated(5)
    m.observe_itl([0.001, 0.002])
    assert value("specwire_steps_total") == 1
    assert value("specwire_generated_tokens_total") == 5
    assert value("specwire_step_seconds_sum") == pytest.approx(0.0012)
    assert value("specwire_inter_token_latency_seconds_count") == 2
    assert value("specwire_steps_total") == 1  # a second scrape adds nothing twice
    for _ in range(m.batched.FLUSH_EVERY):
        m.on_generated(1)
    assert value("specwire_generated_tokens_total") == 5 + m.batched.FLUSH_EVERY


def test_acceptance_by_position_counts_every_row_at_each_of_its_positions():
    """`specwire_{draft,accepted}_tokens_by_position_total` from steps of rows of mixed draft
    lengths (0 included, and a row longer than any before it), against a row-by-row count."""
    import random

    from prometheus_client import generate_latest

    from specwire.target_service.metrics import TargetMetrics

    metrics = TargetMetrics("m")
    rng = random.Random(3)
    want_d, want_a = [0] * 12, [0] * 12
    for step in range(40):
        rows = []
        for _ in range(rng.randrange(1, 9)):
            d = rng.randrange(0, 6 if step < 20 else 12)
            a = rng.randrange(0, d + 1)
            rows.append((d, a))
            for i in range(d):
                want_d[i] += 1
            for i in range(a):
                want_a[i] += 1
        metrics.on_verified(rows)
    text = generate_latest(metrics.registry).decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_by_position_total"):
                got.setdefault(s.name, {})[int(s.labels["position"])] = s.value
    drafted = got["specwire_draft_tokens_by_position_total"]
    accepted = got["specwire_accepted_tokens_by_position_total"]
    assert [drafted.get(i, 0) for i in range(12)] == want_d
    assert [accepted.get(i, 0) for i in range(12)] == want_a
    assert want_d[10] > 0  # the longer rows of the second half were counted
