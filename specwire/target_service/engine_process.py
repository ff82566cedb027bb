"""The engine in a process of its own (`specwire target --engine-process`).

In one process every thread's Python work takes turns on one GIL: under load the gRPC loop
(a message per stream per step) and the executor (the step's host work) wait for each other,
and the host, not the GPU, sets the pace. Here the gRPC front end (servicer, admission:
tokenising, the chat template, limits) stays in the server's process, and a spawned child
runs the `Engine`: model, executor, output thread (detokenising, stop strings) and, with
`--metrics-port`, the metrics endpoint. The two GILs no longer meet.

One duplex pipe carries pickled messages:

    front end -> engine: ("submit", [(Request, index)]), ("cancel", request_id), ("info", n),
                         ("stop",)
    engine -> front end: ("ready", facts) or ("failed", message, user_error), once; then
                         ("events", [(request_id, event)]) once per rendered batch of the
                         output thread, ("info", n, GetModelInfoResponse bytes),
                         ("dead", message) and ("stopped",)

Requests keep their internal ids (uuid hex) on both sides. The front end routes each batch's
events into the requests' EventQueues with one event-loop wake-up per batch. If the engine
process dies, every request in flight fails with INTERNAL and `on_death` fires (the CLI then
turns health NOT_SERVING and exits non-zero, as when the executor thread dies in-process).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing as mp
import signal
import sys
import tempfile
import threading

from specwire.common.errors import UserError
from specwire.common.tokenizer import Tokenizer
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import Admission
from specwire.target_service.events import (
    Complete,
    EventQueue,
    Failed,
    deferred_wakeups,
)
from specwire.target_service.request import Request, SpecStats

log = logging.getLogger(__name__)


class _RemoteStream:
    """The front end's handle on one completion (what the servicer keeps per stream)."""

    def __init__(self, request: Request, events: EventQueue, index: int) -> None:
        self.request = request
        self.events = events
        self.index = index

    def finish(self, reason: str) -> None:
        """End it here (the engine never took it in, or is gone)."""
        if self.request.finish_reason is None:
            self.request.finish_reason = reason
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
        if self.request.finish_reason is None:
            self.request.finish_reason = "failed"
            self.events.put(Failed(code, message, self.index))


class EngineProcess(Admission):
    """The servicer's engine when the engine runs in a child process: admission here, the
    rest there. Blocks in the constructor until the child is warm (or raises why not)."""

    def __init__(
        self,
        cfg: TargetConfig,
        *,
        metrics_port: int = 0,
        metrics_host: str = "127.0.0.1",
        switch_interval: float = 5e-4,
    ) -> None:
        self.config = cfg
        self.on_death = None  # called (from the reader thread) with the reason
        self.death: BaseException | None = None
        self._routes: dict[str, _RemoteStream] = {}
        self._routes_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._info: dict[int, bytes] = {}
        self._info_ready = threading.Condition()
        self._info_no = 0
        self._stopping = False
        self._stopped = threading.Event()
        self._tok_dir = tempfile.TemporaryDirectory(prefix="specwire-tokenizer-")
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_engine_main,
            args=(cfg, child_conn, self._tok_dir.name, metrics_port, metrics_host, switch_interval),
            name="specwire-engine",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise RuntimeError(
                f"the engine process exited while loading (exit code {self.proc.exitcode})"
            ) from None
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
        self._reader = threading.Thread(
            target=self._read, name="specwire-engine-reader", daemon=True
        )
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
        streams = [_RemoteStream(req, events, i) for i, req in enumerate(requests)]
        with self._routes_lock:
            dead = self.death is not None
            if not dead:
                for s in streams:
                    self._routes[s.request.request_id] = s
        if dead:
            for s in streams:
                s.fail("INTERNAL", f"the target's engine stopped: {self.death!r}")
            return events, streams
        self._send(("submit", [(s.request, s.index) for s in streams]))
        return events, streams

    def cancel(self, request_id: str) -> None:
        self._send(("cancel", request_id))

    def model_info_bytes(self, timeout: float = 10.0) -> bytes:
        """The child's GetModelInfoResponse, serialised (blocking: call it off the loop)."""
        with self._info_ready:
            self._info_no += 1
            n = self._info_no
        self._send(("info", n))
        with self._info_ready:
            if not self._info_ready.wait_for(
                lambda: n in self._info or self.death is not None, timeout
            ):
                raise TimeoutError("the engine process did not answer GetModelInfo")
            if n not in self._info:
                raise RuntimeError(f"the target's engine stopped: {self.death!r}")
            return self._info.pop(n)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the child's executor (its requests get CANCELLED completions, delivered before
        this returns), then the child."""
        self._stopping = True
        if self.proc.is_alive():
            self._send(("stop",))
            self._stopped.wait(timeout)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self._tok_dir.cleanup()

    # -- internals -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:  # the child is gone: the reader reports it
            log.debug("engine process pipe closed: %r", exc)

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
                        self._info[msg[1]] = msg[2]
                        self._info_ready.notify_all()
                elif kind == "dead":
                    reason = RuntimeError(f"the executor stopped: {msg[1]}")
                    break
                elif kind == "stopped":
                    break
        except (EOFError, OSError):
            if not self._stopping:
                self.proc.join(timeout=2)
                reason = RuntimeError(f"the engine process exited (exit code {self.proc.exitcode})")
        finally:
            self._stopped.set()
        if reason is not None:
            self._died(reason)

    def _deliver(self, items) -> None:
        with deferred_wakeups():  # one wake-up of the servicer's loop per batch
            for request_id, ev in items:
                stream = self._routes.get(request_id)
                if stream is None:
                    continue
                if isinstance(ev, Complete | Failed):
                    stream.request.finish_reason = getattr(ev, "finish_reason", "failed")
                    with self._routes_lock:
                        self._routes.pop(request_id, None)
                stream.events.put(ev)

    def _died(self, reason: BaseException) -> None:
        log.critical("engine process: %s", reason)
        with self._routes_lock:
            self.death = reason
            streams, self._routes = list(self._routes.values()), {}
        with self._info_ready:
            self._info_ready.notify_all()
        for s in streams:
            s.fail("INTERNAL", f"the target's engine stopped: {reason}")
        if self.on_death is not None:
            self.on_death(reason)


class _Outbox:
    """The child's events, batched: the output thread sends one message per rendered batch."""

    def __init__(self, send) -> None:
        self._send = send
        self._items: list[tuple] = []
        self._lock = threading.Lock()

    def tap(self, request_id: str) -> _Tap:
        return _Tap(self, request_id)

    def add(self, request_id: str, event) -> None:
        with self._lock:
            self._items.append((request_id, event))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items:
            self._send(("events", items))


class _Tap:
    """What an OutputStream in the child puts its events into (an EventQueue's `put`)."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: _Outbox, request_id: str) -> None:
        self.outbox = outbox
        self.request_id = request_id

    def put(self, event) -> None:
        self.outbox.add(self.request_id, event)


def _engine_main(cfg, conn, tok_dir, metrics_port, metrics_host, switch_interval) -> None:
    """The engine process: build, report ready, serve the front end's messages until "stop"
    or until the front end goes away."""
    from specwire.target_service.engine import build_engine
    from specwire.target_service.server import engine_info

    sys.setswitchinterval(switch_interval)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front end decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a drain
    # As the front end: SIGUSR1 prints every thread's stack (to the stderr both share) and
    # changes nothing else; without it the signal's default action would end the engine.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    try:
        engine = build_engine(cfg)
        engine.tokenizer.save(tok_dir)
    except BaseException as exc:  # noqa: BLE001 - the front end reports it and exits
        send(("failed", str(exc), isinstance(exc, UserError)))
        return
    gc.collect()
    gc.freeze()  # as the in-process target does once warm
    executor = engine.executor
    outbox = _Outbox(send)
    executor.output.after_batch = outbox.flush
    executor.on_death = lambda exc: send(("dead", repr(exc)))
    if metrics_port:
        executor.metrics.serve(metrics_port, metrics_host)
    engine.start()
    send(
        (
            "ready",
            dict(
                vocab_size=engine.vocab_size,
                can_draft=engine.can_draft,
                kv_geometry=engine.kv_geometry,
                max_draft_len=executor.max_draft_len,
                graphs=engine.runner.graphs is not None,
            ),
        )
    )
    route = executor.make_stream.route
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the front end is gone
            kind = msg[0]
            if kind == "submit":
                for req, index in msg[1]:
                    route(req.request_id, outbox.tap(req.request_id), index)
                    executor.submit(req)
            elif kind == "cancel":
                executor.cancel(msg[1])
            elif kind == "info":
                send(("info", msg[1], engine_info(engine).SerializeToString()))
            elif kind == "stop":
                break
    finally:
        engine.shutdown()
        outbox.flush()
        try:
            send(("stopped",))
        except OSError:
            pass
