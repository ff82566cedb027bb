"""The executor's overlapped step modes, as mixins of `Executor` (executor.py), which owns the
state they use (`_inflight`, `_inflight_spec`, the scheduler, runner, streams and metrics).

`OverlappedSteps`: a plain greedy step is committed optimistically (a placeholder token per
decode row), launched, and only then is the step before it read; the next step feeds the
placeholders from that step's argmax on the device. With `--pipeline-drafts`, a step whose
rows draft on the device runs the same way: committed as if no draft will be accepted, its
drafts unread (`Request.unread_drafts`), and the next step's rows are shifted on the device
by what it accepted (runner/pipeline.py).

`TwoBatchSteps` (`--two-batch-rows`): speculative steps alternate two disjoint halves of the
batch; a step schedules, drafts and launches the requests that are not in the step in flight,
then reads, verifies and commits that step.

`docs/architecture.md` ("Overlapped steps", "Two-batch overlap") states their invariants.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from specwire.target_service.request import PENDING, Request, RequestState
from specwire.target_service.runner.model_runner import StepLogits
from specwire.target_service.scheduler import Row, ScheduledBatch
from specwire.target_service.verifier import Verified

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """An overlapped step: launched and committed optimistically, its tokens not read yet."""

    step_no: int
    logits: StepLogits
    # per decode row: (request, index of its placeholder in output_ids, logit row)
    pending: list[tuple[Request, int, int]]
    t_launch: float
    rows: int  # rows in the step (the policy's rates are per batch size)
    tokens: int  # tokens it fed (the policy prices plain steps by them)
    may_draft: bool  # whether any of its requests may speculate at all (`ScheduledBatch`)
    generated: int = 0  # output tokens it committed (known once read)
    src: dict[str, int] = field(default_factory=dict)  # request id -> its logit row
    # Pipelined drafting: request id -> its row in the step; the decode rows (as `pending`),
    # whose drafts are verified when the step is read; whether any row drafted.
    row_of: dict[str, int] = field(default_factory=dict)
    decode: list[Row] = field(default_factory=list)
    unread: list[int] = field(default_factory=list)  # per decode row: drafts fed (placeholders)
    drafted: bool = False


@dataclass
class InFlightSpec:
    """A speculative step of the two-batch overlap: launched with its drafts, not read yet.
    Its requests are neither scheduled nor preempted until it is completed."""

    step_no: int
    rows: list[Row]
    logits: StepLogits
    t_launch: float
    ids: frozenset[str]  # its requests
    # Rows of both halves (the policy's rate is per row): running + waiting requests (up to
    # max_batch_size) or its rows plus the step in flight's, whichever is larger.
    rows_total: int


class OverlappedSteps:
    """Plain greedy steps launched before the previous step's tokens are read."""

    def _step_overlapped(self, batch: ScheduledBatch) -> None:
        """Launch `batch` (no drafts, or pipelined: drafted on the device), commit it
        optimistically, then read the step before it."""
        prev = self._inflight
        t0 = time.perf_counter()
        decode = batch.decode_rows
        if prev is not None:
            row_of = prev.row_of  # (empty unless it drafted: no row moves after a plain step)
            for row in decode:
                rid = row.request.request_id
                row.feed_src = prev.src.get(rid, -1)
                row.after = row_of.get(rid, -1) if row_of else -1
        try:
            self.resources.prepare(batch.requests)
            if self.pipelined and any(r.request.draft_budget > 0 for r in decode):
                done = None if prev is None else (lambda: self.runner.ready(prev.logits))
                self.drafts.prepare(
                    decode, True, self.step_no, device_busy=prev is not None, device_done=done
                )
            logits = self.runner.forward(
                batch.rows, [self.kv.block_table(r) for r in batch.requests]
            )
            self._launched()
        except Exception:
            # Run it the careful way: finish the step in flight, then retry in isolation.
            log.warning("overlapped step %d failed to launch; retrying it", self.step_no)
            self._finish_inflight()
            rows = [r for r in batch.rows if not r.request.finished]
            for row in rows:
                row.feed_src = row.after = -1
                row.slack = 0
            self._gpu_wait = 0.0
            self._run_isolated(rows, draft=False)
            return
        if logits.graph is None:
            self.metrics.batched.add(self.metrics.eager_steps, 1)
        self.metrics.batched.add(self.metrics.overlapped_steps, 1)
        tokens = sum(row.num_committed + len(row.drafts) for row in batch.rows)
        launched = InFlight(
            self.step_no, logits, [], t0, len(batch.rows), tokens, may_draft=batch.may_draft
        )
        pipelined = self.pipelined  # (its bookkeeping only where steps may draft)
        # A pipelined step with drafts: the next step's rows move by what it accepts, and it
        # is read as a drafting step. One without is read as a plain step, and the next
        # moves nothing (plain steps under load skip the bookkeeping, and the staging).
        drafted = launched.drafted = pipelined and any(row.drafts for row in decode)
        for i, row in enumerate(batch.rows):
            req = row.request
            req.num_computed += row.num_committed
            if drafted:
                launched.row_of[req.request_id] = i
            if not row.decode:
                continue
            req.state = RequestState.DECODE
            req.output_ids.append(PENDING)
            if pipelined:
                req.drafts_in_flight = row.drafts  # (what a remote drafter's hypothesis reads)
            if drafted:
                req.unread_drafts += len(row.drafts)
                launched.unread.append(len(row.drafts))
                launched.decode.append(row)
            off = logits.spans[len(launched.pending)][0]
            launched.pending.append((req, len(req.output_ids) - 1, off))
            launched.src[req.request_id] = off
            if self.streams[req.request_id].ends_at(len(req.output_ids)):
                self.scheduler.remove(req)  # its last token is in flight: never run it again
        if launched.drafted:
            self.metrics.batched.add(self.metrics.pipelined_steps, 1)
        self.resources.update(batch.requests, {})
        self._inflight = launched
        if prev is not None:
            self._gpu_wait = 0.0
            self._complete(prev)
            self._observed_plain(prev, t0 - prev.t_launch, steady=True)

    def _in_flight_limits(self) -> tuple[frozenset[str], frozenset[str]]:
        """Pipelined: (requests the step in flight may end, which the next step must not
        schedule — their rows could run past the context —, requests whose drafts in it are
        unread, which it must not preempt)."""
        prev = self._inflight
        if prev is None or not prev.drafted:
            return frozenset(), frozenset()
        ending, pinned = set(), set()
        for req, _i, _o in prev.pending:
            if req.unread_drafts and not req.finished:
                pinned.add(req.request_id)
                stream = self.streams[req.request_id]
                if stream.ends_at(len(req.output_ids) + req.unread_drafts):
                    ending.add(req.request_id)
        return frozenset(ending), frozenset(pinned)

    def _finish_inflight(self, observe: bool = True) -> None:
        """Read the step in flight, if any. `observe`: time it as an overlapped step (launch
        to now); otherwise its wait is the caller's to account for."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return
        if not observe:
            self._complete(prev)
            self.metrics.batched.add(self.metrics.steps, 1)
            return
        self._gpu_wait = 0.0
        self._complete(prev)
        self._observed_plain(prev, time.perf_counter() - prev.t_launch)

    def _observed_plain(self, done: InFlight, period: float, steady: bool = False) -> None:
        """`steady`: `period` runs from `done`'s launch to the next overlapped launch (what a
        plain step costs while plain steps follow each other), so the policy may price plain
        steps by it; a drain (launch to read) is not such a period."""
        policy = self.scheduler.policy
        plain = not done.drafted  # a pipelined drafting step is speculation's evidence
        policy.observe_rate(done.generated, period, done.rows, done.may_draft, overlapped=plain)
        if steady:
            policy.observe_plain(done.rows, done.tokens, period)
        self._count_step(period)

    def _complete(self, done: InFlight) -> None:
        """Read an overlapped step's tokens and commit them (rows of requests that finished in
        the meantime are dropped)."""
        if self._inflight is done:
            self._inflight = None
        t0 = time.perf_counter()
        try:
            self.drafts.device_running(self.runner, done.logits, done.step_no)
            self.runner.wait(done.logits)
            self._observe_gpu(done.logits)
            tokens = done.logits.tokens()
            if done.drafted:
                done.logits.device_drafts(done.decode)  # the real drafts
                verified = self.verifier.verify(done.decode, done.logits).tokens
        except Exception as exc:  # the device failed this step: its requests' state is unknown
            log.exception("overlapped step %d failed", done.step_no)
            for req, _i, _o in done.pending:
                self._fail(req, f"step failed: {exc}")
            return
        finally:
            self._gpu_wait += time.perf_counter() - t0
        if done.drafted:
            self._complete_drafted(done, verified)
            return
        now = time.monotonic()
        rendered: list[tuple] = []
        itls: list[float] = []
        observe = self.scheduler.policy.observe
        for req, _index, off in done.pending:
            if req.finished:
                continue  # cancelled, stopped or ended by EOS while this step ran
            stream = self.streams[req.request_id]
            kept, reason = stream.resolve(stream.first_pending(), tokens[off], now, itls)
            req.stats.record(0, 0)
            observe(req, 0, 0)
            rendered.append((stream, kept, reason, 0, 0, done.step_no, None))
            if reason is not None:
                self._release(req)
        # Per step, not per row (metrics batched: `TargetMetrics.batched`).
        self.stats.record_plain(len(rendered))
        self.metrics.observe_itl(itls)
        self.metrics.on_generated(len(rendered))
        done.generated = len(rendered)
        self._generated += len(rendered)
        if self.drafts.hears_steps and self.scheduler.policy.mode == "spec":
            # A plain step inside the speculative mode (the policy chose k = 0 for it): a
            # drafter that drafts off the critical path (remote) hears it too, so the next
            # speculative step finds a proposal made from the current tokens, not from before the
            # plain stretch (it continues it past the token now in flight: the look-ahead).
            # Under load the mode is plain: no message per step there.
            self.drafts.submit(
                [req for req, _i, _o in done.pending], done.step_no, self._device_busy
            )
        self._render(rendered)

    def _complete_drafted(self, done: InFlight, verified: list[list[int]]) -> None:
        """Commit a pipelined drafting step once read: each row's accepted drafts and the
        token after them replace its placeholder, and its cache keeps what the step in
        flight after it may still fill."""
        now = time.monotonic()
        rendered: list[tuple] = []
        itls: list[float] = []
        rows: list[tuple[int, int]] = []
        going_on: list[Request] = []
        generated = 0
        observe = self.scheduler.policy.observe
        for (req, _i, _o), row, fed, toks in zip(
            done.pending, done.decode, done.unread, verified, strict=True
        ):
            drafted, acc = len(row.drafts), len(toks) - 1
            req.unread_drafts -= fed
            if req.finished:
                continue  # cancelled, stopped or ended by EOS while this step ran
            req.num_computed += acc
            stream = self.streams[req.request_id]
            kept, reason = stream.resolve_many(toks, now, itls)
            req.stats.record(drafted, acc)
            observe(req, drafted, acc)
            rows.append((drafted, acc))
            generated += len(kept)
            rendered.append((stream, kept, reason, drafted, acc, done.step_no, None))
            if reason is not None:
                self._release(req)
            else:
                going_on.append(req)
        self.resources.update(going_on, {})  # rejected drafts' blocks go back
        if self.drafts.hears_steps:
            # A drafter off the critical path (remote) hears the outcome at once: its reply is
            # due when the step after the one in flight is staged (`RemoteSessions`' hypothesis).
            self.drafts.submit(going_on, done.step_no, device_busy=True)
        self.stats.record_many(rows)
        self.metrics.on_verified(rows)
        self.metrics.observe_itl(itls)
        self.metrics.on_generated(generated)
        done.generated = generated
        self._generated += generated
        self._render(rendered)


class TwoBatchSteps:
    """Speculative steps as two alternating halves of the batch (`two_batch_rows`)."""

    def _two_batch_ok(self, overlap: bool, step_k: int) -> bool:
        """Whether this step runs as one half of the two-batch overlap: a speculative step
        (the policy drafts), overlapping allowed, every request greedy without logprobs (their
        tokens are read from the argmax copied back, never from logits the next step
        overwrites), and at least `two_batch_rows` (and two) requests to split."""
        if not (self.two_batch_rows > 0 and self.overlap and not overlap and step_k > 0):
            return False
        sched = self.scheduler
        rows = min(len(sched.running) + len(sched.waiting), sched.config.max_batch_size)
        return self._sync_requests <= 0 and rows >= max(2, self.two_batch_rows)

    def _step_two_batch(self, step_k: int) -> None:
        """Schedule, draft and launch the requests that are not in the step in flight (at
        most half of all), then read and commit the step in flight: its verification,
        committing and streaming, and this step's scheduling and drafting, run on the host
        while the device runs the other half."""
        prev = self._inflight_spec
        in_flight = len(prev.rows) if prev is not None else 0
        sched = self.scheduler
        total = min(len(sched.running) + len(sched.waiting), sched.config.max_batch_size)
        max_rows = min(sched.config.max_batch_size - in_flight, (total + 1) // 2)
        if max_rows <= 0:
            self._finish_spec()
            return
        t0 = time.perf_counter()
        exclude = prev.ids if prev is not None else frozenset()
        batch = self._schedule(step_k, exclude, max_rows)
        if batch is None:
            return
        decode = batch.decode_rows
        try:
            self.resources.prepare(batch.requests)
            t1 = time.perf_counter()
            busy = prev is not None  # the other half runs on the device meanwhile
            if self.drafts.prepare(
                decode, ask_drafter=True, step_no=self.step_no, device_busy=busy
            ):
                self.metrics.batched.add(self.metrics.draft_seconds, time.perf_counter() - t1)
            logits = self.runner.forward(
                batch.rows, [self.kv.block_table(r) for r in batch.requests]
            )
            self._launched()
        except Exception:
            # Run it the careful way: finish the step in flight, then retry in isolation.
            # (Without drafts, as any retry: the drafter was asked once for this step.)
            log.warning("two-batch step %d failed to launch; retrying it", self.step_no)
            self._finish_spec()
            self._gpu_wait = 0.0
            generated, rows = self._generated, [r for r in batch.rows if not r.request.finished]
            self._run_isolated(rows, draft=False)
            now = time.perf_counter()
            self.scheduler.policy.observe_rate(self._generated - generated, now - t0, total)
            self._count_step(now - t0)
            return
        if logits.graph is None:
            self.metrics.batched.add(self.metrics.eager_steps, 1)
        self.metrics.batched.add(self.metrics.two_batch_steps, 1)
        ids = frozenset(r.request.request_id for r in batch.rows)
        rows_total = max(total, len(batch.rows) + in_flight)
        self._inflight_spec = InFlightSpec(self.step_no, batch.rows, logits, t0, ids, rows_total)
        if prev is not None:
            generated = self._generated
            self._gpu_wait = 0.0
            self._complete_spec(prev)
            self._observed_spec(prev, self._generated - generated, t0 - prev.t_launch)

    def _finish_spec(self, observe: bool = True) -> None:
        """Read and commit the two-batch step in flight, if any (timed launch to now).
        `observe=False`: its tokens are the caller's to report."""
        prev = self._inflight_spec
        if prev is None:
            return
        generated = self._generated
        self._gpu_wait = 0.0
        self._complete_spec(prev)
        if observe:
            period = time.perf_counter() - prev.t_launch
            self._observed_spec(prev, self._generated - generated, period)

    def _observed_spec(self, done: InFlightSpec, generated: int, period: float) -> None:
        if self._spec_carry is not None:  # the plain step drained on entering the mode
            generated += self._spec_carry[0]
            period += self._spec_carry[1]
            self._spec_carry = None
        # Per row of both halves: each request runs every other period.
        self.scheduler.policy.observe_rate(generated, period, done.rows_total)
        self._count_step(period)

    def _complete_spec(self, done: InFlightSpec) -> None:
        """Wait for a two-batch step, verify and commit it. Rows of requests that finished
        meanwhile (cancelled, stopped) are dropped. If reading or verifying raises, the other
        step in flight is completed first (nothing else may use the device's staging buffers
        while it runs), then this step's rows are retried in isolation, without drafts."""
        if self._inflight_spec is done:
            self._inflight_spec = None
        decode = [r for r in done.rows if r.decode]
        t0 = time.perf_counter()
        try:
            self.drafts.device_running(self.runner, done.logits, done.step_no)
            self.runner.wait(done.logits)
            self._observe_gpu(done.logits)
            done.logits.device_drafts(done.rows)
            verified = self.verifier.verify(decode, done.logits)
        except Exception:
            log.warning("two-batch step %d failed; retrying its rows", done.step_no)
            self._gpu_wait += time.perf_counter() - t0
            self._finish_spec(observe=False)  # counted by whoever is completing `done`
            self._run_isolated([r for r in done.rows if not r.request.finished], draft=False)
            return
        self._gpu_wait += time.perf_counter() - t0
        rows = done.rows
        if any(r.request.finished for r in rows):
            keep = [i for i, r in enumerate(decode) if not r.request.finished]
            verified = Verified(
                [verified.tokens[i] for i in keep], [verified.logprobs[i] for i in keep]
            )
            rows = [r for r in rows if not r.request.finished]
        self._commit(ScheduledBatch(rows=rows), verified)
