"""Turning committed tokens into what the client sees: text deltas, stop rules, events.

A request finishes at EOS (unless ignored), at max_new_tokens, when the context is full, or
when its text contains a stop string (the stop string itself is not returned, and text that
might be the start of a stop string is held back until it is known not to be).

A request's n completions (n > 1) are n Requests whose streams share one event queue; every
event carries its completion's `index`. `StreamFactory` builds the streams and routes them.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time

from specwire.common.tokenizer import IncrementalDecoder, Tokenizer
from specwire.target_service.events import (  # noqa: F401 - re-exported for callers
    Chunk,
    Complete,
    Event,
    EventQueue,
    Failed,
    Logprob,
    TokenLogprobs,
    deferred_wakeups,
)
from specwire.target_service.metrics import TargetMetrics
from specwire.target_service.request import PENDING, Request
from specwire.target_service.verifier import TokenLogprob

log = logging.getLogger(__name__)


class OutputStream:
    """Per-request output state, owned by the executor; events go to `events` (thread-safe)."""

    def __init__(
        self,
        request: Request,
        tokenizer: Tokenizer,
        eos_ids: set[int],
        max_context: int,
        events: EventQueue | None = None,
        index: int = 0,
        metrics: TargetMetrics | None = None,
        interval: int = 1,
    ):
        self.request = request
        # Steps per streamed chunk (--stream-interval): the first chunk and the last are never
        # held; between them a chunk goes out once it spans `interval` steps.
        self.interval = interval
        self.held: Chunk | None = None  # rendered, not sent yet
        self.chunks_sent = 0
        self.metrics = metrics or TargetMetrics()
        self.events = EventQueue() if events is None else events
        self.index = index
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.eos_ids = frozenset(eos_ids)
        self.max_context = max_context
        # Everything decoded so far (stop strings cut it). Without stop strings every piece
        # is final the moment it is decoded: the pieces are joined once, at the end (growing
        # one string a token at a time copies it whole each time).
        self.text = ""
        self._pieces: list[str] | None = None if request.stop else []
        self.sent = 0  # characters of `text` already streamed
        self.num_rendered = 0  # output tokens rendered (the executor may be a step ahead)
        self.done = False  # a Complete or Failed event was sent: nothing more goes out
        self.scanned = 0  # `text[:scanned]` holds no stop string (matching is incremental)
        self.longest_stop = max((len(s) for s in request.stop), default=0)
        self.last_commit_time: float | None = None  # when `append` last committed tokens

    def commit(
        self,
        new_tokens: list[int],
        drafted: int,
        accepted: int,
        step: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bool:
        """Both halves at once (tests and single-threaded use): True when finished."""
        kept, reason = self.append(new_tokens)
        return self.render(kept, reason, drafted, accepted, step, logprobs)

    def append(
        self, new_tokens: list[int], itls: list[float] | None = None, now: float | None = None
    ) -> tuple[list[int], str | None]:
        """The executor's half: append verified tokens and apply the token-level finish rules
        (EOS, context, length). Returns the tokens kept and the finish reason, if any. Cheap:
        no text is produced here. With `itls`, the caller counts the kept tokens in the metrics
        and observes the chunk's inter-token latency (appended to `itls`) once for a whole
        step, as `resolve` does; a first token's TTFT is observed here."""
        req = self.request
        if now is None:
            now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        out = req.output_ids
        total = len(out) + len(new_tokens)
        reason = None
        if (
            total < req.max_new_tokens
            and len(req.prompt_ids) + total < self.max_context
            and (req.ignore_eos or self.eos_ids.isdisjoint(new_tokens))
        ):  # no token can end the request (most steps): the rules need no token-by-token look
            out.extend(new_tokens)
            kept = list(new_tokens)
        else:
            kept = []
            for tok in new_tokens:
                out.append(tok)
                kept.append(tok)
                reason = self._finish_rule(tok, len(out))
                if reason:
                    break
        previous = self.last_commit_time
        if itls is None:
            self.metrics.on_committed(req, len(kept), previous, now)
        elif previous is not None:
            itls.append((now - previous) / len(kept))
        else:
            self.metrics.on_latency(req, len(kept), previous, now)
        self.last_commit_time = now
        return kept, reason

    def _finish_rule(self, token: int, num_output: int) -> str | None:
        """Why the request ends with `token` as its `num_output`-th output token, if it does."""
        req = self.request
        if token in self.eos_ids and not req.ignore_eos:
            return "eos"
        if len(req.prompt_ids) + num_output >= self.max_context:
            return "context"  # before length: a full context is the real reason
        if num_output >= req.max_new_tokens:
            return "length"
        return None

    def ends_at(self, num_output: int) -> bool:
        """Whether the request ends at its `num_output`-th output token whatever it is (length
        or context): an overlapped step then never schedules it after that token."""
        req = self.request
        return (
            len(req.prompt_ids) + num_output >= self.max_context or num_output >= req.max_new_tokens
        )

    def first_pending(self) -> int:
        """The index of the first placeholder in `output_ids`: the oldest step in flight's
        token (at most two steps are; a placeholder is among the last two tokens)."""
        out = self.request.output_ids
        return len(out) - 2 if len(out) >= 2 and out[-2] == PENDING else len(out) - 1

    def resolve_many(
        self, tokens: list[int], now: float, itls: list[float]
    ) -> tuple[list[int], str | None]:
        """`resolve` for a pipelined drafting step: its first placeholder becomes `tokens`
        (the accepted drafts and the token after them), with the finish rules of `append`;
        a later placeholder stays after them unless the request finished."""
        out = self.request.output_ids
        at = self.first_pending()
        later = out[at + 1 :]
        del out[at:]
        kept, reason = self.append(tokens, itls, now)
        if reason is None:
            out.extend(later)
        return kept, reason

    def resolve(
        self, index: int, token: int, now: float, itls: list[float]
    ) -> tuple[list[int], str | None]:
        """`append` for overlapped steps: output position `index` held a placeholder while its
        step ran; now (`now`) its token is known. On a finish, later placeholders (a step
        launched before this token was read) are dropped. The caller counts the token in the
        metrics, and observes its inter-token latency (appended to `itls`), once for the whole
        step; a first token's TTFT is observed here."""
        req = self.request
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_ids[index] = token
        reason = self._finish_rule(token, index + 1)
        if reason:
            del req.output_ids[index + 1 :]
        previous = self.last_commit_time
        if previous is not None:
            itls.append(now - previous)
        else:
            self.metrics.on_latency(req, 1, previous, now)
        self.last_commit_time = now
        return [token], reason

    def render(
        self,
        kept: list[int],
        reason: str | None,
        drafted: int,
        accepted: int,
        step: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bool:
        """The output half (the output thread): detokenise, apply stop strings, stream a chunk
        and, when finished, the completion. True when the request finished here or before;
        a stream that already finished ignores late tokens."""
        if self.done:
            return True
        self.num_rendered += len(kept)
        ids_for_text = kept[:-1] if reason == "eos" else kept
        delta = self.decoder.feed_many(ids_for_text)
        if reason:
            delta += self.decoder.flush()
        if self._pieces is not None:  # no stop strings: all of it goes out now
            if delta:
                self._pieces.append(delta)
        else:
            delta, reason = self._cut_stops(delta, reason)
        lps = self._with_text(logprobs[: len(kept)]) if logprobs is not None else None
        chunk = Chunk(kept, delta, drafted, min(accepted, len(kept)), step, lps, self.index)
        held, self.held = self.held, None  # one read: `fail` may clear it from another thread
        if held is not None:
            chunk = held.merge(chunk)
        if reason is None and self.chunks_sent and chunk.num_steps < self.interval:
            self.held = chunk
        else:
            self._send(chunk)
        if reason:
            self.finish(reason)
            return True
        return False

    def _cut_stops(self, new_text: str, reason: str | None) -> tuple[str, str | None]:
        """With stop strings: append `new_text`, end at a stop string, hold back a tail that
        may start one; (the text that may go out now, the finish reason)."""
        self.text += new_text
        stop_at = self._find_stop()
        if stop_at is not None:
            self.text = self.text[:stop_at]
            reason = "stop"
        visible = len(self.text) if reason else len(self.text) - self._held_back()
        delta = self.text[self.sent : max(self.sent, visible)]
        self.sent = max(self.sent, visible)
        return delta, reason

    def _send(self, chunk: Chunk) -> None:
        self.events.put(chunk)
        self.chunks_sent += 1

    def _with_text(self, logprobs: list[TokenLogprob]) -> list[TokenLogprobs]:
        ids = sorted({t for lp in logprobs for t in (lp.token_id, *(i for i, _ in lp.top))})
        text = dict(zip(ids, self.tokenizer.core.decode_batch([[i] for i in ids]), strict=True))
        return [
            TokenLogprobs(
                Logprob(lp.token_id, text[lp.token_id], lp.logprob),
                [Logprob(i, text[i], v) for i, v in lp.top],
            )
            for lp in logprobs
        ]

    def _find_stop(self) -> int | None:
        """Earliest stop-string match; only the new text (plus a stop's length of the old tail,
        for matches that straddle) is scanned, so a step costs O(new text x stops)."""
        start = max(0, self.scanned - self.longest_stop + 1)
        hits = [i for s in self.request.stop if s and (i := self.text.find(s, start)) >= 0]
        self.scanned = len(self.text)
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.request.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        if self.held is not None:  # tokens rendered but held back go out before the end
            self._send(self.held)
            self.held = None
        req = self.request
        now = time.monotonic()
        req.finish_reason = reason
        ttft = (req.first_token_time or now) - req.arrival_time
        # Recorded before the client hears: once it has its completion, the metrics count it.
        self.metrics.on_finished(req, reason, self.num_rendered)
        if self._pieces is not None:
            self.text = "".join(self._pieces)
        self.events.put(
            Complete(
                finish_reason=reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=self.num_rendered,
                stats=copy.deepcopy(req.stats),
                text=self.text,
                time_to_first_token_s=ttft,
                total_time_s=now - req.arrival_time,
                token_ids=list(req.output_ids[: self.num_rendered]),
                index=self.index,
            )
        )

    def fail(self, code: str, message: str) -> None:
        if self.done:
            return
        self.done = True
        held, self.held = self.held, None  # the stream ends in an error: held tokens stay unsent
        told = self.num_rendered - (len(held.token_ids) if held is not None else 0)
        self.metrics.on_finished(self.request, "error", told)
        self.events.put(Failed(code, message, self.index))


class OutputWorker:
    """The output thread: renders committed tokens (detokenising, stop strings, events) off
    the executor's critical path, in the order they were committed. A request that a stop
    string finishes is reported back through `on_stopped` so the executor releases it.

    Work is *held* until the executor `release`s it: a synchronous step's rendering waits until
    the next step is on the device. Handed over at once, it ran in the executor's host work
    instead of beside the device: the output thread, woken, takes the GIL at the executor's
    first syscall or torch call (a remote drafter's question and reply are syscalls) and keeps
    it until its batch is rendered, and every such wait is on the critical path of a
    synchronous step (in a replay of the remote drafter's step with an output thread that
    renders 0.15 ms a step, the executor's wait for its drafts grew from 0.04 to 0.25 ms;
    bench/RESULTS.md, round 41). Only the executor's thread calls `submit`, `render_many` and
    `release` (and, once it has stopped, the thread that shuts it down)."""

    def __init__(self, on_stopped) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._held: list[tuple] = []  # submitted, not released yet (in order)
        self._on_stopped = on_stopped
        # Called after every rendered batch (the engine process sends the batch's events).
        self.after_batch = None
        self._thread = threading.Thread(target=self._run, name="specwire-output", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        """Hold `fn(*args)` for the output thread until the next `release`."""
        self._held.append((fn, args))

    def release(self) -> None:
        """Hand everything held to the output thread (the device is busy, or the executor is
        about to wait): it runs while the executor does not need the GIL."""
        if self._held:
            held, self._held = self._held, []
            self._queue.put((self._run_held, (held,)))

    def _run_held(self, held: list[tuple]) -> None:
        for fn, args in held:
            self._call(fn, args)

    def render_many(self, items: list[tuple]) -> None:
        """Render a step's rows, in order, held as one item; each item is the arguments of
        `OutputStream.render` after the stream: (stream, kept, reason, drafted, accepted,
        step, logprobs)."""
        if items:
            self.submit(self._render_many, items)

    def _render(self, stream: OutputStream, kept, reason, drafted, accepted, step, lps) -> None:
        if stream.render(kept, reason, drafted, accepted, step, lps) and reason is None:
            self._on_stopped(stream.request.request_id)

    def _render_many(self, items: list[tuple]) -> None:
        for item in items:
            self._call(self._render, item)

    def flush(self) -> None:
        """Release what is held and wait until everything submitted so far has been rendered."""
        self.release()
        self._queue.join()

    def close(self) -> None:
        self.release()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]  # everything waiting: usually one step's rows
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                with deferred_wakeups():
                    for item in batch:
                        if item is None:
                            return
                        self._call(*item)
                if self.after_batch is not None:
                    try:
                        self.after_batch()
                    except Exception:  # never the output thread's end
                        log.exception("after_batch failed")
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _call(self, fn, args) -> None:
        try:
            fn(*args)
        except Exception:  # one request's output bug never stops the others'
            log.exception("rendering output failed")
            stream = args[0] if args and isinstance(args[0], OutputStream) else None
            if stream is not None:
                stream.fail("INTERNAL", "output failed")
                self._on_stopped(stream.request.request_id)


class StreamFactory:
    """Builds each request's OutputStream (the executor calls it in `submit`).

    `route` first (same thread, before `executor.submit`) to send a request's events to a shared
    queue under an index: that is how a request's n completions become one stream."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: set[int],
        max_context: int,
        metrics: TargetMetrics | None = None,
        interval: int = 1,  # steps per streamed chunk
    ) -> None:
        self.metrics = metrics or TargetMetrics()  # the engine's: every stream reports to it
        self.interval = interval
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_context = max_context
        self._routes: dict[str, tuple[EventQueue, int]] = {}
        self._lock = threading.Lock()

    def route(self, request_id: str, events: EventQueue, index: int) -> None:
        with self._lock:
            self._routes[request_id] = (events, index)

    def __call__(self, request: Request) -> OutputStream:
        with self._lock:
            events, index = self._routes.pop(request.request_id, (None, 0))
        return OutputStream(
            request,
            self.tokenizer,
            self.eos_ids,
            self.max_context,
            events=events,
            index=index,
            metrics=self.metrics,
            interval=self.interval,
        )
