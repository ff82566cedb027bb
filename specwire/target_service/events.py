"""A request's events and the queue that carries them from the executor's threads to the
aio servicer: `Chunk`, `Complete`, `Failed`, `EventQueue` (awaitable, thread-safe), one
event-loop wake-up per rendered batch (`deferred_wakeups`), and `next_message`, which merges
the chunks still queued for a completion into one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from dataclasses import dataclass, field

from specwire.target_service.request import SpecStats


@dataclass(frozen=True)
class Logprob:
    """A token's logprob as the client sees it: id, the token decoded on its own, logprob."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's Logprob and the most likely alternatives at its position."""

    token: Logprob
    top: list[Logprob]


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    draft_tokens: int
    accepted_tokens: int
    step: int
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
    index: int = 0  # which of the request's n completions
    num_steps: int = 1  # executor steps in this chunk (see `merge`)

    def merge(self, later: Chunk) -> Chunk:
        """This chunk and the next one of the same completion as one (counts summed)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return Chunk(
            self.token_ids + later.token_ids,
            self.text + later.text,
            self.draft_tokens + later.draft_tokens,
            self.accepted_tokens + later.accepted_tokens,
            later.step,
            logprobs,
            self.index,
            self.num_steps + later.num_steps,
        )


@dataclass
class Complete:
    finish_reason: str  # "eos" | "length" | "stop" | "context" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats
    text: str
    time_to_first_token_s: float
    total_time_s: float
    token_ids: list[int] = field(default_factory=list)
    index: int = 0


@dataclass
class Failed:
    code: str  # gRPC status code name
    message: str
    index: int = 0


Event = Chunk | Complete | Failed


class EventQueue:
    """A request's events: put by the executor thread, read with `get` (threads) or `aget`
    (the aio servicer; waiting costs no thread)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, event: Event) -> None:
        self._q.put(event)
        # Nobody waits: return without the lock. Safe because the event is queued BEFORE the
        # waiter is read here, and `aget` sets its waiter BEFORE it re-checks the queue: if
        # this read misses a waiter, that reader's re-check sees the event (ordering the GIL
        # gives; the lock still guards taking a waiter).
        if self._waiter is None:
            return
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            deferred = getattr(_DEFERRED, "wakes", None)
            if deferred is not None:  # inside `deferred_wakeups`: one wake-up per batch
                deferred.append(waiter)
            else:
                loop, fut = waiter
                loop.call_soon_threadsafe(_wake, fut)

    def get(self, timeout: float | None = None) -> Event:
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> Event | None:
        """The next event if one is waiting, else None."""
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._q.empty()

    async def aget(self) -> Event:
        while True:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                pass
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            with self._lock:
                self._waiter = (loop, fut)
            if self._q.empty():  # an event put before the waiter was set is not missed
                await fut


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_all(futs: list[asyncio.Future]) -> None:
    for fut in futs:
        _wake(fut)


_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_wakeups():
    """Events put by this thread inside the block wake their readers with ONE call per event
    loop at the end (a step's events for 64 streams: one cross-thread wake-up, not 64)."""
    _DEFERRED.wakes = []
    try:
        yield
    finally:
        wakes, _DEFERRED.wakes = _DEFERRED.wakes, None
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        for loop, fut in wakes:
            by_loop.setdefault(loop, []).append(fut)
        for loop, futs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a loop that closed meanwhile
                loop.call_soon_threadsafe(_wake_all, futs)


def next_message(events: EventQueue, first: Event) -> tuple[Event, Event | None]:
    """`first`, merged with the chunks of the same completion already waiting behind it (a
    loaded server sends fewer, larger messages instead of falling behind), and the next
    waiting event that could not be merged, if any (it goes out next)."""
    if not isinstance(first, Chunk):
        return first, None
    while (nxt := events.get_nowait()) is not None:
        if isinstance(nxt, Chunk) and nxt.index == first.index:
            first = first.merge(nxt)
        else:
            return first, nxt
    return first, None
