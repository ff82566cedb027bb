"""Prometheus metrics of one target engine (its own registry, so several engines can live in
one process, e.g. in tests). `specwire target --metrics-port P` serves them over HTTP."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


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
        self.running = Gauge("specwire_running_requests", "Requests in the batch", registry=r)
        self.waiting = Gauge("specwire_waiting_requests", "Requests queued", registry=r)
        self.kv_free = Gauge("specwire_kv_free_blocks", "Free KV cache blocks", registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
