"""Security over real gRPC on loopback: TLS, mutual TLS and bearer tokens on both services
(the target <-> drafter link over mTLS), drafter sessions owned by their caller and bounded,
per-caller stream limits, chat content that cannot inject control tokens, validated roles."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from certs import write_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import running_service, wait_until

from specwire.common import healthcheck
from specwire.common.client import GenerationClient, build_request
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.common.security import ClientSecurity
from specwire.common.transport import make_channel
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.server import serve

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "SPECWIRE_AUTH_TOKEN": None}
READY = r"listening on 127\.0\.0\.1:(\d+)"
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    paths = write_pki(folder)
    for name, token in (("target.token", "target-secret"), ("drafter.token", "drafter-secret")):
        (folder / name).write_text(f"# one token a line\n{token}\n")
        paths[name] = folder / name
    return paths


def _read(p: Path) -> bytes:
    return p.read_bytes()


@pytest.mark.parametrize("mode", ["stream", "relay"])
def test_target_and_drafter_over_mtls_with_tokens(pki, mode):
    """The drafter requires client certificates and a token; the target presents both (in
    relay mode its relay process, through the setup it is handed, does too), and serves TLS +
    token itself. Clients without the token or without the CA are refused."""
    drafter_cmd = SPECWIRE + [
        "drafter", "--port", "0", "--tls-cert", str(pki["server.pem"]),
        "--tls-key", str(pki["server.key"]), "--tls-ca", str(pki["ca.pem"]),
        "--auth-token-file", str(pki["drafter.token"]),
    ]  # fmt: skip
    with running_service(drafter_cmd, ENV, READY, timeout=60) as (_, dmatch):
        drafter = f"127.0.0.1:{dmatch.group(1)}"
        target_cmd = SPECWIRE + [
            "target", "--model", "tiny-random", "--port", "0", "--no-progress",
            "--max-context-len", "256", "--drafter", f"grpc://{drafter}",
            "--drafter-tls-ca", str(pki["ca.pem"]), "--drafter-tls-cert", str(pki["client.pem"]),
            "--drafter-tls-key", str(pki["client.key"]),
            "--drafter-token-file", str(pki["drafter.token"]), "--drafter-deadline-ms", "2000",
            "--drafter-mode", mode,
            "--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
            "--auth-token-file", str(pki["target.token"]),
        ]  # fmt: skip
        # The target handshakes with the drafter before it reports ready: ready = mTLS works.
        with running_service(target_cmd, ENV, READY, timeout=120) as (_, tmatch):
            target = f"127.0.0.1:{tmatch.group(1)}"
            ca = _read(pki["ca.pem"])
            good = ClientSecurity(ca=ca, token="target-secret")
            with GenerationClient(target, timeout=60, security=good) as client:
                spec = client.generate(PROMPT, max_new_tokens=24)
                plain = client.generate(PROMPT, max_new_tokens=24, speculate=False)
                assert spec.token_ids == plain.token_ids
                assert spec.speculation["draft_tokens"] > 0  # the stream carried drafts
                assert client.model_info().drafter.startswith("grpc://")

            for bad in (ClientSecurity(ca=ca), ClientSecurity(ca=ca, token="wrong")):
                with GenerationClient(target, timeout=10, security=bad) as client:
                    with pytest.raises(grpc.RpcError) as err:
                        client.model_info()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "bearer token" in err.value.details()
                    with pytest.raises(grpc.RpcError) as err:
                        list(client.stream(build_request("hi", max_new_tokens=2)))
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # Without the CA (plaintext, or trusting another CA) the handshake fails.
            other = ClientSecurity(ca=_read(pki["other-ca.pem"]), token="target-secret")
            for sec in (ClientSecurity(token="target-secret"), other):
                with GenerationClient(target, timeout=5, security=sec) as client:
                    with pytest.raises(grpc.RpcError) as err:
                        client.model_info()
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            # Health needs TLS but no token, so orchestrators can probe.
            assert healthcheck.check(target, security=ClientSecurity(ca=ca)) == "SERVING"
            probe = SPECWIRE[:1] + ["-m", "specwire.common.healthcheck", target, "--tls-ca"]
            done = subprocess.run(
                [*probe, str(pki["ca.pem"])], env={**os.environ, **ENV_STR}, timeout=30
            )
            assert done.returncode == 0

        # The drafter refuses a caller without a client certificate, and one without a token.
        ca = _read(pki["ca.pem"])
        cert, key = _read(pki["client.pem"]), _read(pki["client.key"])
        for sec, code in (
            (ClientSecurity(ca=ca, token="drafter-secret"), grpc.StatusCode.UNAVAILABLE),
            (ClientSecurity(ca=ca, cert=cert, key=key), grpc.StatusCode.UNAUTHENTICATED),
        ):
            with make_channel(drafter, sec) as channel, pytest.raises(grpc.RpcError) as err:
                drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
                    drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5
                )
            assert err.value.code() == code


ENV_STR = {k: v for k, v in ENV.items() if v is not None}


@pytest.mark.parametrize("service", ["target", "drafter"])
def test_plaintext_on_a_public_address_needs_insecure(service):
    cmd = SPECWIRE + [service, "--host", "0.0.0.0", "--port", "0"]
    if service == "target":
        cmd += ["--model", "tiny-random"]
    env = {**os.environ, **ENV_STR}
    env.pop("SPECWIRE_AUTH_TOKEN", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert "refusing to serve plaintext on 0.0.0.0" in done.stderr and "--insecure" in done.stderr


# -- drafter sessions ------------------------------------------------------------------------------


@pytest.fixture()
def drafter_factory():
    servers = []

    def start(**overrides):
        cfg = DrafterServiceConfig(host="127.0.0.1", port=0, max_draft_len=4, **overrides)
        server = serve(cfg)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(None)


def _connection(address: str, token: str | None = None) -> grpc.Channel:
    """A channel with its own TCP connection (gRPC shares connections between channels)."""
    opts = [("grpc.use_local_subchannel_pool", 1)]
    return make_channel(address, ClientSecurity(token=token), opts)


def _draft(stub, rid: str, base_len: int, tokens: list[int], finished: bool = False):
    req = drafter_pb2.DraftRequest(step=1)
    req.sequences.add(
        request_id=rid, base_len=base_len, new_tokens=tokens, max_draft_tokens=4, finished=finished
    )
    return stub.Draft(req, timeout=10).drafts


SECRET = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repetitive: the n-gram drafter continues it


def test_a_session_is_visible_only_to_the_connection_that_made_it(drafter_factory):
    server = drafter_factory()
    with _connection(server.address) as a, _connection(server.address) as b:
        alice, mallory = (
            drafter_pb2_grpc.DrafterServiceStub(a),
            drafter_pb2_grpc.DrafterServiceStub(b),
        )
        assert _draft(alice, "s", 0, SECRET)[0].tokens == [8, 5, 6, 7]
        # Another connection cannot continue (read) it: the session is not there for it.
        (probe,) = _draft(mallory, "s", len(SECRET), [8])
        assert probe.resync and not probe.tokens
        # ... nor finish or reset it: those touch only its own session of that name.
        assert _draft(mallory, "s", 0, [1, 2], finished=True) == []
        assert _draft(mallory, "s", 0, [1, 2, 3])[0].tokens == []
        (mine,) = _draft(alice, "s", len(SECRET), [8])
        assert not mine.resync and mine.tokens == [5, 6, 7, 8]
        assert len(server.engine.store) == 2
        server.engine.check_integrity()


def test_token_identities_own_their_sessions_across_connections(drafter_factory):
    server = drafter_factory()
    with _connection(server.address, "tok-a") as a1, _connection(server.address, "tok-a") as a2:
        _draft(drafter_pb2_grpc.DrafterServiceStub(a1), "s", 0, SECRET)
        # Same token on a new connection: the same owner, so the session carries on.
        (again,) = _draft(drafter_pb2_grpc.DrafterServiceStub(a2), "s", len(SECRET), [8])
        assert not again.resync
        with _connection(server.address, "tok-b") as b:
            assert _draft(drafter_pb2_grpc.DrafterServiceStub(b), "s", len(SECRET) + 1, [5])[
                0
            ].resync


def _stream_once(channel, rid: str) -> None:
    """One DraftStream that opens session `rid` and ends."""
    msg = drafter_pb2.DraftStreamRequest(step=1)
    msg.sequences.add(request_id=rid, base_len=0, new_tokens=SECRET, max_draft_tokens=4)
    (reply,) = drafter_pb2_grpc.DrafterServiceStub(channel).DraftStream(iter([msg]), timeout=10)
    assert list(reply.drafts[0].tokens) == [8, 5, 6, 7]


def test_a_connections_sessions_go_when_its_last_stream_ends(drafter_factory):
    """Sessions of a caller known only by its connection cannot be reached once its streams
    are gone (a new connection is a new caller; a relay restarted after a crash is one), so
    they are freed then, not after the TTL. A token's sessions outlive the stream."""
    server = drafter_factory()
    with _connection(server.address) as ch:
        _stream_once(ch, "s")
        wait_until(lambda: "s" not in server.engine.store, timeout=5, what="sessions freed")
    with _connection(server.address, "tok-a") as ch:
        _stream_once(ch, "t")
        wait_until(lambda: not server.servicer.streams, timeout=5, what="the stream's end")
        assert "t" in server.engine.store
    server.engine.check_integrity()


def test_sessions_are_bounded_in_number_and_size(drafter_factory):
    server = drafter_factory(max_sessions=2, max_session_tokens=16)
    with _connection(server.address) as ch:
        stub = drafter_pb2_grpc.DrafterServiceStub(ch)
        _draft(stub, "a", 0, [1, 2])
        _draft(stub, "b", 0, [1, 2])
        with pytest.raises(grpc.RpcError) as err:
            _draft(stub, "c", 0, [1, 2])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions" in err.value.details()
        _draft(stub, "a", 0, [1, 2], finished=True)  # room again
        _draft(stub, "c", 0, [1, 2])
        with pytest.raises(grpc.RpcError) as err:
            _draft(stub, "c", 2, list(range(15)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-session-tokens" in err.value.details()
    assert len(server.engine.store) == 1  # the oversized session was dropped
    server.engine.check_integrity()


def test_idle_draft_streams_are_limited_per_caller_and_do_not_starve_getinfo(drafter_factory):
    server = drafter_factory(max_streams_per_peer=4, max_workers=1)
    channels = [_connection(server.address) for _ in range(4)]
    done = threading.Event()
    idle = [drafter_pb2_grpc.DrafterServiceStub(ch).DraftStream(_never(done)) for ch in channels]
    try:
        with _connection(server.address) as ch:
            stub = drafter_pb2_grpc.DrafterServiceStub(ch)
            # All 4 idle streams are open once GetInfo is answered on a fresh connection ...
            info = stub.GetInfo(drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5)
            assert info.max_draft_len == 4
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            # ... and a fifth stream from the same address is refused at once.
            wait_until(lambda: sum(server.servicer.streams.values()) == 4, 10, what="4 streams")
            fifth = stub.DraftStream(iter([drafter_pb2.DraftStreamRequest(step=1)]), timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                list(fifth)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        done.set()
        for call in idle:
            call.cancel()
        for ch in channels:
            ch.close()


def _never(done: threading.Event):
    """A request iterator that sends nothing until `done`."""
    done.wait(60)
    return
    yield  # pragma: no cover - makes this a generator
