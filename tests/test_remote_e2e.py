"""End to end: the real target engine drafting from a real drafter service over loopback gRPC.

Lossless with remote n-gram and remote model drafters (stream, relay, socket and unary), a
drafter killed and restarted mid-generation, a drafter slower than the deadline, malformed
drafter replies, and the target's CLI refusing a mismatched drafter. Every check compares
token ids with decoding without speculation; counters come from the drafter client and
GetModelInfo.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from lossless_prompts import lossless_prompts
from procs import free_port, running_service, wait_until
from remote_harness import Sockets, record_prices

from specwire.common.client import GenerationClient
from specwire.common.drafting import PROTOCOL_VERSION
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.drafters import NGramDrafter
from specwire.drafter_service.engine import DraftEngine
from specwire.drafter_service.server import response_to_proto, serve, updates_from_proto
from specwire.drafter_service.sessions import SessionStore
from specwire.target_service.config import TargetConfig
from specwire.target_service.drafters.remote import RemoteDrafter
from specwire.target_service.engine import build_engine
from specwire.target_service.output import Complete
from specwire.target_service.server import TargetServer

PROMPTS = lossless_prompts(50)
ROOT = Path(__file__).resolve().parent.parent
CODE = [0, 1, 6, 8, 14]  # indices of the code prompts (Python, SQL, HTML)
TINY_VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # tiny-random is too small to gain from intra-op threads, and on a busy 2-core machine
    # OpenMP threads spinning against another process make each step many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def drafters():
    """Start drafter services in-process, each also on a unix socket of its own (one per port:
    a service restarted on its port comes back on its socket); all are stopped at the end of
    the test."""
    started = []
    sockets = Sockets()

    def start(port: int = 0, instance=None, **overrides):
        overrides.setdefault("socket", sockets.path(port, len(started)))
        cfg = DrafterServiceConfig(host="127.0.0.1", port=port, **overrides)  # cap: 16
        server = serve(cfg, instance)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(None)
    sockets.remove()


def via(server, mode: str) -> dict:
    """The target's settings that reach `server` in `mode` (socket: on its unix socket)."""
    return {
        "drafter_mode": mode,
        "drafter_socket": server.config.socket if mode == "socket" else "",
    }


def engine(loaded, drafter: str, model: str = "tiny-random", **kw):
    deadline = kw.pop("deadline_ms", 2000)
    cfg = TargetConfig(
        model=model,
        drafter=drafter,
        max_draft_len=4,
        progress=False,
        max_context_len=512,
        drafter_deadline_ms=deadline,
        # Every reply waited for unless a test says otherwise: acceptance counts then do not
        # depend on whether a reply beat a millisecond step (the auto patience's own tests are
        # in test_remote_drafter.py and below).
        drafter_patience_ms=kw.pop("drafter_patience_ms", deadline),
        **kw,
    )
    return build_engine(cfg, loaded=loaded)


def submit_all(eng, prompts, max_new_tokens):
    tok = eng.loaded.tokenizer
    return [
        eng.executor.submit(eng.new_request(tok.encode(p), max_new_tokens=max_new_tokens))
        for p in prompts
    ]


def completions(streams) -> list[Complete]:
    out = []
    for s in streams:
        events = []
        while not s.events.empty():
            events.append(s.events.get())
        assert isinstance(events[-1], Complete), events[-1]
        out.append(events[-1])
    return out


def run_all(eng, prompts, max_new_tokens=24) -> list[Complete]:
    """Every prompt in flight at once, driven on this thread; KV is checked afterwards."""
    streams = submit_all(eng, prompts, max_new_tokens)
    eng.executor.run_until_idle()
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1, "KV blocks leaked"
    return completions(streams)


@pytest.fixture(scope="module")
def baseline(tiny):
    """Token ids without speculation: 50 prompts x 24 tokens, and 6 prompts x 150 tokens."""
    eng = engine(tiny, "none")
    short = [c.token_ids for c in run_all(eng, PROMPTS)]
    long = [c.token_ids for c in run_all(eng, PROMPTS[:6], 150)]
    eng.shutdown()
    return {"short": short, "long": long}


@pytest.fixture
def served(tiny):
    """A TargetServer around a tiny-random engine with the given drafter, and a client."""
    servers, clients = [], []

    def start(drafter: str, **kw):
        srv = TargetServer("127.0.0.1", 0)
        srv.start()
        srv.attach(engine(tiny, drafter, **kw))
        client = GenerationClient(f"127.0.0.1:{srv.port}", timeout=120)
        servers.append(srv)
        clients.append(client)
        return client

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.stop(0)


def step_until(ex, predicate, what: str, max_steps: int = 100) -> None:
    """Run executor steps on this thread until `predicate()` holds (or fail)."""
    for _ in range(max_steps):
        if predicate():
            return
        ex.run_until_idle(max_steps=1)
    raise AssertionError(f"{what}: not after {max_steps} steps")


def generate_concurrently(client, prompts, max_new_tokens=24):
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_new_tokens=max_new_tokens), prompts))


# -- lossless over 50 prompts --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ngram", "model:tiny-random"])
@pytest.mark.parametrize("mode", ["stream", "relay", "socket", "unary"])
def test_remote_drafter_is_lossless_over_50_prompts(tiny, baseline, drafters, kind, mode):
    server = drafters(drafter=kind)
    eng = engine(tiny, f"grpc://{server.address}", **via(server, mode))
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    assert sum(results[i].stats.accepted_tokens for i in CODE) > 0, "no drafts accepted on code"
    c = eng.drafter.counters()
    assert c["failed"] == c["stale"] == c["unknown_request"] == 0 and c["reconnects"] == 1
    # Drafting off the critical path: most steps' drafts were asked for when the previous step
    # committed its tokens (`submit`) and only collected by the step that uses them.
    assert c["prefetched"] > 0
    # Look-ahead (n-gram: K+1 more tokens per proposal): steps that accepted every draft took
    # the next drafts from the kept proposal, without asking; output unchanged (above). (A
    # model drafter's proposals are used past their start too, after a deferred reply.)
    # On the unix socket each reply is back before the next step is built, so every step
    # drafts from a fresh proposal's start instead.
    if kind == "ngram" and mode != "socket":
        assert c["lookahead"] > 0
    stats = eng.executor.stats
    assert 0 < stats.accepted_tokens <= stats.draft_tokens and stats.refused_draft_tokens == 0
    # The target is idle now, and no step will carry another message: the `finished` notices
    # went out as the requests were freed, so the drafter holds no session (not for its TTL).
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


def test_a_synchronous_steps_ask_is_timed_for_a_remote_drafter_only(tiny, drafters):
    """`specwire_drafter_ask_seconds`: what a synchronous step spent after its commit telling
    the remote drafter what it committed and asking for the next drafts, the part of the
    drafter's exposed time `specwire_draft_seconds` (drafts taken before the launch) leaves
    out. An in-process drafter asks nothing after the commit: no samples."""
    server = drafters()
    remote, local = engine(tiny, f"grpc://{server.address}"), engine(tiny, "ngram")

    def sample(eng, name: str) -> float:
        eng.executor.metrics.batched.flush()
        got = eng.executor.metrics.registry.get_sample_value(name, {"model": "tiny-random"})
        return got or 0.0

    for eng in (remote, local):
        run_all(eng, PROMPTS[:8])
        assert sample(eng, "specwire_draft_seconds_count") > 0  # both drafted
    asks = sample(remote, "specwire_drafter_ask_seconds_count")
    assert asks > 0 and 0 < sample(remote, "specwire_drafter_ask_seconds_sum") < asks * 0.05
    assert sample(local, "specwire_drafter_ask_seconds_count") == 0
    remote.shutdown()
    local.shutdown()


def test_the_drafter_hears_a_step_before_its_bookkeeping(tiny, baseline, drafters, monkeypatch):
    """A synchronous step tells the remote drafter what it committed as soon as the tokens are
    on their streams, before the step's acceptance is recorded (`emit`), so the round trip
    overlaps that bookkeeping (bench/RESULTS.md, round 42); and it never asks about a request
    the step's finish rules ended (that one gets its `finished` notice). Output unchanged.
    Every step synchronous (no overlap): each of a request's steps asks once."""
    asked: dict[str, list[int]] = {}  # request -> its stats.steps at each question
    ended: list[str] = []  # requests asked about after their last token
    submit = RemoteDrafter.submit

    def heard(self, requests):
        for r in requests:
            asked.setdefault(r.request_id, []).append(r.stats.steps)
            if len(r.output_ids) >= r.max_new_tokens:
                ended.append(r.request_id)
        return submit(self, requests)

    monkeypatch.setattr(RemoteDrafter, "submit", heard)
    server = drafters()
    eng = engine(tiny, f"grpc://{server.address}", overlap=False, **via(server, "socket"))
    got = [c.token_ids for c in run_all(eng, PROMPTS[:8])]
    eng.shutdown()
    assert got == baseline["short"][:8]
    assert len(asked) == 8 and not ended
    # At its k-th question a request has recorded k steps: the step being asked about is
    # recorded after the question (recorded first, the counts would be 1, 2, ...).
    for steps in asked.values():
        assert steps == list(range(len(steps))), steps


def test_a_request_that_arrives_during_a_step_is_asked_about_before_it_drafts(
    tiny, baseline, drafters
):
    """A request submitted while a speculative step runs is admitted by that step and the
    remote drafter is told its prompt then, so the step that ends its prefill drafts from a
    proposal already asked for, not from a round trip inside it. Output unchanged, no KV
    block leaked."""
    server = drafters()
    eng = engine(tiny, f"grpc://{server.address}", overlap=False, **via(server, "socket"))
    ex = eng.executor
    first = submit_all(eng, PROMPTS[:1], 24)
    ex.run_until_idle(max_steps=2)  # the prefill, then a speculative step
    assert not ex.idle and ex.scheduler.policy.mode == "spec"
    second = submit_all(eng, PROMPTS[1:2], 24)
    late = second[0].request
    ex.step()  # no inbox drained first: the step itself admits it, once launched
    assert late.num_computed == 0  # not scheduled yet...
    store = server.engine.store
    wait_until(lambda: store.get(late.request_id) is not None, timeout=10, what="the question")
    assert store.get(late.request_id).tokens == late.prompt_ids  # ...but the drafter knows it
    ex.run_until_idle()
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1, "KV blocks leaked"
    got = [c.token_ids for c in completions(first + second)]
    eng.shutdown()
    assert got == baseline["short"][:2]
    assert eng.drafter.counters()["failed"] == 0


@pytest.mark.parametrize("patience_ms", [2000, -1, "held"], ids=["wait", "auto", "held"])
@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_remote_drafter_with_the_two_batch_overlap_is_lossless(
    tiny, baseline, drafters, mode, patience_ms
):
    """Halves alternate: one half's drafts are asked for when it commits and collected when
    it is launched again, while the other half ran (auto patience waits there: the device is
    busy anyway). Output unchanged, nothing failed. "held": the auto patience's GPU regime
    forced (questions held for the next launch wherever no step is in flight: the halves'
    commits find the other half in flight and ask at once; a drain's commit holds)."""
    server = drafters(drafter="ngram")
    eng = engine(
        tiny,
        f"grpc://{server.address}",
        drafter_mode=mode,
        two_batch_rows=2,
        drafter_patience_ms=-1 if patience_ms == "held" else patience_ms,
    )
    busy = []
    if patience_ms == "held":

        def at_launch(device_busy: bool, covered, rows: int = 1) -> bool:
            busy.append(device_busy)
            return not device_busy

        eng.drafter.patience.at_launch = at_launch
    results = run_all(eng, PROMPTS)
    if patience_ms == "held":
        assert True in busy  # the halves' commits, with the other half in flight
    assert [c.token_ids for c in results] == baseline["short"]
    metrics = eng.executor.metrics
    labels = {"model": metrics.model}
    assert metrics.registry.get_sample_value("specwire_two_batch_steps_total", labels) > 0
    c = eng.drafter.counters()
    assert c["failed"] == c["stale"] == c["unknown_request"] == 0 and c["prefetched"] > 0
    assert 0 < eng.executor.stats.accepted_tokens
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


def _nothing_lost(eng, server) -> None:
    """No reply failed, went stale, named an unknown request or forced a resync; the
    drafter freed every session and its pool is intact; then the engine shuts down."""
    c = eng.drafter.counters()
    assert c["failed"] == c["stale"] == c["unknown_request"] == c["resynced"] == 0
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


def _lossless_at_once_and_long(eng, baseline) -> tuple:
    """The 50 prompts at once and 6 long ones give plain greedy decoding's output; the
    engine's metrics and their labels, for the test to read."""
    results = run_all(eng, PROMPTS)
    long = run_all(eng, PROMPTS[:6], 150)
    assert [c.token_ids for c in results] == baseline["short"]
    assert [c.token_ids for c in long] == baseline["long"]
    metrics = eng.executor.metrics
    return metrics, {"model": metrics.model}


def _adaptive(eng, costs: dict[int, float]) -> None:
    """The draft-length policy of a GPU target on this CPU engine: k per step from `costs`
    (token count -> seconds), held in the speculative mode (no mode windows end). The table
    stays as seeded: this CPU's forward runs inside a step's host time, which would otherwise
    price every synchronous step by it."""
    policy = eng.executor.scheduler.policy
    policy.adaptive, policy.mode_window, policy.first_window = True, 10**6, 10**6
    policy.measure_costs = False
    policy.seed_costs(costs)


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_plain_steps_keep_a_remote_drafter_current(tiny, baseline, drafters, mode):
    """Inside the speculative mode the policy may choose k = 0: those steps run plain and
    overlapped. The remote drafter still hears what each one committed (only the settled
    tokens, not the one in flight), so its proposals stay current for the next drafting step.
    Here the policy picks k = 0 for every step: all run plain, yet the drafter is asked
    and its replies collected; output unchanged, nothing refused."""
    server = drafters(drafter="ngram")
    eng = engine(tiny, f"grpc://{server.address}", drafter_mode=mode, drafter_patience_ms=-1)
    _adaptive(eng, {1: 1e-3, 1024: 0.3})
    policy = eng.executor.scheduler.policy
    policy.step_draft_len = lambda decode, prefill_tokens=0: 0  # k = 0, mode "spec"
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    stats = eng.executor.stats
    assert stats.draft_tokens == 0 and policy.mode == "spec"
    labels = {"model": eng.executor.metrics.model}
    registry = eng.executor.metrics.registry
    assert registry.get_sample_value("specwire_overlapped_steps_total", labels) > 0
    c = eng.drafter.counters()
    assert c["prefetched"] > 0, "plain steps did not reach the drafter"
    assert c["failed"] == c["stale"] == c["unknown_request"] == c["resynced"] == 0
    assert c["reconnects"] == 1
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


def test_remote_drafter_alternating_plain_and_drafting_steps_is_lossless(tiny, baseline, drafters):
    """Steep costs past 12 tokens: big batches verify without drafts (plain, overlapped, the
    drafter told), small ones draft from proposals those plain steps asked for."""
    server = drafters(drafter="ngram")
    eng = engine(tiny, f"grpc://{server.address}", drafter_patience_ms=-1)
    _adaptive(eng, {1: 1e-3, 4: 1e-3, 8: 1.1e-3, 12: 1.2e-3, 16: 4e-3, 64: 16e-3, 1024: 0.3})
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    labels = {"model": eng.executor.metrics.model}
    registry = eng.executor.metrics.registry
    assert registry.get_sample_value("specwire_overlapped_steps_total", labels) > 0
    assert eng.executor.stats.accepted_tokens > 0
    _nothing_lost(eng, server)


@pytest.mark.parametrize("mode", ["stream", "relay", "socket"])
def test_the_gain_rule_waits_by_the_policys_price_and_is_lossless(tiny, baseline, drafters, mode):
    """--drafter-wait-rule gain: before each drafting step the executor hands the drafter
    the policy's price of waiting for its drafts (`Drafter.wait_worth_s`), and the patience
    budgets by it. Here the price is positive on every drafting step (flat device costs:
    verifying drafts is free); output unchanged, drafts accepted, nothing failed."""
    server = drafters(drafter="ngram")
    eng = engine(
        tiny,
        f"grpc://{server.address}",
        **via(server, mode),
        drafter_patience_ms=-1,
        drafter_wait_rule="gain",
    )
    _adaptive(eng, {1: 1e-3, 4: 1e-3, 8: 1e-3, 64: 1e-3, 1024: 0.3})
    prices = record_prices(eng.drafter)
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    priced = [w for w in prices if w is not None]
    assert priced and min(priced) > 0, prices[:20]
    assert eng.executor.stats.accepted_tokens > 0
    _nothing_lost(eng, server)


@pytest.mark.parametrize("mode", ["stream", "relay", "socket", "unary"])
def test_questions_held_back_for_the_next_launch_are_lossless(tiny, baseline, drafters, mode):
    """The auto patience's GPU regime, where the next step would not wait for the reply: a
    question asked as a synchronous step commits goes out once the next step is launched
    (`Drafter.launched`), while one asked by an overlapped plain step's read goes at once (a
    step is in flight: the executor passes `device_busy`). The rule's outcome is forced here
    (a CPU step is too slow for that regime); the executor, the drafter service and the
    steps are real, plain and drafting steps alternating as in the test above. Output
    unchanged; questions went at launch and their replies drafted later steps; nothing
    failed; sessions freed."""
    server = drafters(drafter="ngram")
    eng = engine(tiny, f"grpc://{server.address}", **via(server, mode), drafter_patience_ms=-1)
    _adaptive(eng, {1: 1e-3, 4: 1e-3, 8: 1.1e-3, 12: 1.2e-3, 16: 4e-3, 64: 16e-3, 1024: 0.3})
    asked = []  # device_busy, per submit that found nothing in flight

    def at_launch(device_busy: bool, covered, rows: int = 1) -> bool:
        asked.append(device_busy)
        return not device_busy

    eng.drafter.patience.at_launch = at_launch
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    assert True in asked and False in asked  # both kinds of submit happened
    c = eng.drafter.counters()
    # Each question held back went out at the next launch (the run's last one may have no
    # step after it): none was dropped by the next commit for want of a launch.
    assert c["at_launch"] >= asked.count(False) - 1 > 0
    assert c["prefetched"] > 0 and c["lookahead"] > 0
    assert eng.executor.stats.accepted_tokens > 0
    assert c["failed"] == c["stale"] == c["unknown_request"] == c["resynced"] == 0
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


def test_two_questions_in_flight_are_lossless(tiny, baseline, drafters):
    """--drafter-max-inflight 2 with a drafter slower than a step (5 ms, never waited for):
    commits ask again while the previous question is unanswered, the stream answers both in
    order, and the replies draft later steps. Output unchanged; nothing failed, went stale or
    leaked; sessions freed."""
    server = drafters(drafter="ngram", delay_ms=5)
    eng = engine(tiny, f"grpc://{server.address}", drafter_patience_ms=0, drafter_max_inflight=2)
    drafter, seconds = eng.drafter, []
    conn = drafter.connection
    send = conn.send

    def counted(msg, awaited=True):  # how many were in flight when a question went out
        if awaited and conn.inflight:
            seconds.append(conn.inflight)
        return send(msg, awaited)

    conn.send = counted
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    assert seconds and max(seconds) == 1  # second questions went out, never a third
    c = drafter.counters()
    assert c["prefetched"] > 0 and eng.executor.stats.accepted_tokens > 0
    assert c["failed"] == c["stale"] == c["unknown_request"] == c["resynced"] == 0
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("patience_ms, delay_ms", [(0, 5), (-1, 50)], ids=["never", "auto"])
@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_remote_drafter_that_is_not_waited_for_is_lossless(
    tiny, baseline, drafters, mode, patience_ms, delay_ms
):
    """A drafter slower than a step (5 ms with --drafter-patience-ms 0; 50 ms with the auto
    patience, which then stops waiting once it has timed a step and a round trip): steps go
    without the drafts they asked for as the previous step committed, and the late replies
    draft the steps after. Output unchanged, nothing failed or leaked; with the 5 ms drafter
    drafts are still accepted (the 50 ms one answers for a prefix many steps old)."""
    server = drafters(drafter="ngram", delay_ms=delay_ms)
    eng = engine(
        tiny, f"grpc://{server.address}", drafter_mode=mode, drafter_patience_ms=patience_ms
    )
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    c = eng.drafter.counters()
    assert c["deferred"] > 0 and c["failed"] == c["stale"] == c["unknown_request"] == 0
    if patience_ms == 0:
        assert 0 < eng.executor.stats.accepted_tokens
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("patience_ms", [2000, 0], ids=["wait", "never"])
@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_remote_drafter_with_branches_is_lossless(tiny, baseline, drafters, mode, patience_ms):
    """Every message asks for branches (--drafter-branches 4), replies waited for or not:
    output unchanged, nothing failed or leaked. (Whether a step drafts from a branch or from
    a fresher reply depends on when replies arrive; test_remote_branches.py pins that down.)"""
    server = drafters(drafter="ngram")
    eng = engine(
        tiny,
        f"grpc://{server.address}",
        drafter_mode=mode,
        drafter_patience_ms=patience_ms,
        drafter_branches=4,
        max_batch_size=8,
    )
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == baseline["short"]
    c = eng.drafter.counters()
    assert c["failed"] == c["stale"] == c["unknown_request"] == 0 and c["prefetched"] > 0
    wait_until(lambda: len(server.engine.store) == 0, timeout=10, what="sessions freed")
    server.engine.check_integrity()
    eng.shutdown()


LOOKUP_PLUGIN = "examples.python.lookup_drafter:LastOccurrenceDrafter"


def test_a_plugin_written_once_runs_in_process_and_behind_the_drafter_service(tiny, baseline):
    """The same class, unchanged: `--drafter mod:Class` on the target, and `specwire drafter
    --drafter mod:Class` (a real process) behind `--drafter grpc://...`."""
    local = engine(tiny, LOOKUP_PLUGIN)
    in_process = run_all(local, PROMPTS)
    local.shutdown()
    cmd = [
        sys.executable,
        "-m",
        "specwire.common.cli",
        "drafter",
        "--port",
        "0",
        "--max-draft-len",
        "4",
    ]
    env = {"SPECWIRE_DRAFTER": LOOKUP_PLUGIN, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    pattern = r"listening on (127\.0\.0\.1:\d+) \(drafter=last-occurrence "
    with running_service(cmd, env, pattern, timeout=60, cwd=ROOT) as (_, match):
        eng = engine(tiny, f"grpc://{match.group(1)}")
        remote = run_all(eng, PROMPTS)
        counters = eng.drafter.counters()
        eng.shutdown()
    assert [c.token_ids for c in in_process] == baseline["short"]
    assert [c.token_ids for c in remote] == baseline["short"]
    for results in (in_process, remote):
        assert sum(results[i].stats.accepted_tokens for i in CODE) > 0, "no drafts accepted"
    assert counters["failed"] == counters["stale"] == counters["unknown_request"] == 0


@pytest.mark.slow
def test_smollm2_draft_model_in_process_and_remote_is_lossless(smollm2, drafters):
    prompts = PROMPTS[:4]
    plain = [c.token_ids for c in run_all(engine(smollm2, "none", model="smollm2-135m"), prompts)]
    server = drafters(drafter="model:smollm2-135m", kv_blocks=256)
    for drafter in ("model:smollm2-135m", f"grpc://{server.address}"):
        eng = engine(smollm2, drafter, model="smollm2-135m")
        spec = run_all(eng, prompts)
        assert [c.token_ids for c in spec] == plain, drafter
        assert eng.executor.stats.accepted_tokens > 0, drafter
        eng.shutdown()


@pytest.mark.slow
def test_smollm2_remote_ngram_is_lossless(smollm2, drafters):
    prompts = PROMPTS[:8]
    plain = run_all(engine(smollm2, "none", model="smollm2-135m"), prompts)
    server = drafters()
    eng = engine(smollm2, f"grpc://{server.address}", model="smollm2-135m")
    spec = run_all(eng, prompts)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(spec[i].stats.accepted_tokens for i in (0, 1, 6)) > 0
    eng.shutdown()


# -- a drafter killed and restarted mid-generation ------------------------------------------------


def test_drafter_killed_with_two_questions_in_flight_then_restarted(tiny, baseline, drafters):
    """The default two questions in flight, a drafter slower than a step (10 ms, never waited
    for), killed while both questions are unanswered and restarted on the same port: both
    questions fail (nothing waits on the dead stream), the client reconnects in the background
    and re-sends every sequence, and the restarted drafter's replies draft again. Output
    unchanged, nothing stale or unknown, KV intact, sessions freed."""
    port = free_port()
    server = drafters(port=port, delay_ms=10)
    eng = engine(tiny, f"grpc://127.0.0.1:{port}", drafter_patience_ms=0, deadline_ms=1000)
    ex, drafter = eng.executor, eng.drafter
    assert drafter.max_inflight == 2  # the default
    streams = submit_all(eng, PROMPTS[:6], 150)
    step_until(ex, lambda: drafter.connection.inflight == 2, "two questions in flight")
    server.stop(None)
    step_until(ex, lambda: drafter.counters()["failed"] > 0, "the dead drafter to be noticed")
    restarted = drafters(port=port, delay_ms=10)
    wait_until(
        lambda: drafter.counters()["reconnects"] >= 2,
        timeout=20,
        interval=0.05,
        what="the drafter client to reconnect",
    )
    # Replies collected again: the two questions lost with the stream were given up (had they
    # stayed pending, no new question would go out).
    before = drafter.counters()["prefetched"]
    step_until(ex, lambda: drafter.counters()["prefetched"] > before, "replies again", 400)
    ex.run_until_idle()
    assert [c.token_ids for c in completions(streams)] == baseline["long"]
    eng.kv.check_integrity()
    c = drafter.counters()
    assert c["stale"] == c["unknown_request"] == 0
    wait_until(lambda: len(restarted.engine.store) == 0, timeout=10, what="sessions freed")
    eng.shutdown()


@pytest.mark.parametrize("mode", ["stream", "relay", "socket", "unary"])
def test_drafter_killed_mid_generation_then_restarted(tiny, baseline, drafters, mode):
    port = free_port()
    server = drafters(port=port)
    eng = engine(tiny, f"grpc://127.0.0.1:{port}", **via(server, mode), deadline_ms=1000)
    ex = eng.executor
    streams = submit_all(eng, PROMPTS[:6], 150)
    for _ in range(8):  # prefill and a few speculative steps
        ex.run_until_idle(max_steps=1)
    assert ex.stats.accepted_tokens > 0 and ex.scheduler.has_work

    server.stop(None)  # killed: its sessions are gone
    step_until(ex, lambda: eng.drafter.counters()["failed"] > 0, "the dead drafter to be noticed")
    assert ex.scheduler.has_work, "generations should still be in flight"

    restarted = drafters(port=port)
    wait_until(
        lambda: eng.drafter.counters()["reconnects"] >= 2,  # no steps needed: background
        timeout=20,
        interval=0.05,
        what="the drafter client to reconnect",
    )
    before = ex.stats.accepted_tokens

    def resumed() -> bool:
        # Drafts kept from before the kill (a proposal's look-ahead) may be accepted before
        # anything is re-sent, so wait for the new drafter to hold every live request too.
        held = restarted.engine.store.get
        return ex.stats.accepted_tokens > before and all(
            held(r.request_id) is not None for r in ex.scheduler.running
        )

    step_until(ex, resumed, "speculation to resume, every live request re-sent")
    # Every sequence was re-sent from base_len 0: the new drafter holds each live request's
    # committed tokens (as of the last step it was told about) from the very first token.
    live = list(ex.scheduler.running)
    assert live, "generations should still be in flight"
    for req in live:
        held = restarted.engine.store.get(req.request_id)
        assert held is not None and 0 < len(held.tokens) <= len(req.token_ids)
        assert held.tokens == req.token_ids[: len(held.tokens)]

    ex.run_until_idle()
    assert [c.token_ids for c in completions(streams)] == baseline["long"]
    eng.kv.check_integrity()

    # The same story through GetModelInfo: serve the finished engine and ask.
    srv = TargetServer("127.0.0.1", 0)
    srv.start()
    srv.attach(eng)
    try:
        with GenerationClient(f"127.0.0.1:{srv.port}", timeout=30) as client:
            info = client.model_info()
    finally:
        srv.stop(0)
    assert info.drafter_counters.failed > 0 and info.drafter_counters.reconnects >= 2
    assert info.speculation.accepted_tokens == ex.stats.accepted_tokens > before
    # ... and through Prometheus, read from the drafter when scraped.
    counters = eng.drafter.counters()
    for name in ("late", "failed", "reconnects"):
        sample = ex.metrics.registry.get_sample_value(
            f"specwire_drafter_{name}_total", {"model": "tiny-random"}
        )
        assert sample == counters[name], name
    # ... with the auto patience's timings as gauges, once sampled.
    timings = eng.drafter.timings()
    assert timings["round_trip"] > 0 and timings["drafting_step"] > 0
    for key, value in timings.items():
        sample = ex.metrics.registry.get_sample_value(
            f"specwire_drafter_{key}_seconds", {"model": "tiny-random"}
        )
        assert sample == value, key


# -- a drafter slower than the deadline ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_slow_drafter_is_late_and_output_unchanged(baseline, drafters, served, mode):
    server = drafters(delay_ms=400)
    client = served(f"grpc://{server.address}", drafter_mode=mode, deadline_ms=20)
    results = generate_concurrently(client, PROMPTS[:4])
    assert [r.token_ids for r in results] == baseline["short"][:4]
    info = client.model_info()
    assert info.drafter_counters.late > 0 and info.drafter_counters.failed == 0
    # No step waited for the reply: every step verified without drafts, one token each.
    assert info.speculation.draft_tokens == 0
    for r in results:
        assert r.speculation["steps"] == len(r.token_ids)
    assert len(client.generate("still serving", max_new_tokens=4).token_ids) == 4


# -- malformed drafter replies ---------------------------------------------------------------------


class CorruptingServicer(drafter_pb2_grpc.DrafterServiceServicer):
    """The real drafter engine, with its replies corrupted in rotation: a wrong request id, a
    stale base_len, ids outside the vocabulary; every fourth reply is left intact."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine

    def GetInfo(self, request, context):
        return drafter_pb2.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION, name="corrupting", max_draft_len=4,
            capabilities=["stream"],
        )  # fmt: skip

    def Draft(self, request, context):
        return self._draft(request, drafter_pb2.DraftResponse)

    def DraftStream(self, request_iterator, context):
        for request in request_iterator:
            yield self._draft(request, drafter_pb2.DraftStreamResponse)

    def _draft(self, request, kind):
        drafts = self.engine.draft(updates_from_proto(request), request.want_probs)
        reply = response_to_proto(request.step, drafts, kind)
        for i, d in enumerate(reply.drafts):
            kind = (request.step + i) % 4
            if kind == 0:
                d.request_id = f"nobody-{d.request_id}"
            elif kind == 1:
                d.base_len -= 1
            elif kind == 2:
                junk = [TINY_VOCAB + 7, *d.tokens[1:]] if d.tokens else [TINY_VOCAB]
                del d.tokens[:]
                d.tokens.extend(junk)
        return reply


@pytest.fixture
def corrupting_drafter():
    ngram = NGramDrafter()
    servicer = CorruptingServicer(DraftEngine(ngram, SessionStore(ngram, 300.0), 4))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_malformed_drafter_replies_are_counted_and_ignored(
    baseline, corrupting_drafter, served, mode
):
    # (Every reply is waited for, the `engine` default here, so its drafts reach the
    # executor's checks: a deferred reply's out-of-vocabulary drafts would never match.)
    client = served(f"grpc://{corrupting_drafter}", drafter_mode=mode)
    results = generate_concurrently(client, PROMPTS[:8])
    assert [r.token_ids for r in results] == baseline["short"][:8]
    info = client.model_info()
    c = info.drafter_counters
    assert c.unknown_request > 0 and c.stale > 0 and c.failed == 0
    assert info.speculation.refused_draft_tokens > 0
    assert info.speculation.accepted_tokens <= info.speculation.draft_tokens
    assert client.generate(PROMPTS[0], max_new_tokens=24).token_ids == baseline["short"][0]


# -- the handshake, from the CLI ------------------------------------------------------------------


class SmolVocabNGram(NGramDrafter):
    """An n-gram drafter claiming SmolLM2's vocabulary (what `model:smollm2-135m` advertises)."""

    vocab_size = 49152


def test_target_cli_refuses_mismatched_drafter_in_one_line(drafters):
    server = drafters(instance=SmolVocabNGram())
    cmd = [
        sys.executable,
        "-m",
        "specwire.common.cli",
        "target",
        "--model",
        "tiny-random",
        "--port",
        "0",
        "--no-progress",
        "--drafter",
        f"grpc://{server.address}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("specwire: error:")]
    assert len(errors) == 1, proc.stderr
    assert "vocabulary size 49152" in errors[0] and "512" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("patience_ms", [2000, -1], ids=["wait", "auto"])
@pytest.mark.parametrize("mode", ["stream", "socket", "unary"])
def test_remote_drafter_in_pipelined_steps_is_lossless(tiny, baseline, drafters, mode, patience_ms):
    """`--pipeline-drafts` with a remote drafter: a drafting step is staged before the step in
    flight is read, its drafts continuing the kept proposal on the hypothesis that the target
    follows it through that step (`RemoteSessions.drafts_from_run`); the device moves each row
    by what was really accepted. Output unchanged with 50 prompts at once and 6 long ones,
    drafts accepted (so hypotheses held), steps really pipelined, nothing lost."""
    server = drafters(drafter="ngram")
    eng = engine(
        tiny,
        f"grpc://{server.address}",
        pipeline_drafts=True,
        drafter_patience_ms=patience_ms,
        **via(server, mode),
    )
    metrics, labels = _lossless_at_once_and_long(eng, baseline)
    assert metrics.registry.get_sample_value("specwire_pipelined_steps_total", labels) > 0
    c = eng.drafter.counters()
    assert c["prefetched"] > 0 and c["lookahead"] > 0
    # Hypotheses settled (some held: drafts were accepted in pipelined steps), and exported.
    assert c["hypotheses_held"] > 0
    held = metrics.registry.get_sample_value("specwire_drafter_hypotheses_held_total", labels)
    assert held == c["hypotheses_held"]
    stats = eng.executor.stats
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    _nothing_lost(eng, server)


def test_a_target_that_switches_between_pipelined_and_synchronous_drafting_is_lossless(
    tiny, baseline, drafters
):
    """`--pipeline-choice measured` (a remote drafter's default with --pipeline-drafts): each
    speculative window of the adaptive policy runs its drafting steps pipelined or
    synchronous. Short windows here, so the target switches back and forth many times
    (draining a pipelined step with unread drafts into a synchronous one, and staging a
    pipelined one after a synchronous one): output unchanged, both kinds of drafting step
    ran, both measured, nothing lost."""
    server = drafters(drafter="ngram")
    eng = engine(tiny, f"grpc://{server.address}", pipeline_drafts=True, **via(server, "socket"))
    assert eng.config.pipeline_choice == "measured"
    _adaptive(eng, {1: 1e-3, 64: 1e-3, 1024: 1e-3})
    policy = eng.executor.scheduler.policy
    policy.mode_window, policy.first_window = 4, 4
    policy.spec_margin = -0.99  # speculation keeps winning: this is about its two variants
    policy.choice.probe_every = policy.choice.max_probe_every = 2
    ex, drained = eng.executor, []
    finish = ex._finish_inflight

    def counting_finish(observe: bool = True) -> None:
        # A step read before a synchronous one: count those that still had unread drafts.
        prev = ex._inflight
        drained.append(prev is not None and prev.drafted and not observe)
        finish(observe)

    ex._finish_inflight = counting_finish
    metrics, labels = _lossless_at_once_and_long(eng, baseline)
    assert sum(drained) > 0, "no pipelined step was drained into a synchronous one"
    sample = metrics.registry.get_sample_value
    assert sample("specwire_pipelined_steps_total", labels) > 0
    assert sample("specwire_sync_step_seconds_count", labels) > 0  # synchronous drafting
    for variant in ("pipelined", "synchronous"):
        steps = sample(
            "specwire_draft_policy_pipelining_steps_total", {**labels, "variant": variant}
        )
        assert steps > 0, variant
    stats = eng.executor.stats
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    _nothing_lost(eng, server)


def test_a_pipelined_target_warns_of_a_drafter_without_look_ahead(tiny, baseline, drafters, caplog):
    """A model drafter is asked without a look-ahead (auto), so its proposals never reach past
    a step in flight: the target says so at start-up, naming the flag; output unchanged."""
    server = drafters(drafter="model:tiny-random")
    with caplog.at_level("WARNING", logger="specwire.target_service.engine"):
        eng = engine(tiny, f"grpc://{server.address}", pipeline_drafts=True)
    assert "--drafter-lookahead" in caplog.text and "model:tiny-random" in caplog.text
    results = run_all(eng, PROMPTS[:8])
    assert [c.token_ids for c in results] == baseline["short"][:8]
    _nothing_lost(eng, server)
