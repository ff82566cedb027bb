"""Prometheus metrics of one target engine (its own registry, so several engines can live in
one process, e.g. in tests). `specwire target --metrics-port P` serves them over HTTP."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

METRICS_PATH = "/metrics"


class TargetMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("specwire_steps", "Executor steps run", registry=r)
        self.tokens = Counter("specwire_generated_tokens", "Tokens committed", registry=r)
        self.eager_steps = Counter(
            "specwire_eager_steps",
            "Steps whose forward ran eagerly instead of replaying a CUDA graph",
            registry=r,
        )
        self.drafted = Counter("specwire_draft_tokens", "Real draft tokens proposed", registry=r)
        self.accepted = Counter("specwire_accepted_tokens", "Draft tokens accepted", registry=r)
        self.step_seconds = Histogram(
            "specwire_step_seconds",
            "Wall time of one executor step",
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        )
        self.step_host_seconds = Histogram(
            "specwire_step_host_seconds",
            "Host time on a step's critical path: the step's wall time minus the time it "
            "waited for the device (scheduling, drafting, input preparation, verification)",
            registry=r,
            buckets=(0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
        )
        self.running = Gauge("specwire_running_requests", "Requests in the batch", registry=r)
        self.waiting = Gauge("specwire_waiting_requests", "Requests queued", registry=r)
        self.kv_free = Gauge("specwire_kv_free_blocks", "Free KV cache blocks", registry=r)

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
