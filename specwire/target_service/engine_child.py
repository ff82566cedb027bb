"""The engine process's side of `--engine-process` (the front end's is `engine_process.py`).

`engine_main` is the spawned child: it dies with the front end (PR_SET_PDEATHSIG), builds the
engine, hands the front end its tokenizer and facts ("ready"), then serves the front end's
messages until "stop" or until the pipe breaks, and shuts the engine down within a bound.
Its output thread sends one "events" message per rendered batch through an `_Outbox`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading

from specwire.common.errors import UserError
from specwire.target_service.events import Failed

log = logging.getLogger(__name__)

STOP = "stop"  # the front end asked the engine to stop
FRONT_END_GONE = "the front end went away"


class _Outbox:
    """The child's events, batched: the output thread sends one message per rendered batch.
    Once the pipe is broken (the front end is gone) events are dropped."""

    def __init__(self, send) -> None:
        self._send = send
        self._items: list[tuple] = []
        self._lock = threading.Lock()
        self.closed = False

    def tap(self, request_id: str) -> _Tap:
        return _Tap(self, request_id)

    def add(self, request_id: str, event) -> None:
        with self._lock:
            if not self.closed:
                self._items.append((request_id, event))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items and not self.closed:
            try:
                self._send(("events", items))
            except (OSError, ValueError):
                self.closed = True


class _Tap:
    """What an OutputStream in the child puts its events into (an EventQueue's `put`)."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: _Outbox, request_id: str) -> None:
        self.outbox = outbox
        self.request_id = request_id

    def put(self, event) -> None:
        self.outbox.add(self.request_id, event)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the front end dies (whatever the way)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the front end's exit handler still kills it
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def engine_main(cfg, conn, tok_dir, opts) -> None:
    """The engine process: build, report ready, serve the front end's messages until "stop"
    or until the front end goes away."""
    _die_with_parent(opts["parent"])
    # First: the imports below overlap the front end's start-up (the CLI spawns this first),
    # and a Ctrl-C meanwhile is the front end's to handle, not a traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front end decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a drain
    from specwire.common.cli import setup_logging
    from specwire.target_service.engine import build_engine
    from specwire.target_service.server import engine_info

    setup_logging(opts["log_level"], opts["log_format"])
    sys.setswitchinterval(opts["switch_interval"])
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
        if opts["metrics_port"]:
            try:
                engine.executor.metrics.serve(opts["metrics_port"], opts["metrics_host"])
            except OSError as exc:
                raise UserError(
                    f"cannot serve metrics on {opts['metrics_host']}:{opts['metrics_port']}: "
                    f"{exc.strerror or exc}"
                ) from exc
    except BaseException as exc:  # noqa: BLE001 - the front end reports it and exits
        user = isinstance(exc, UserError)
        if not user:
            log.exception("the engine failed to load")
        with contextlib.suppress(OSError):
            send(("failed", str(exc) if user else f"{exc!r}", user))
        return
    gc.collect()
    gc.freeze()  # as the in-process target does once warm
    executor = engine.executor
    outbox = _Outbox(send)
    executor.output.after_batch = outbox.flush

    def on_death(exc: BaseException) -> None:
        if not outbox.closed:
            with contextlib.suppress(OSError):
                send(("dead", repr(exc)))

    executor.on_death = on_death
    engine.start()
    why = FRONT_END_GONE
    try:
        send(
            (
                "ready",
                dict(
                    vocab_size=engine.vocab_size,
                    can_draft=engine.can_draft,
                    kv_geometry=engine.kv_geometry,
                    max_draft_len=executor.max_draft_len,
                    graphs=engine.runner.graphs is not None,
                    tokenizer_fingerprint=engine.tokenizer.fingerprint,
                ),
            )
        )
        why = _serve(engine, conn, send, outbox, engine_info)
    except (EOFError, OSError):
        pass
    except BaseException as exc:  # noqa: BLE001 - reported as the reason below
        log.exception("the engine process's message loop failed")
        why = f"its message loop failed: {exc!r}"
    finally:
        if why == FRONT_END_GONE:
            outbox.closed = True  # nobody to send to
        # Bounded: a shutdown that cannot finish (an output thread gone with the pipe) must
        # not leave this process behind.
        threading.Timer(30.0, os._exit, (1,)).start()
        engine.shutdown()
        outbox.flush()
        with contextlib.suppress(OSError):
            send(("stopped", why))
        os._exit(0)


def _serve(engine, conn, send, outbox: _Outbox, engine_info) -> str:
    """The child's message loop; returns why it ended (STOP when asked to)."""
    executor = engine.executor
    route = executor.make_stream.route
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return FRONT_END_GONE
        kind = msg[0]
        if kind == "submit":
            for req, index in msg[1]:
                try:
                    route(req.request_id, outbox.tap(req.request_id), index)
                    executor.submit(req)
                except Exception as exc:  # that request fails, the engine goes on
                    log.exception("submitting %s failed", req.request_id)
                    outbox.add(req.request_id, Failed("INTERNAL", f"submit failed: {exc}", index))
                    outbox.flush()
        elif kind == "cancel":
            executor.cancel(msg[1])
        elif kind == "info":
            try:
                reply: bytes | str = engine_info(engine).SerializeToString()
            except Exception as exc:  # that call fails, the engine goes on
                log.exception("GetModelInfo failed")
                reply = repr(exc)
            send(("info", msg[1], reply))
        elif kind == "stop":
            return STOP
