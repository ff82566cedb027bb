"""The engine in a process of its own (`specwire target --engine-process`).

In one process every thread's Python work takes turns on one GIL: under load the gRPC loop
(a message per stream per step) and the executor (the step's host work) wait for each other,
and the host, not the GPU, sets the pace. Here the gRPC front end (servicer, admission:
tokenising, the chat template, limits) stays in the server's process, and a spawned child
runs the `Engine`: model, executor, output thread (detokenising, stop strings) and, with
`--metrics-port`, the metrics endpoint. The two GILs no longer meet.

One duplex pipe carries pickled messages (the child's side: `engine_child.py`):

    front end -> engine: ("submit", [(Request, index)]), ("cancel", request_id), ("info", n),
                         ("stop",)
    engine -> front end: ("ready", facts) or ("failed", message, user_error), once; then
                         ("events", [(request_id, event)]) once per rendered batch of the
                         output thread, ("info", n, GetModelInfoResponse bytes or an error
                         message), ("dead", message) and ("stopped", why)

Requests keep their internal ids (uuid hex) on both sides. The front end routes each batch's
events into the requests' EventQueues with one event-loop wake-up per batch. If the engine
process dies, every request in flight fails with INTERNAL and `on_death` fires (the CLI then
turns health NOT_SERVING and exits non-zero, as when the executor thread dies in-process).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading

from specwire.common.errors import UserError
from specwire.common.tokenizer import Tokenizer
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import Admission
from specwire.target_service.engine_spawn import SpawnedEngine, spawn_engine
from specwire.target_service.events import (
    Complete,
    EventQueue,
    Failed,
    deferred_wakeups,
)
from specwire.target_service.request import Request, SpecStats

log = logging.getLogger(__name__)


class _RemoteStream:
    """The front end's handle on one completion (what the servicer keeps per stream). `lock`
    is the engine's routes lock: a completion ends here or from the engine, never both."""

    def __init__(
        self, request: Request, events: EventQueue, index: int, lock: threading.Lock
    ) -> None:
        self.request = request
        self.events = events
        self.index = index
        self.lock = lock

    def _end(self, reason: str) -> bool:
        with self.lock:
            if self.request.finish_reason is not None:
                return False
            self.request.finish_reason = reason
            return True

    def finish(self, reason: str) -> None:
        """End it here (the engine never took it in, or is gone)."""
        if self._end(reason):
            self.events.put(
                Complete(
                    finish_reason=reason,
                    prompt_tokens=len(self.request.prompt_ids),
                    completion_tokens=0,
                    stats=SpecStats(),
                    text="",
                    time_to_first_token_s=0.0,
                    total_time_s=0.0,
                    index=self.index,
                )
            )

    def fail(self, code: str, message: str) -> None:
        if self._end("failed"):
            self.events.put(Failed(code, message, self.index))


class EngineUnavailable(UserError):
    """The engine process is stopping or gone: the caller may retry on another replica."""

    code = "UNAVAILABLE"


class EngineProcess(Admission):
    """The servicer's engine when the engine runs in a child process: admission here, the
    rest there. Blocks in the constructor until the child is warm (or raises why not).

    Everything sent to the child goes through one writer thread, in order: the servicer's
    event loop only queues (a large prompt never blocks it on a full pipe). The child dies
    with this process (PR_SET_PDEATHSIG, and a kill at exit), so a dead or interrupted
    front end never leaves an engine holding the GPU. Linux ties PR_SET_PDEATHSIG to the
    thread that started the child: build this on a thread that lives as long as the engine
    should (the CLI builds it on the main thread). `spawned`: a child already started
    (`engine_spawn.spawn_engine`), which this then waits for; else `settings` are
    `spawn_engine`'s (metrics port and host, GIL switch interval, log level and format)."""

    INFO_TIMEOUT_S = 5.0  # below the gateway's 10 s deadline for GetModelInfo

    def __init__(
        self, cfg: TargetConfig, *, spawned: SpawnedEngine | None = None, **settings
    ) -> None:
        self.config = cfg
        self.on_death = None  # called (from the reader thread) with the reason
        self.death: BaseException | None = None
        self._routes: dict[str, _RemoteStream] = {}
        self._routes_lock = threading.Lock()
        self._info: dict[int, bytes | str | None] = {}  # asked -> reply (None: not yet)
        self._info_ready = threading.Condition()
        self._info_no = 0
        self._stopping = False
        self._stopped = threading.Event()
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        if spawned is None:  # (the CLI spawns it first, so the child loads while it imports)
            spawned = spawn_engine(cfg, **settings)
        self._spawned = spawned
        self.proc, self._conn, self._tok_dir = spawned.proc, spawned.conn, spawned.tok_dir
        atexit.register(self._kill)  # before multiprocessing's own exit join (which would wait)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise RuntimeError(
                f"the engine process exited while loading (exit code {self.proc.exitcode})"
            ) from None
        except BaseException:  # Ctrl-C or SIGTERM during the load: the child goes too
            self._kill()
            raise
        if msg[0] == "failed":
            self.proc.join(timeout=10)
            if msg[2]:
                raise UserError(msg[1])
            raise RuntimeError(f"the engine process failed to load: {msg[1]}")
        facts = msg[1]
        self._vocab_size = facts["vocab_size"]
        self._can_draft = facts["can_draft"]
        self._kv_geometry = tuple(facts["kv_geometry"])
        self.max_draft_len = facts["max_draft_len"]
        self.graphs = facts["graphs"]
        self.pid = self.proc.pid
        self._tokenizer = Tokenizer.from_folder(self._tok_dir.name)
        if self._tokenizer.fingerprint != facts["tokenizer_fingerprint"]:
            self._kill()
            raise RuntimeError("the engine's tokenizer did not survive the hand-over")
        self._writer = threading.Thread(target=self._write, name="specwire-engine-writer")
        self._writer.daemon = True
        self._writer.start()
        self._reader = threading.Thread(target=self._read, name="specwire-engine-reader")
        self._reader.daemon = True
        self._reader.start()

    # -- Admission -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def can_draft(self) -> bool:
        return self._can_draft

    @property
    def kv_geometry(self) -> tuple[int, int]:
        return self._kv_geometry  # type: ignore[return-value]

    # -- the servicer's calls --------------------------------------------------------------------
    def start(self) -> None:
        """The child's executor runs from the moment it is warm."""

    def submit(self, requests: list[Request]) -> tuple[EventQueue, list[_RemoteStream]]:
        events = EventQueue()
        lock = self._routes_lock
        streams = [_RemoteStream(req, events, i, lock) for i, req in enumerate(requests)]
        with self._routes_lock:
            gone = self.death is not None or self._stopping
            if not gone:
                for s in streams:
                    self._routes[s.request.request_id] = s
        if gone:
            for s in streams:
                s.fail("UNAVAILABLE", "the target's engine is stopping; retry on another replica")
            return events, streams
        self._outq.put(("submit", [(s.request, s.index) for s in streams]))
        return events, streams

    def cancel(self, request_id: str) -> None:
        self._outq.put(("cancel", request_id))

    def model_info_bytes(self) -> bytes:
        """The child's GetModelInfoResponse, serialised (blocking: call it off the loop)."""
        with self._info_ready:
            self._info_no += 1
            n = self._info_no
            self._info[n] = None
        self._outq.put(("info", n))
        with self._info_ready:
            answered = self._info_ready.wait_for(
                lambda: self._info[n] is not None or self._stopped.is_set(), self.INFO_TIMEOUT_S
            )
            reply = self._info.pop(n)
        if isinstance(reply, bytes):
            return reply
        if isinstance(reply, str):  # the engine could not build it
            raise RuntimeError(f"GetModelInfo failed in the engine process: {reply}")
        if not answered:
            raise EngineUnavailable(f"the engine process did not answer in {self.INFO_TIMEOUT_S}s")
        raise EngineUnavailable("the target's engine is stopping or gone")

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the child's executor (its requests get CANCELLED completions, delivered before
        this returns), then the child."""
        with self._routes_lock:
            self._stopping = True
        if self.proc.is_alive():
            self._outq.put(("stop",))
            self._stopped.wait(timeout)
        self._kill()
        self._reader.join(timeout=5)  # no completion is delivered after this returns
        self._outq.put(None)
        self._tok_dir.cleanup()

    # -- internals -------------------------------------------------------------------------------
    def _kill(self) -> None:
        self._stopping = True  # an end we chose is no death to report
        self.proc.join(timeout=5 if self._stopped.is_set() else 0)
        self._spawned.kill()

    def _write(self) -> None:
        while (msg := self._outq.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError) as exc:  # the child is gone: the reader reports it
                log.debug("engine process pipe closed: %r", exc)
                return

    def _read(self) -> None:
        reason = None
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "events":
                    self._deliver(msg[1])
                elif kind == "info":
                    with self._info_ready:
                        if msg[1] in self._info:  # nobody waits for a reply that came late
                            self._info[msg[1]] = msg[2]
                        self._info_ready.notify_all()
                elif kind == "dead":
                    reason = RuntimeError(f"the executor stopped: {msg[1]}")
                    break
                elif kind == "stopped":
                    if not self._stopping:
                        reason = RuntimeError(f"the engine process stopped: {msg[1]}")
                    break
        except (EOFError, OSError):
            if not self._stopping:
                self.proc.join(timeout=2)
                reason = RuntimeError(f"the engine process exited (exit code {self.proc.exitcode})")
        finally:
            self._stopped.set()
            with self._info_ready:
                self._info_ready.notify_all()
        if reason is not None:
            self._died(reason)

    def _deliver(self, items) -> None:
        with deferred_wakeups():  # one wake-up of the servicer's loop per batch
            for request_id, ev in items:
                stream = self._routes.get(request_id)
                if stream is None:
                    continue
                if isinstance(ev, Complete | Failed):
                    with self._routes_lock:
                        self._routes.pop(request_id, None)
                        if stream.request.finish_reason is not None:
                            continue  # ended here meanwhile (`_RemoteStream.finish`)
                        stream.request.finish_reason = getattr(ev, "finish_reason", "failed")
                stream.events.put(ev)

    def _died(self, reason: BaseException) -> None:
        log.critical("engine process: %s", reason)
        with self._routes_lock:
            self.death = reason
            streams, self._routes = list(self._routes.values()), {}
        for s in streams:
            s.fail("INTERNAL", f"the target's engine stopped: {reason}")
        if self.on_death is not None:
            self.on_death(reason)
