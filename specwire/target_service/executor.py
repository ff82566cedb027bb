"""The executor: one thread owns the model and runs the step lifecycle.

A step that speculates (or samples, or reports logprobs) runs synchronously:

    batch = scheduler.schedule()
    resources.prepare(batch)
    drafts.prepare(decode rows)    # drafter.prepare_draft_tokens (unpadded), checked, padded
    logits = runner.forward(batch); drafts.launched()
    drafts.device_running(runner, logits); runner.wait(logits)   # replies taken meanwhile
    new_tokens = verifier.verify(decode rows, logits)
    resources.update(batch, accepted)
    append(batch); drafts.submit(decode rows)   # a drafter off the critical path hears it
    emit(batch)                                 # acceptance, metrics, finished requests

A plain greedy step (no drafts: the policy chose k = 0, or there is no drafter) is overlapped:
its outcome is known before it runs (every decode row commits exactly one token), so the
executor commits it optimistically (a placeholder token per decode row), launches it, and only
then reads the previous step's tokens, which the GPU computed while this one was being
prepared. The next step feeds those placeholders from the previous step's argmax on the device
(`Row.feed_src`). A request that ends by EOS or a stop string is found one step late; its extra
row is computed and dropped. A speculative step first finishes the step in flight.

With the two-batch overlap (`two_batch_rows`, off by default), speculative steps alternate
two disjoint halves of the batch: a step schedules, drafts and launches the requests that are
not in the step in flight, then reads, verifies and commits that step, so one half's host
work runs while the device computes the other (`_step_two_batch`).

Requests arrive and are cancelled from other threads through `submit`/`cancel`; both take
effect between steps. A failing step fails only the requests in it (their blocks are freed),
and the executor keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from specwire.target_service.drafters.base import Drafter
from specwire.target_service.drafts import DraftIntake
from specwire.target_service.metrics import TargetMetrics
from specwire.target_service.output import OutputStream, OutputWorker
from specwire.target_service.overlap import (
    InFlight,
    InFlightSpec,
    OverlappedSteps,
    TwoBatchSteps,
)
from specwire.target_service.request import Request, RequestState, SpecStats
from specwire.target_service.resources.base import ResourceRegistry
from specwire.target_service.resources.kv_cache import KVCacheManager
from specwire.target_service.runner.model_runner import ModelRunner
from specwire.target_service.scheduler import Row, ScheduledBatch, Scheduler
from specwire.target_service.verifier import TokenLogprob, Verifier

log = logging.getLogger(__name__)


class Executor(OverlappedSteps, TwoBatchSteps):
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        resources: ResourceRegistry,
        drafter: Drafter | None,
        runner: ModelRunner,
        verifier: Verifier,
        make_stream,  # Request -> OutputStream
        max_draft_len: int,
        vocab_size: int,
        metrics: TargetMetrics | None = None,  # the one make_stream's streams report to
        overlap: bool = True,  # overlap plain greedy steps (see the module docstring)
        two_batch_rows: int = 0,  # speculative steps alternate two halves from this many rows
        pipelined: bool = False,  # drafting steps (on the device) overlap too (overlap.py)
    ) -> None:
        self.scheduler = scheduler
        self.resources = resources
        self.kv: KVCacheManager = resources["kv_cache"]  # type: ignore[assignment]
        self.drafter = drafter
        self.runner = runner
        self.verifier = verifier
        self.make_stream = make_stream
        self.max_draft_len = max_draft_len
        self.vocab_size = vocab_size
        self.overlap = overlap
        self.two_batch_rows = two_batch_rows
        self.pipelined = pipelined and overlap and two_batch_rows == 0
        self._inflight: InFlight | None = None
        self._inflight_spec: InFlightSpec | None = None  # two-batch overlap
        # A plain step drained on entering the two-batch overlap: (tokens, seconds) that count
        # toward the first half's report, as a synchronous step counts its drain.
        self._spec_carry: tuple[int, float] | None = None
        self._generated = 0  # output tokens committed so far (the policy's rates)
        # When the last step() ended (None after idling): a synchronous step's rate window
        # runs from there, so the loop's work between steps counts against it as it does
        # against overlapped steps (timed launch to launch).
        self._mark: float | None = None
        # Requests whose steps cannot overlap (sampled, or asking for logprobs: their tokens
        # are chosen on the host from the logits, which the next step would overwrite).
        self._sync_requests = 0
        self.streams: dict[str, OutputStream] = {}
        self.stats = SpecStats(histogram=[0] * (max_draft_len + 1))
        # The executor's side of the drafter contract: ask, check, pad (the seeds' rule).
        self.drafts = DraftIntake(
            drafter,
            resources,
            vocab_size=vocab_size,
            max_draft_len=max_draft_len,
            pads=runner.pads_drafts,
            stats=self.stats,
        )
        self.step_no = 0
        self.metrics = metrics or TargetMetrics()
        self.metrics.watch(scheduler, self.kv, drafter)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.death: BaseException | None = None  # why the executor thread stopped, if it did
        self._gpu_wait = 0.0  # seconds this step waited for the device
        self._draft_wait = 0.0  # seconds this step spent getting its drafts
        # Detokenising and streaming run on their own thread, off the step's critical path.
        self.output = OutputWorker(on_stopped=self._stopped)
        # A synchronous step's records — its acceptance for the policy's estimates (of the
        # requests going on), its metric updates (verified rows, inter-token latencies,
        # tokens) —, held like its rendering until the next step is launched: off its
        # critical path. The next step's k does not need them: it is priced with the sums made
        # while this step ran (`DraftLengthPolicy.presum`).
        self._held_records: list[tuple] = []
        self.on_death = None  # called (from the executor thread) with that exception

    # -- called from other threads -------------------------------------------------------------
    def submit(self, request: Request) -> OutputStream:
        stream = self.make_stream(request)
        request.arrival_time = time.monotonic()
        if request.sampling.seed is not None:
            request.generator = torch.Generator().manual_seed(request.sampling.seed)
        elif not request.sampling.greedy:
            request.generator = torch.Generator()
            request.generator.seed()
        self.metrics.on_arrival(request)
        with self._wake:
            self._inbox.append(("add", stream))
            self._wake.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("cancel", request_id))
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specwire-executor", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for stream in list(self.streams.values()):
            self._finish(stream.request, "cancelled")
        self._record_held()
        self.output.flush()
        self.output.close()
        if self.drafter is not None:
            self.drafter.close()

    # -- the executor thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """The executor thread. It must never die quietly: anything that escapes a step (a
        plugin calling sys.exit, a bug in the executor itself) is recorded in `death` and
        reported through `on_death`, so the server can turn NOT_SERVING and exit non-zero."""
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the supervisor must see everything
            log.critical("executor thread died: %r", exc, exc_info=True)
            self.death = exc
            for stream in list(self.streams.values()):
                stream.fail("INTERNAL", f"the target's executor stopped: {exc!r}")
            if self.on_death is not None:
                self.on_death(exc)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while (
                    not self._stop
                    and not self._inbox
                    and not self.scheduler.has_work
                    and self._inflight is None
                    and self._inflight_spec is None
                ):
                    self._mark = None  # idle time is nobody's step
                    self._release_held()
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    return
            self._drain_inbox()
            if not self.idle:
                self.step()

    def _drain_inbox(self) -> None:
        with self._wake:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, payload in items:
            if kind == "add":
                self._admit(payload)
            elif kind == "cancel" and payload in self.streams:
                self.metrics.on_cancelled(self.streams[payload].request)
                self._finish(self.streams[payload].request, "cancelled")
            elif kind == "stopped" and payload in self.streams:
                self._release(self.streams[payload].request)  # its stream already completed

    def _admit(self, stream: object) -> None:
        assert isinstance(stream, OutputStream)
        self.streams[stream.request.request_id] = stream
        self._sync_requests += self._needs_host(stream.request)
        self.scheduler.add(stream.request)

    def _admit_arrivals(self) -> None:
        """Once a speculative step is launched, and again once the device has run it: admit
        the requests that arrived meanwhile (only those: a cancel waits for the step's end)
        and let a drafter that drafts off the critical path hear them now
        (`DraftIntake.arrived`). The step that ends their prefill then drafts from a proposal
        asked for while this one ran or was committed, not from a round trip inside it (a
        new request's first drafting step: 90 of a pass's ~1,000 steps at 8 streams in the
        CPU proxy, 0.16 ms each, round 43). Under load the mode is plain, and the drafter
        hears a request once it drafts."""
        if not self.drafts.hears_arrivals or self.scheduler.policy.mode != "spec":
            return
        with self._wake:
            adds = [payload for kind, payload in self._inbox if kind == "add"]
            if not adds:
                return
            rest = [item for item in self._inbox if item[0] != "add"]
            self._inbox.clear()
            self._inbox.extend(rest)
        for stream in adds:
            self._admit(stream)
        self.drafts.arrived([stream.request for stream in adds], self.step_no)

    @property
    def _device_busy(self) -> bool:
        """A step is in flight on the device (overlapped, or a two-batch half)."""
        return self._inflight is not None or self._inflight_spec is not None

    @property
    def idle(self) -> bool:
        """Nothing scheduled and no step in flight."""
        return (
            not self.scheduler.has_work and self._inflight is None and self._inflight_spec is None
        )

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive steps on the caller's thread (tests and benchmarks without the server)."""
        for _ in range(max_steps):
            self.output.flush()  # stop strings found by the output thread release requests
            self._drain_inbox()
            if self.idle:
                self._mark = None  # the caller's time until the next call is nobody's step
                break
            self.step()
        self._record_held()
        self.output.flush()

    def step(self) -> None:
        """One step: a plain greedy step overlaps with the next one's preparation; a step that
        drafts, samples or reports logprobs first reads the step in flight, then runs alone,
        unless it runs as a two-batch half (`_step_two_batch`)."""
        overlap, step_k = self._plan()
        two = self._two_batch_ok(overlap, step_k)
        if not two and self._inflight_spec is not None:
            self._finish_spec()  # leaving the two-batch overlap: its last step is timed alone
            self._mark = time.perf_counter()
        t_start, generated = self._mark or time.perf_counter(), self._generated
        try:
            if two:
                if self._inflight is not None:
                    self._finish_inflight(observe=False)  # drafting needs every token
                    self._spec_carry = (
                        self._generated - generated,
                        time.perf_counter() - t_start,
                    )
                self._step_two_batch(step_k)
                return
            if not overlap:
                self._finish_inflight(observe=False)  # drafting needs every token on the host
            t0 = time.perf_counter()
            if overlap and self.pipelined:  # drafts (on the device) need no token on the host
                ending, pinned = self._in_flight_limits()
                batch = self._schedule(step_k, ending, pinned=pinned)
            else:
                batch = self._schedule(0 if overlap else step_k)
            if batch is None:
                return
            if overlap:
                self._step_overlapped(batch)
            else:
                self._step_sync(batch, t0, t_start, generated)
        finally:
            self._mark = time.perf_counter()

    def _plan(self) -> tuple[bool, int]:
        """(overlap this step?, the policy's draft length)."""
        overlap = self.overlap and self._sync_requests <= 0
        step_k = self.scheduler.draft_len() if self.drafter is not None else 0
        if step_k and self.scheduler.wants_drafts(step_k):
            # Pipelined unless the policy runs this window's drafting steps synchronously
            # (`--pipeline-choice measured`: pipeline_choice.py).
            overlap = overlap and self.pipelined and self.scheduler.policy.pipelines
        return overlap, step_k

    def _schedule(
        self,
        step_k: int,
        exclude: frozenset[str] = frozenset(),
        max_rows: int | None = None,
        pinned: frozenset[str] = frozenset(),
    ) -> ScheduledBatch | None:
        """The next batch, or None when nothing can run (the step in flight is read: its
        finishing requests may hold the KV blocks needed)."""
        self._gpu_wait = self._draft_wait = 0.0
        batch = self.scheduler.schedule(
            step_k=step_k, exclude=exclude, max_rows=max_rows, pinned=pinned
        )
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        if not batch:
            if self._inflight_spec is not None:
                self._finish_spec()
            elif self._inflight is not None:
                self._finish_inflight()
            else:
                time.sleep(0.001)  # waiting for KV blocks held by finishing requests
            self._release_held()  # nothing launched: what this step held goes now
            return None
        self.metrics.on_scheduled(batch.requests)
        self.scheduler.policy.ran(step_k)
        self.step_no += 1
        return batch

    def _step_sync(self, batch: ScheduledBatch, t0: float, t_start: float, generated: int):
        """Run `batch` synchronously (isolating failures); the policy learns its costs (from
        `t0`) and its rate (from `t_start`: the end of the previous step, so the loop's work
        between steps and the drain of the step in flight are included)."""
        self._run_isolated(batch.rows, draft=True)
        now = time.perf_counter()
        elapsed = now - t0
        tokens = sum(r.num_committed + len(r.drafts) for r in batch.rows)
        policy = self.scheduler.policy
        rows, may_draft = len(batch.rows), batch.may_draft
        policy.observe_sync(rows, tokens, elapsed, self._gpu_wait, may_draft, self._draft_wait)
        policy.observe_rate(self._generated - generated, now - t_start, rows, may_draft)
        self._count_step(elapsed)
        self.metrics.batched.add(self.metrics.sync_step_seconds, now - t_start)

    def _observe_gpu(self, logits) -> None:
        """The step's device time into its histogram. A metric never fails a step."""
        try:
            seconds = logits.gpu_seconds()
        except Exception:  # e.g. an event the device could not time
            log.debug("step %d: no device time", self.step_no, exc_info=True)
            return
        if seconds is not None:
            self.metrics.batched.add(self.metrics.step_gpu_seconds, seconds)

    def _count_step(self, elapsed: float) -> None:
        self.metrics.on_step(elapsed, max(0.0, elapsed - self._gpu_wait))

    @staticmethod
    def _needs_host(req: Request) -> bool:
        return not req.sampling.greedy or req.sampling.logprobs is not None

    def _run_isolated(self, rows: list[Row], draft: bool) -> None:
        """Run a step; if it fails, retry each half without drafts until the failure is
        pinned on one request, which alone fails. Bystanders finish as if run alone.

        Retrying is safe because nothing before `_commit` changes a request: the forward only
        rewrites the same cache slots with the same values."""
        try:
            new_tokens = self._compute(ScheduledBatch(rows=rows), draft)
        except Exception as exc:
            if len(rows) == 1:
                req = rows[0].request
                log.exception("step %d failed for request %s", self.step_no, req.request_id)
                self._fail(req, f"step failed: {exc}")
                return
            log.warning(
                "step %d failed (%r); retrying its %d rows in halves", self.step_no, exc, len(rows)
            )
            half = len(rows) // 2
            self._run_isolated(rows[:half], draft=False)
            self._run_isolated(rows[half:], draft=False)
            return
        self._commit(ScheduledBatch(rows=rows), new_tokens)

    def _compute(self, batch: ScheduledBatch, draft: bool) -> list[list[int]]:
        decode = batch.decode_rows
        self.resources.prepare(batch.requests)
        t0 = time.perf_counter()
        worth = self.scheduler.policy.wait_worth_s
        if self.drafts.prepare(decode, draft, self.step_no, wait_worth_s=worth):
            # the drafter's exposed time: asking, waiting, checking
            took = time.perf_counter() - t0
            self._draft_wait += took
            self.metrics.batched.add(self.metrics.draft_seconds, took)
        logits = self.runner.forward(batch.rows, [self.kv.block_table(r) for r in batch.requests])
        # Waiting for the GPU is the step's only sync (verify would sync here anyway); timing
        # it from the launch separates the GPU's share of a step from the host's. What the host
        # does meanwhile (a held question, the output's hand-over) runs beside the device, so it
        # is not the step's host time: counted there, it priced a remote drafter's synchronous
        # steps ~0.015 ms dearer than they are and the policy drafted on fewer of them.
        t0 = time.perf_counter()
        self._launched()
        self._admit_arrivals()
        if logits.graph is None:
            self.metrics.batched.add(self.metrics.eager_steps, 1)
        # The policy's sums for the next step, which decodes these requests again unless they
        # finish: priced while the device runs instead of on the next step's critical path.
        self.scheduler.policy.presum([row.request for row in decode])
        self.drafts.device_running(self.runner, logits, self.step_no)
        self.runner.wait(logits)
        self._gpu_wait += time.perf_counter() - t0
        self._admit_arrivals()  # those that came while it ran: asked before the commit
        self._observe_gpu(logits)
        logits.device_drafts(batch.rows)  # drafted on the device: the real drafts
        return self.verifier.verify(decode, logits)

    def _launched(self) -> None:
        """A step is on the device: a question the drafter held back goes out, and the output
        thread gets what was held for it (`OutputWorker`: it renders while the device runs)."""
        self.drafts.launched(self.step_no)
        self._release_held()

    def _release_held(self) -> None:
        """What a synchronous step held for the next launch goes now: its records (acceptance,
        metrics), then its rendering (so a client that sees its stream end finds the step in
        the metrics)."""
        self._record_held()
        self.output.release()

    def _record_held(self) -> None:
        held, self._held_records = self._held_records, []
        observe = self.scheduler.policy.observe
        for observed, recovering, verified, itls, generated in held:
            for req, drafted, accepted in observed:
                if not req.finished:  # cancelled since: its estimate is gone
                    observe(req, drafted, accepted, recovering)
            self.stats.record_many(verified)
            self.metrics.on_verified(verified)
            self.metrics.observe_itl(itls)
            self.metrics.on_generated(generated)

    def _render(self, rendered: list[tuple]) -> None:
        """Hand a step's rendering to the output thread: at once when a step is on the device
        (the host work until the next launch is hidden behind it), else at the next launch."""
        self.output.render_many(rendered)
        if self._device_busy:
            self._release_held()

    def _commit(self, batch: ScheduledBatch, verified) -> None:
        decode = batch.decode_rows
        new_tokens, logprobs = verified
        accepted = {
            r.request.request_id: len(t) - 1 for r, t in zip(decode, new_tokens, strict=True)
        }
        self._advance(batch.rows, accepted)
        try:
            self.resources.update(batch.requests, accepted)
        except Exception as exc:  # a resource manager bug: these requests' state is unknown
            log.exception("resource update failed at step %d", self.step_no)
            for req in batch.requests:
                self._fail(req, f"resource update failed: {exc}")
            return
        # The drafter hears as soon as the tokens are on their streams (what the finish rules
        # ended, it does not hear): its round trip then runs while this step's bookkeeping is
        # done and the next step is scheduled. In the CPU proxy at 8 rows the steps that waited
        # for the reply went from 2 in 3 to 1 in 35 (round 42). Then the rendering is handed
        # over: at once when a step is on the device, else held until the next launch
        # (`_render`), so the round trip and the next step's preparation do not share the GIL
        # with the output thread.
        appended, itls = self._append(decode, new_tokens)
        exposed = self.drafts.hears_steps and not self._device_busy  # nothing in flight
        t0 = time.perf_counter() if exposed else 0.0
        if self.drafts.hears_steps:
            going_on = [
                row.request
                for row, (_, _, reason) in zip(decode, appended, strict=True)
                if reason is None
            ]
            self.drafts.submit(going_on, self.step_no, self._device_busy)
        if exposed:
            self.metrics.batched.add(self.metrics.drafter_ask_seconds, time.perf_counter() - t0)
        self._render(self.emit(decode, new_tokens, logprobs, appended, itls))

    # -- phases ----------------------------------------------------------------------------------
    def _advance(self, rows: list[Row], accepted: dict[str, int]) -> None:
        """KV now holds the fed committed tokens plus each decode row's accepted drafts."""
        for row in rows:
            req = row.request
            req.num_computed += row.num_committed + accepted.get(req.request_id, 0)
            if row.decode:
                req.state = RequestState.DECODE

    def _append(
        self, rows: Sequence[Row], new_tokens: list[list[int]]
    ) -> tuple[list[tuple[OutputStream, list[int], str | None]], list[float]]:
        """Append each row's tokens to its stream and apply the token-level finish rules:
        (stream, tokens kept, finish reason or None) per row, and the step's inter-token
        latencies. `emit` records the step."""
        now = time.monotonic()
        itls: list[float] = []
        appended = []
        for row, toks in zip(rows, new_tokens, strict=True):
            stream = self.streams[row.request.request_id]
            kept, reason = stream.append(toks, itls, now)
            appended.append((stream, kept, reason))
        return appended, itls

    def emit(
        self,
        rows: Sequence[Row],
        new_tokens: list[list[int]],
        logprobs: Sequence[list[TokenLogprob] | None],
        appended: list[tuple[OutputStream, list[int], str | None]],
        itls: list[float],
    ) -> list[tuple]:
        """Record a step whose tokens `_append` put on their streams (`appended`): the
        requests the finish rules ended are released, and the acceptance and the metrics are
        held until a step is on the device (`_release_held`). Returns
        the rows' rendering for the output thread (`OutputWorker.render_many`), which the
        caller hands over."""
        rendered, verified, observed, generated = [], [], [], 0
        policy = self.scheduler.policy
        for row, toks, lps, (stream, kept, reason) in zip(
            rows, new_tokens, logprobs, appended, strict=True
        ):
            req = row.request
            drafted, acc = len(row.drafts), len(toks) - 1
            req.stats.record(drafted, acc)
            verified.append((drafted, acc))
            generated += len(kept)
            rendered.append((stream, kept, reason, drafted, acc, self.step_no, lps))
            if reason is None:
                observed.append((req, drafted, acc))
            else:  # observed before its estimate is forgotten
                policy.observe(req, drafted, acc)
                self._release(req)
        # Per step, not per row (and batched: `TargetMetrics.batched`), and held with the
        # rendering until a step is on the device (`_release_held`).
        self._held_records.append((observed, policy.recovering, verified, itls, generated))
        self._generated += generated
        return rendered

    def _stopped(self, request_id: str) -> None:
        """From the output thread: a stop string finished this request's stream."""
        with self._wake:
            self._inbox.append(("stopped", request_id))
            self._wake.notify()

    def _finish(self, req: Request, reason: str) -> None:
        self.output.submit(self.streams[req.request_id].finish, reason)
        self._release(req)

    def _fail(self, req: Request, message: str) -> None:
        if req.finished:
            return
        stream = self.streams.get(req.request_id)
        if stream is not None:
            self.output.submit(stream.fail, "INTERNAL", message)
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.finished:
            return
        self._sync_requests -= self._needs_host(req)
        req.state = RequestState.FINISHED
        self.scheduler.remove(req)
        self.scheduler.policy.forget(req)
        self.resources.free(req)  # never raises; every manager gets its chance
        self.streams.pop(req.request_id, None)
