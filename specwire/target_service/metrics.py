"""Prometheus metrics of one target engine, named and shaped like vLLM's (its own registry, so
several engines can live in one process, e.g. in tests). `specwire target --metrics-port P`
serves them over HTTP at /metrics.

Every family carries a constant `model` label (the served model name, as GetModelInfo reports
it). Names, types and meanings are listed in docs/architecture.md ("Metrics").

The executor and each request's OutputStream report lifecycle events through the `on_*` hooks
(which also write the request log, `request_log.py`):

    on_arrival    Executor.submit               (any thread)  request log: admitted
    on_scheduled  Executor.step, after schedule (executor)    queue time, prompt tokens
    on_verified   Executor.emit, once a step    (executor)    drafted/accepted, per position
    on_committed  OutputStream.append           (executor)    TTFT, inter-token latency
                  (a step's tokens are counted once, by the executor, on its hot paths)

The executor's per-step updates (steps, step times, tokens, drafts, inter-token latencies) go
through `TargetMetrics.batched`: buffered, added in batches and before every scrape.
    on_cancelled  the client cancelled          (executor)    request log: cancelled
    on_finished   OutputStream.finish / fail    (any thread)  e2e latency, finish reason, log

Gauges (running, waiting, KV blocks) and the remote drafter's counters are read when scraped,
so they are right whichever path released a request (a finish, a cancel, a failure).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specwire.target_service import request_log
from specwire.target_service.request import Request

if TYPE_CHECKING:
    from specwire.target_service.resources.kv_cache import KVCacheManager
    from specwire.target_service.scheduler import Scheduler

METRICS_PATH = "/metrics"
FINISH_REASONS = ("eos", "length", "stop", "context", "cancelled", "error")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
_TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
_ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
_LATENCY_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(5) for m in (1, 2, 5)) + (100_000.0,)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)

# The remote drafter's counters() keys, exported as specwire_drafter_<key>_total.
DRAFTER_COUNTERS = {
    "late": "Steps without drafts: no reply by the deadline, or an earlier one still unanswered",
    "failed": "Steps that went without drafts because the drafter link was down or broke",
    "stale": "Draft replies dropped because they continued an outdated sequence",
    "resynced": "Sequences the drafter asked to have re-sent from the start",
    "unknown_request": "Draft replies naming a request the target did not ask about",
    "reconnects": "Connections to the drafter opened (the first one counts)",
    "prefetched": "Replies to drafts asked for as a step committed (submit), collected later",
    "lookahead": "Requests whose step drafts came from a kept proposal's look-ahead, unasked",
    "deferred": "Steps that went without asked-for drafts after the patience; reply kept for later",
    "branched": "Requests drafted from a kept branch: another way the drafter foresaw, unasked",
    "at_launch": "Questions held back at a step's commit and sent once the next step launched",
    "probes": "Questions sent at a launch only to time the launch's round trip (in at_launch)",
    "hypotheses_held": "Pipelined steps whose drafts assumed the step in flight's outcome rightly",
    "hypotheses_failed": "Pipelined steps whose drafts assumed the step in flight's outcome amiss",
}

# The remote drafter's timings() keys (its auto patience's EMAs), exported as
# specwire_drafter_<key>_seconds once sampled.
DRAFTER_TIMINGS = {
    "round_trip": "Remote drafter: EMA of a question's round trip (sent to reply arrived)",
    "drafting_step": "Remote drafter: EMA of a drafting step (drafts taken to the commit)",
    "commit_to_launch": "Remote drafter: EMA of the host gap from a commit to the next launch",
    "launch_round_trip": "Remote drafter: EMA of the round trip of questions sent at a launch",
    "launch_to_commit": "Remote drafter: EMA of a launch to that step's commit",
}


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every value, adding each bucket's count and the sum once
    (one lock each instead of two a value: a 64-row step observes 64 latencies). Relies on
    prometheus_client's Histogram fields; where they are not as expected, one at a time."""
    if not values:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1  # first bound >= v (the last is +Inf)
    total.inc(sum(values))
    for bucket, n in zip(buckets, counts, strict=True):
        if n:
            bucket.inc(n)


class _Batched(Collector):
    """Counter increments and histogram values from the executor's hot path, kept as plain
    numbers and added to their families in batches: a synchronous step makes about ten
    updates, each taking a lock (two for a histogram) and a few Python calls; batched, a
    value costs an append, and a flush one lock per counter and per bucket touched. Flushed
    every FLUSH_EVERY values (executor thread) and before every scrape (registered first, so
    the families collected after it are current)."""

    FLUSH_EVERY = 256

    def __init__(self) -> None:
        self._buffers: dict[object, list[float]] = {}  # family -> values not added yet
        self._count = 0  # values buffered since the executor's last flush
        self._lock = threading.Lock()  # one flusher at a time (appends take none)

    def add(self, family: Counter | Histogram, value: float) -> None:
        """`family.inc(value)` (a counter) or `family.observe(value)` (a histogram), later."""
        buf = self._buffers.get(family)
        if buf is None:
            buf = self._buffers[family] = []
        buf.append(value)
        self._count += 1
        if self._count >= self.FLUSH_EVERY:
            self.flush()

    def add_many(self, family: Histogram, values: Sequence[float]) -> None:
        if values:
            buf = self._buffers.get(family)
            if buf is None:
                buf = self._buffers[family] = []
            buf += values
            self._count += len(values)
            if self._count >= self.FLUSH_EVERY:
                self.flush()

    def flush(self) -> None:
        """Add what is buffered to the families (any thread). The executor appends without
        a lock while this runs: each buffer's values are copied, then exactly that many are
        deleted from its front (both atomic under the GIL), so a value appended meanwhile
        stays for the next flush."""
        with self._lock:
            self._count = 0
            for family, buf in list(self._buffers.items()):
                values = buf[:]
                if not values:
                    continue
                del buf[: len(values)]
                if isinstance(family, Histogram):
                    observe_many(family, values)
                else:
                    family.inc(sum(values))

    def collect(self):
        self.flush()
        return []


class TargetMetrics:
    def __init__(self, model: str = "") -> None:
        self.model = model
        self.registry = CollectorRegistry()
        # Registered first: a scrape flushes the hot path's batched values before reading.
        self.batched = _Batched()
        self.registry.register(self.batched)

        def family(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model"], registry=self.registry, **kw).labels(model)

        # -- steps ----------------------------------------------------------------------------
        self.steps = family(Counter, "specwire_steps", "Executor steps run")
        self.eager_steps = family(
            Counter,
            "specwire_eager_steps",
            "Steps whose forward ran eagerly instead of replaying a CUDA graph",
        )
        self.overlapped_steps = family(
            Counter,
            "specwire_overlapped_steps",
            "Steps launched before the previous step's tokens were read (plain greedy steps,"
            " and drafting steps with --pipeline-drafts)",
        )
        self.pipelined_steps = family(
            Counter,
            "specwire_pipelined_steps",
            "Drafting steps launched before the previous step was read, shifted on the device "
            "by its accepted drafts (--pipeline-drafts; also counted as overlapped)",
        )
        self.two_batch_steps = family(
            Counter,
            "specwire_two_batch_steps",
            "Speculative steps launched while the other half of the batch ran (--two-batch-rows)",
        )
        self.preemptions = family(
            Counter,
            "specwire_preemptions",
            "Requests preempted for KV blocks (their blocks freed; recomputed later)",
        )
        self.step_seconds = family(
            Histogram,
            "specwire_step_seconds",
            "Wall time of one executor step",
            buckets=_STEP_BUCKETS,
        )
        self.sync_step_seconds = family(
            Histogram,
            "specwire_sync_step_seconds",
            "Wall time of a synchronous step (speculative, or plain where steps do not overlap) "
            "from the end of the step before: the drain of a step in flight and the loop's "
            "work between steps included, as the draft-length policy times a mode",
            buckets=_STEP_BUCKETS,
        )
        self.draft_seconds = family(
            Histogram,
            "specwire_draft_seconds",
            "Time a speculative step spent getting its drafts before launching (the drafter's "
            "exposed time: asking, waiting for a remote reply, checking)",
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05),
        )
        self.drafter_ask_seconds = family(
            Histogram,
            "specwire_drafter_ask_seconds",
            "Time a synchronous step spent, after committing, telling a drafter that drafts off "
            "the critical path (the remote one) what it committed and asking for the next "
            "drafts: the rest of the drafter's exposed time",
            buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3),
        )
        self.step_gpu_seconds = family(
            Histogram,
            "specwire_step_gpu_seconds",
            "Device time of graph steps while serving, one in 8 sampled (CUDA events around "
            "its replay: from the stream reaching it to its end)",
            buckets=_STEP_BUCKETS,
        )
        self.step_host_seconds = family(
            Histogram,
            "specwire_step_host_seconds",
            "Host time on a step's critical path: the step's wall time minus the time it "
            "waited for the device (scheduling, drafting, input preparation, verification)",
            buckets=(0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
        )
        # -- tokens ---------------------------------------------------------------------------
        self.prompt_tokens = family(
            Counter, "specwire_prompt_tokens", "Prompt tokens of requests scheduled (counted once)"
        )
        self.tokens = family(
            Counter, "specwire_generated_tokens", "Generated tokens committed to requests"
        )
        self.drafted = family(Counter, "specwire_draft_tokens", "Real draft tokens proposed")
        self.accepted = family(Counter, "specwire_accepted_tokens", "Draft tokens accepted")
        # -- requests -------------------------------------------------------------------------
        self.ttft = family(
            Histogram,
            "specwire_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first committed token",
            buckets=_TTFT_BUCKETS,
        )
        self.itl = family(
            Histogram,
            "specwire_inter_token_latency_seconds",
            "Per committed chunk after the first: seconds since the request's previous chunk "
            "divided by the chunk's tokens (speculation commits several tokens at once)",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = family(
            Histogram,
            "specwire_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end (any finish reason)",
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = family(
            Histogram,
            "specwire_request_queue_time_seconds",
            "Seconds from a request's arrival to its first scheduled step",
            buckets=_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = family(
            Histogram,
            "specwire_request_prompt_tokens",
            "Prompt tokens per finished request",
            buckets=_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = family(
            Histogram,
            "specwire_request_generation_tokens",
            "Tokens returned per finished request",
            buckets=_TOKEN_BUCKETS,
        )
        success = Counter(
            "specwire_request_success",
            "Requests ended, by finish reason (eos, length, stop, context, cancelled, error); "
            "a request's n completions count as n",
            ["model", "reason"],
            registry=self.registry,
        )
        self._success = success
        for reason in FINISH_REASONS:  # every reason is exported from the start, at 0
            success.labels(model, reason)
        # -- engine state, read when scraped (see `watch`) --------------------------------------
        self.running = family(Gauge, "specwire_running_requests", "Requests in the batch")
        self.waiting = family(Gauge, "specwire_waiting_requests", "Requests queued")
        self.kv_free = family(Gauge, "specwire_kv_free_blocks", "Free KV cache blocks")
        self.one_token_gpu = family(
            Gauge,
            "specwire_one_token_step_gpu_seconds",
            "Device time of a 1-token step's graph replay, measured at warm-up (weights only, "
            "no context): the bound on one stream's decoding speed",
        )
        self.kv_usage = family(
            Gauge,
            "specwire_kv_cache_usage_ratio",
            "Fraction of the usable KV cache blocks held by requests (0..1)",
        )
        self._arrived: dict[str, float] = {}  # request_id -> arrival time, until first scheduled
        self._scrape = _ScrapeTimeCollector(model)
        self.registry.register(self._scrape)

    def watch(self, scheduler: Scheduler, kv: KVCacheManager, drafter: object | None) -> None:
        """Read the engine's state when scraped: the batch, the queue, the KV pool and, for a
        drafter with `counters()` and `timings()` (the remote drafter), those."""
        usable = kv.num_blocks - 1  # block 0 is the dummy block
        self.running.set_function(lambda: len(scheduler.running))
        self.waiting.set_function(lambda: len(scheduler.waiting))
        self.kv_free.set_function(lambda: kv.num_free_blocks)
        self.kv_usage.set_function(lambda: 1.0 - kv.num_free_blocks / usable)
        self._scrape.drafter_counters = getattr(drafter, "counters", None)
        self._scrape.drafter_timings = getattr(drafter, "timings", None)
        self._scrape.policy = scheduler.policy
        self._scrape.grow(scheduler.config.max_draft_len)

    # -- lifecycle hooks ---------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        self._arrived[req.request_id] = req.arrival_time
        request_log.admitted(req)

    def on_scheduled(self, requests: Iterable[Request]) -> None:
        """A step was scheduled; requests in it for the first time leave the queue."""
        now = time.monotonic()
        for req in requests:
            arrival = self._arrived.pop(req.request_id, None)
            if arrival is not None:
                self.queue_time.observe(now - arrival)
                self.prompt_tokens.inc(len(req.prompt_ids))

    def on_verified(self, rows: Sequence[tuple[int, int]]) -> None:
        """A step's rows verified: per row, (`drafted` real drafts, the first `accepted` of
        them accepted). Once a step, not per row: each counter update takes a lock."""
        drafted = sum(d for d, _ in rows)
        if drafted:  # else nothing was accepted either
            self.batched.add(self.drafted, drafted)
            self.batched.add(self.accepted, sum(a for _, a in rows))
            self._scrape.record(rows)

    def on_committed(self, req: Request, num_tokens: int, previous: float | None, now: float):
        """`num_tokens` (>= 1) tokens committed at `now`; `previous` is when the request's
        previous chunk was (None: this is its first)."""
        self.tokens.inc(num_tokens)
        self.on_latency(req, num_tokens, previous, now)

    def on_latency(self, req: Request, num_tokens: int, previous: float | None, now: float):
        """`on_committed` without counting the tokens (the caller counts a step's at once)."""
        if previous is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe((now - previous) / num_tokens)

    def observe_itl(self, values: Sequence[float]) -> None:
        """Inter-token latencies of a whole step at once (batched: `_Batched`)."""
        self.batched.add_many(self.itl, values)

    def on_step(self, seconds: float, host_seconds: float) -> None:
        """A step ran: its wall time and the part of it the host spent (batched)."""
        add = self.batched.add
        add(self.steps, 1)
        add(self.step_seconds, seconds)
        add(self.step_host_seconds, host_seconds)

    def on_generated(self, tokens: int) -> None:
        """A step's committed tokens (batched)."""
        if tokens:
            self.batched.add(self.tokens, tokens)

    def on_cancelled(self, req: Request) -> None:
        request_log.cancelled(req)

    def on_finished(self, req: Request, reason: str, completion_tokens: int) -> None:
        """Called exactly once per request, with what its client was told."""
        now = time.monotonic()
        self._arrived.pop(req.request_id, None)  # ended before it was ever scheduled
        total = now - req.arrival_time
        self.e2e.observe(total)
        self.request_prompt_tokens.observe(len(req.prompt_ids))
        self.request_generation_tokens.observe(completion_tokens)
        self._success.labels(self.model, reason).inc()
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        request_log.finished(req, reason, completion_tokens, ttft, total)

    def serve(self, port: int, host: str = "0.0.0.0") -> WSGIServer:
        """Serve the registry at /metrics (any other path is 404) from a daemon thread.
        `server.server_port` is the bound port (`port=0` picks a free one)."""
        server = make_server(
            host,
            port,
            _only_metrics_path(make_wsgi_app(self.registry)),
            server_class=_ThreadingWSGIServer,
            handler_class=_QuietHandler,
        )
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


class _ScrapeTimeCollector(Collector):
    """Families kept as plain numbers and turned into samples when scraped: acceptance per
    draft position (updated on the executor's hot path, where a prometheus Counter per
    position would cost a lock each) and the remote drafter's counters."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.drafter_counters = None  # () -> dict[str, int], or None
        self.drafter_timings = None  # () -> dict[str, float | None], or None
        self.policy = None  # the draft-length policy (its `snapshot()`), or None
        self._lock = threading.Lock()
        self._drafted: list[int] = []  # [i]: steps that drafted a token at position i
        self._accepted: list[int] = []  # [i]: ... and accepted it

    def grow(self, positions: int) -> None:
        with self._lock:
            extra = max(0, positions - len(self._drafted))
            self._drafted += [0] * extra
            self._accepted += [0] * extra

    def record(self, rows: Sequence[tuple[int, int]]) -> None:
        """Per row (drafted, accepted; accepted <= drafted). Rows are counted by length, then
        summed position by position (a row of d drafts counts at positions 0..d-1): one pass
        over the rows and one over the positions. A loop over each row's positions cost
        15-21 µs against 5 a step at 32 rows of up to 8 drafts (dev VM, round 49)."""
        longest = max((d for d, _ in rows), default=0)
        if longest > len(self._drafted):
            self.grow(longest)
        ends_d, ends_a = [0] * (longest + 1), [0] * (longest + 1)
        for drafted, accepted in rows:
            ends_d[drafted] += 1
            ends_a[accepted] += 1
        with self._lock:
            for counts, ends in ((self._drafted, ends_d), (self._accepted, ends_a)):
                running = 0  # rows longer than position i - 1
                for i in range(longest, 0, -1):
                    running += ends[i]
                    counts[i - 1] += running

    def collect(self):
        with self._lock:
            drafted, accepted = list(self._drafted), list(self._accepted)
        yield self._by_position(
            "specwire_draft_tokens_by_position",
            "Draft tokens proposed at each draft position (0 = the first draft token)",
            drafted,
        )
        yield self._by_position(
            "specwire_accepted_tokens_by_position",
            "Draft tokens accepted at each draft position; accepted/drafted at a position is "
            "its acceptance rate",
            accepted,
        )
        counters = self.drafter_counters() if self.drafter_counters is not None else {}
        for key, value in counters.items():
            doc = DRAFTER_COUNTERS.get(key, f"Remote drafter counter {key!r}")
            family = CounterMetricFamily(f"specwire_drafter_{key}", doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        timings = self.drafter_timings() if self.drafter_timings is not None else {}
        for key, value in timings.items():
            if value is not None:
                doc = DRAFTER_TIMINGS.get(key, f"Remote drafter timing {key!r}")
                family = GaugeMetricFamily(f"specwire_drafter_{key}_seconds", doc, labels=["model"])
                family.add_metric([self.model], value)
                yield family

        if self.policy is not None:
            yield from self._policy_families(self.policy.snapshot())

    def _policy_families(self, snap: dict):
        """The draft-length policy's choices and what it has learnt (draft_policy.py): why a
        server does or does not speculate at a load."""
        if not snap:
            return
        m = [self.model]

        def family(kind, name: str, doc: str, labels: Sequence[str], items):
            fam = kind(name, doc, labels=["model", *labels])
            for key, value in items:
                key = key if isinstance(key, tuple) else (key,)
                fam.add_metric(m + [str(k) for k in key], value)
            return fam

        yield family(
            CounterMetricFamily,
            "specwire_draft_policy_steps",
            "Steps the draft-length policy ran in each mode (spec: may draft; plain: overlapped, "
            "no drafts), counted as each measured window closes (a speculative window counts only "
            "its steps that could draft; a static policy measures no windows)",
            ["mode"],
            snap["mode_steps"].items(),
        )
        yield family(
            CounterMetricFamily,
            "specwire_draft_policy_draft_len_steps",
            "Steps run by the draft length k they were scheduled with (0: a plain step; "
            "request caps apply after)",
            ["k"],
            enumerate(snap["k_steps"]),
        )
        yield family(
            GaugeMetricFamily,
            "specwire_draft_policy_mode",
            "The policy's current mode (1 for the mode it runs)",
            ["mode"],
            [(mode, 1.0 if snap["mode"] == mode else 0.0) for mode in ("spec", "plain")],
        )
        yield family(
            GaugeMetricFamily,
            "specwire_draft_policy_rate",
            "Measured generated tokens per second per row of each mode at each load (rows "
            "bucket): the mode with the better rate runs there",
            ["mode", "rows"],
            snap["rates"].items(),
        )
        yield family(
            CounterMetricFamily,
            "specwire_draft_policy_windows",
            "Measured windows behind each mode's rate at each load",
            ["mode", "rows"],
            snap["windows"].items(),
        )
        if snap["pipelining"] is not None:  # --pipeline-choice measured (pipeline_choice.py)
            pipelining = snap["pipelining"]
            yield family(
                CounterMetricFamily,
                "specwire_draft_policy_pipelining_steps",
                "Steps of the speculative mode's windows by how their drafting steps ran "
                "(pipelined or synchronous; counted as each window closes)",
                ["variant"],
                pipelining["steps"].items(),
            )
            yield family(
                GaugeMetricFamily,
                "specwire_draft_policy_pipelining_rate",
                "Measured generated tokens per second per row of the speculative mode run "
                "pipelined or synchronous at each load (rows bucket): the faster runs there",
                ["variant", "rows"],
                pipelining["rates"].items(),
            )
        for name, label, doc in (
            ("host", "rows", "Host seconds of a synchronous decode step (least of the last few)"),
            ("exposed", "rows", "Host seconds an overlapped plain step left exposed (EMA)"),
            ("device", "tokens", "Device seconds of a step per token bucket (seeded at warm-up)"),
        ):
            yield family(
                GaugeMetricFamily,
                f"specwire_draft_policy_{name}_seconds",
                f"Draft-length policy cost table: {doc}",
                [label],
                snap[name].items(),
            )
        yield family(
            GaugeMetricFamily,
            "specwire_draft_policy_acceptance",
            "The population's per-draft acceptance estimate (a) and how often the drafter has a "
            "draft at all (p), which new requests start from, and its acceptance of draft m once "
            "the drafts before it were accepted (dm, m >= 1)",
            ["estimate"],
            [("a", snap["accept"]), ("p", snap["has_draft"])]
            + [(f"d{m}", v) for m, v in enumerate(snap["deeper"], start=1)],
        )

    def _by_position(self, name: str, doc: str, counts: Sequence[int]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model", "position"])
        for i, n in enumerate(counts):
            family.add_metric([self.model, str(i)], n)
        return family


def _only_metrics_path(app):
    def wsgi(environ, start_response):
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found; metrics are at {METRICS_PATH}\n".encode()]
        return app(environ, start_response)

    return wsgi


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - no access log on stderr per scrape
        pass
