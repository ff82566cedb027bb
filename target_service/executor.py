"""The executor: one thread owns the model and runs the step lifecycle.

    batch = scheduler.schedule()
    resources.prepare(batch)
    drafter.prepare_draft_tokens(decode rows, resources)   # unpadded
    pad_drafts(decode rows)                                # executor-owned
    logits = runner.forward(batch)
    new_tokens = verifier.verify(decode rows, logits)
    resources.update(batch, accepted)
    emit(batch)

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

from target_service.drafters.base import Drafter
from target_service.metrics import TargetMetrics
from target_service.output import OutputStream
from target_service.request import Request, RequestState, SpecStats
from target_service.resources.base import ResourceRegistry
from target_service.resources.kv_cache import KVCacheManager
from target_service.runner.model_runner import ModelRunner
from target_service.scheduler import Row, ScheduledBatch, Scheduler
from target_service.verifier import TokenLogprob, Verifier

log = logging.getLogger(__name__)


class Executor:
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
        self.streams: dict[str, OutputStream] = {}
        self.stats = SpecStats(histogram=[0] * (max_draft_len + 1))
        self.step_no = 0
        self.drafter_errors = 0
        self.metrics = TargetMetrics()
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- called from other threads -------------------------------------------------------------
    def submit(self, request: Request) -> OutputStream:
        stream = self.make_stream(request)
        request.arrival_time = time.monotonic()
        if request.sampling.seed is not None:
            request.generator = torch.Generator().manual_seed(request.sampling.seed)
        elif not request.sampling.greedy:
            request.generator = torch.Generator()
            request.generator.seed()
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
        if self.drafter is not None:
            self.drafter.close()

    # -- the executor thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.scheduler.has_work:
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    return
            self._drain_inbox()
            if self.scheduler.has_work:
                self.step()

    def _drain_inbox(self) -> None:
        with self._wake:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, payload in items:
            if kind == "add":
                stream = payload
                assert isinstance(stream, OutputStream)
                self.streams[stream.request.request_id] = stream
                self.scheduler.add(stream.request)
            elif kind == "cancel" and payload in self.streams:
                self._finish(self.streams[payload].request, "cancelled")

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive steps on the caller's thread (tests and benchmarks without the server)."""
        for _ in range(max_steps):
            self._drain_inbox()
            if not self.scheduler.has_work:
                return
            self.step()

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            time.sleep(0.001)  # waiting for KV blocks held by finishing requests
            return
        self.step_no += 1
        t0 = time.perf_counter()
        try:
            self._step(batch)
        except Exception as exc:  # fail this batch's requests, keep serving the rest
            log.exception("step %d failed", self.step_no)
            for req in batch.requests:
                if not req.finished:
                    self.streams[req.request_id].fail("INTERNAL", f"step failed: {exc}")
                    self._release(req)
        m = self.metrics
        m.steps.inc()
        m.step_seconds.observe(time.perf_counter() - t0)
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        m.kv_free.set(self.kv.num_free_blocks)

    def _step(self, batch: ScheduledBatch) -> None:
        decode = batch.decode_requests
        self.resources.prepare(batch.requests)
        self.prepare_drafts(decode)
        logits = self.runner.forward(batch.rows, [self.kv.block_table(r) for r in batch.requests])
        new_tokens, logprobs = self.verifier.verify(decode, logits)
        accepted = {r.request_id: len(t) - 1 for r, t in zip(decode, new_tokens, strict=False)}
        self._advance(batch.rows, accepted)
        self.resources.update(batch.requests, accepted)
        self.emit(decode, new_tokens, logprobs)

    # -- phases ----------------------------------------------------------------------------------
    def prepare_drafts(self, requests: Sequence[Request]) -> None:
        """Ask the drafter (unpadded), sanitise, then pad to one length for the whole step."""
        for req in requests:
            req.draft_tokens, req.draft_probs = [], None
        drafting = [r for r in requests if r.draft_budget > 0]
        if self.drafter is not None and drafting:
            try:
                self.drafter.prepare_draft_tokens(drafting, self.resources)
            except Exception:  # fail open: a drafter bug costs speed, never output
                log.exception("drafter failed at step %d; verifying without drafts", self.step_no)
                self.drafter_errors += 1
                for req in drafting:
                    req.draft_tokens, req.draft_probs = [], None
        for req in requests:
            self._sanitise(req)
        # Pad to max_draft_len when anyone drafted (one graph shape), else verify 1 token/row.
        pad_to = self.max_draft_len if any(r.num_real_drafts for r in requests) else 0
        for req in requests:
            req.draft_tokens = req.draft_tokens + [0] * (pad_to - len(req.draft_tokens))

    def _sanitise(self, req: Request) -> None:
        drafts = list(req.draft_tokens or [])
        probs = req.draft_probs
        budget = req.draft_budget
        if len(drafts) > budget:
            req.stats.truncated_draft_tokens += len(drafts) - budget
            self.stats.truncated_draft_tokens += len(drafts) - budget
            drafts = drafts[:budget]
        if any(not (isinstance(t, int) and 0 <= t < self.vocab_size) for t in drafts):
            req.stats.refused_draft_tokens += len(drafts)
            self.stats.refused_draft_tokens += len(drafts)
            drafts, probs = [], None
        if probs is not None:
            probs = list(probs)[: len(drafts)]
            if len(probs) != len(drafts):
                probs = None  # incomplete distributions: treat drafts as point masses
        req.draft_tokens, req.draft_probs, req.num_real_drafts = drafts, probs, len(drafts)

    def _advance(self, rows: list[Row], accepted: dict[str, int]) -> None:
        """KV now holds the fed committed tokens plus each decode row's accepted drafts."""
        for row in rows:
            req = row.request
            req.num_computed += row.num_committed + accepted.get(req.request_id, 0)
            if row.decode:
                req.state = RequestState.DECODE

    def emit(
        self,
        requests: Sequence[Request],
        new_tokens: list[list[int]],
        logprobs: Sequence[list[TokenLogprob] | None],
    ) -> None:
        for req, toks, lps in zip(requests, new_tokens, logprobs, strict=False):
            drafted, acc = req.num_real_drafts, len(toks) - 1
            req.stats.record(drafted, acc)
            self.stats.record(drafted, acc)
            self.metrics.tokens.inc(len(toks))
            self.metrics.drafted.inc(drafted)
            self.metrics.accepted.inc(acc)
            if self.streams[req.request_id].commit(toks, drafted, acc, self.step_no, lps):
                self._release(req)

    def _finish(self, req: Request, reason: str) -> None:
        self.streams[req.request_id].finish(reason)
        self._release(req)

    def _release(self, req: Request) -> None:
        req.state = RequestState.FINISHED
        self.scheduler.remove(req)
        self.resources.free(req)
        self.streams.pop(req.request_id, None)
