"""The one server builder and the one channel factory every specwire service and client uses.

Servers are `grpc.aio` servers: a call that waits (for the engine, or for a client that does not
read) holds a coroutine, not a thread, so slow or idle clients cannot starve health checks or
other callers. Each server runs on its own event loop in a background thread (`LoopThread`), so
the rest of the code, the CLI and the tests stay synchronous.
"""

from __future__ import annotations

import asyncio
import faulthandler
import selectors
import signal
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from specwire.common.errors import UserError
from specwire.common.grpc_errors import ErrorInterceptor
from specwire.common.security import AuthInterceptor, ClientSecurity, ServerSecurity

T = TypeVar("T")


class StopSignal:
    """Ends a service's main thread: SIGTERM or SIGINT, or `set()` from any other thread.

        stop = StopSignal()   # in the main thread: installs the handlers
        stop.wait()           # returns once either happened

    The handler only sets a flag (a handler that took a lock could find the main thread
    holding it, and deadlock), and `wait` polls it in short timed waits: a signal the kernel
    delivers to another thread only flags the main thread, which an untimed wait would sleep
    through. SIGUSR1 prints every thread's stack to stderr (a service that seems stuck says
    where) and changes nothing else.
    """

    POLL_S = 0.25

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signalled = False
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        self.signalled = True

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self.signalled or self._event.is_set()

    def wait(self) -> None:
        while not self.signalled and not self._event.wait(self.POLL_S):
            pass


class SpinSelector(selectors.BaseSelector):
    """A selector that, for `spin_s` after it last returned events, polls (a zero-timeout
    select, each one a syscall that lets go of the GIL) instead of sleeping: a write that comes
    meanwhile finds the loop awake, not asleep on a core that must be woken (on a GPU host
    that wake is most of a unix socket's round trip). The cost: a core kept busy for `spin_s`
    after each event, so all the time while a target drafts. Everything else is the wrapped
    selector's."""

    def __init__(self, inner: selectors.BaseSelector, spin_s: float) -> None:
        self._inner = inner
        self.spin_s = spin_s  # may change while the loop runs (its own thread's writes)
        self._until = 0.0  # poll instead of sleeping until then (time.monotonic)

    def select(self, timeout: float | None = None):
        if timeout is None or timeout > 0:
            start = time.monotonic()
            if start < self._until:
                end = self._until if timeout is None else min(self._until, start + timeout)
                while not (events := self._inner.select(0)):
                    if time.monotonic() >= end:
                        break
                else:
                    self._until = time.monotonic() + self.spin_s
                    return events
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - start))
        events = self._inner.select(timeout)
        if events and self.spin_s > 0:
            self._until = time.monotonic() + self.spin_s
        return events

    def register(self, fileobj, events, data=None):
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._inner.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._inner.modify(fileobj, events, data)

    def get_key(self, fileobj):
        return self._inner.get_key(fileobj)

    def get_map(self):
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run(coro)` waits for its result.
    With `spin_s` (a number, 0 included) the loop runs on a `SpinSelector` (`selector`), which
    polls that long after each event before it sleeps; the spin may be changed later."""

    def __init__(self, name: str, spin_s: float | None = None) -> None:
        self.selector: SpinSelector | None = None
        if spin_s is not None:
            self.selector = SpinSelector(selectors.DefaultSelector(), spin_s)
            self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(self.selector)
        else:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def build_server(
    host: str,
    port: int,
    security: ServerSecurity,
    *,
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, int]:
    """An aio server bound to host:port with TLS/mTLS and token auth as `security` says.

    Must be called on the event loop that will run the server. Raises UserError when the
    address cannot be bound or plaintext is asked for on a non-loopback address.
    """
    security.check_bind(host)
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if security.tokens:
        interceptors.append(AuthInterceptor(security.tokens))
    interceptors.append(ErrorInterceptor())
    server = grpc.aio.server(
        interceptors=interceptors,
        # A second service on the same port must fail rather than share it.
        options=[("grpc.so_reuseport", 0), *options],
    )
    address = f"{host}:{port}"
    creds = security.credentials()
    try:
        bound = (
            server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise UserError(f"cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise UserError(f"cannot listen on {address} (address in use?)")
    return server, bound


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call (plaintext loopback channels too, where
    gRPC's own call credentials are not allowed)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        # grpc passes its own namedtuple of call details here.
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def make_channel(
    address: str,
    security: ClientSecurity | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to `address`: TLS when `security.ca` is set (mTLS with a client certificate),
    and a bearer token on every call when `security.token` is set."""
    security = security or ClientSecurity()
    opts = list(options)
    if security.server_name:
        opts.append(("grpc.ssl_target_name_override", security.server_name))
    if security.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=security.ca,
            private_key=security.key,
            certificate_chain=security.cert,
        )
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    if security.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(security.token))
    return channel
