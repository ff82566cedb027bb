"""The metrics port serves the Prometheus text at /metrics and nothing else."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from specwire.target_service.metrics import TargetMetrics


@pytest.fixture
def metrics_url():
    metrics = TargetMetrics("m")
    metrics.tokens.inc(3)
    server = metrics.serve(0, "127.0.0.1")
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_metrics_path_serves_the_registry(metrics_url: str) -> None:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    assert 'specwire_generated_tokens_total{model="m"} 3.0' in text.splitlines()


@pytest.mark.parametrize("path", ["/", "/healthz", "/metricsx", "/metrics/extra"])
def test_other_paths_are_404(metrics_url: str, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{metrics_url}{path}", timeout=10)
    assert err.value.code == 404
    assert b"specwire_" not in err.value.read()
