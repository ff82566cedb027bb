"""docker-compose.yml: it validates, it says what we mean, and its services really run.

There is no Docker engine in CI, so the file is checked three ways:
- `docker-compose config` (or `docker compose config`) validates it, GPU profile included
  (scripts/ci-deps.sh installs Debian's docker-compose; skipped with the reason when missing);
- its structure: health checks through `python -m specwire.common.healthcheck`, the target
  waiting for a healthy drafter, published ports, a `gpu` profile reserving an NVIDIA GPU;
- each (non-profile) service's command runs as a local process with the service's environment,
  the hostname `drafter` mapped to 127.0.0.1 and each port to a free one, until its own health
  check passes (the gateway's is HTTP GET /health); then a speculative generation through the
  target equals the plain one, and so does a greedy completion through the gateway.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from procs import free_port, output_tail, start_service, stop_service, wait_until

from specwire.common import healthcheck

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# Overrides for the local run: the seeded tiny model keeps the test fast.
LOCAL_OVERRIDES = {"SPECWIRE_MODEL": "tiny-random"}
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
MAX_NEW_TOKENS = 32
_PORT_VARS = ("SPECWIRE_PORT", "SPECWIRE_DRAFTER_PORT", "SPECWIRE_GATEWAY_PORT")
_HOST_VARS = ("SPECWIRE_HOST", "SPECWIRE_DRAFTER_HOST", "SPECWIRE_GATEWAY_HOST")
SOCKET_VAR = "SPECWIRE_DRAFTER_SOCKET"  # the drafter's --socket and the target's --drafter-socket
HTTP_SERVICES = {"gateway"}  # health is GET /health, not the gRPC probe


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


# --- validation by Compose itself --------------------------------------------------------------


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_config_validates(profile: str | None) -> None:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no docker-compose / `docker compose`: run scripts/ci-deps.sh (as root)")
    cmd += ["-f", str(COMPOSE_FILE)]
    if profile:
        cmd += ["--profile", profile]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECWIRE_")}
    result = subprocess.run(
        [*cmd, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    expected = {"drafter", "target"} | ({"target-gpu"} if profile else set())
    assert expected <= set(services)


# --- what the file says ------------------------------------------------------------------------


def test_services_and_images(compose: dict) -> None:
    services = compose["services"]
    assert {"drafter", "target", "target-gpu", "gateway"} <= set(services)
    assert services["drafter"]["command"][:2] == ["specwire", "drafter"]
    assert services["target"]["command"][:2] == ["specwire", "target"]
    assert services["gateway"]["command"][:2] == ["specwire", "gateway"]
    built = {svc["image"] for svc in services.values() if "build" in svc}
    for name, svc in services.items():
        if "build" not in svc:  # reuses an image another service builds
            assert svc["image"] in built, f"{name}: nothing builds {svc['image']}"
            continue
        dockerfile = ROOT / svc["build"].get("context", ".") / svc["build"]["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"


@pytest.mark.parametrize("name", ["drafter", "target", "target-gpu"])
def test_health_checks_use_the_grpc_probe_on_the_service_port(compose: dict, name: str) -> None:
    svc = compose["services"][name]
    env = _environment(svc)
    port = env.get("SPECWIRE_PORT") or env["SPECWIRE_DRAFTER_PORT"]
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "specwire.common.healthcheck"]
    assert test[4] == f"127.0.0.1:{port}"
    assert f"{port}:{port}" in [str(p) for p in svc["ports"]]


def test_gateway_fronts_the_target_and_probes_its_http_health(compose: dict) -> None:
    svc = compose["services"]["gateway"]
    env = _environment(svc)
    target_port = _environment(compose["services"]["target"])["SPECWIRE_PORT"]
    assert env["SPECWIRE_TARGET"] == f"target:{target_port}"
    assert svc["depends_on"]["target"]["condition"] == "service_healthy"
    port = env["SPECWIRE_GATEWAY_PORT"]
    assert f"http://127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])
    assert f"{port}:{port}" in [str(p) for p in svc["ports"]]


def test_target_waits_for_a_healthy_drafter(compose: dict) -> None:
    drafter_port = _environment(compose["services"]["drafter"])["SPECWIRE_DRAFTER_PORT"]
    for name in ("target", "target-gpu"):
        svc = compose["services"][name]
        assert svc["depends_on"]["drafter"]["condition"] == "service_healthy"
        assert _environment(svc)["SPECWIRE_DRAFTER"] == f"grpc://drafter:{drafter_port}"


def test_targets_reach_the_drafters_socket_in_a_shared_volume(compose: dict) -> None:
    """The drafter serves its unix socket in a named volume that each target mounts at the
    same place, and each target names that socket (socket mode, auto from the path)."""
    services = compose["services"]
    path = _environment(services["drafter"])[SOCKET_VAR]
    assert path.startswith("/") and path.endswith(".sock")
    folder = os.path.dirname(path)
    volume = _volume_at(services["drafter"], folder)
    assert volume in compose["volumes"], f"{volume}: not a named volume of the file"
    for name in ("target", "target-gpu"):
        assert _environment(services[name])[SOCKET_VAR] == path
        # auto: the target polls on a GPU and asks the drafter to (none on the CPU)
        assert _environment(services[name])["SPECWIRE_DRAFTER_SPIN_MS"] == "-1"
        assert _volume_at(services[name], folder) == volume
        assert "SPECWIRE_DRAFTER_MODE" not in _environment(services[name])  # auto: socket
    # Both images create the folder for their user (the volume takes its owner from there).
    for dockerfile in ("drafter", "target"):
        text = (ROOT / "docker" / f"{dockerfile}.Dockerfile").read_text()
        assert f"install -d -o specwire -g specwire -m 0700 {folder}" in text


def test_gpu_target_keeps_its_compiled_kernels_in_a_named_volume(compose: dict) -> None:
    """The target image points Triton's kernel cache into a folder it creates for its user, and
    `target-gpu` mounts a named volume there, so a recreated container does not compile its
    kernels again (the CPU target compiles none and mounts nothing there)."""
    text = (ROOT / "docker" / "target.Dockerfile").read_text()
    match = re.search(r"TRITON_CACHE_DIR=(\S+)", text)
    assert match, "the target image sets no TRITON_CACHE_DIR"
    folder = os.path.dirname(match[1])
    assert f"install -d -o specwire -g specwire -m 0700 {folder}" in text
    volume = _volume_at(compose["services"]["target-gpu"], folder)
    assert volume in compose["volumes"], f"{volume}: not a named volume of the file"
    with pytest.raises(AssertionError):
        _volume_at(compose["services"]["target"], folder)


def test_gpu_profile_reserves_an_nvidia_gpu(compose: dict) -> None:
    svc = compose["services"]["target-gpu"]
    assert svc["profiles"] == ["gpu"]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    command = svc["command"]
    assert command[command.index("--device") + 1] == "cuda"
    # The default services must not need a GPU.
    for name in ("drafter", "target"):
        assert "profiles" not in compose["services"][name]
        assert _environment(compose["services"][name]).get("SPECWIRE_DEVICE", "cpu") == "cpu"


# --- the services, run as local processes ------------------------------------------------------


def test_compose_services_run_locally_and_speculation_is_lossless(
    compose: dict, tmp_path: Path
) -> None:
    services = {n: s for n, s in compose["services"].items() if "profiles" not in s}
    # Each service's container port gets a free loopback port, the socket a local folder.
    ports = {name: {_service_port(svc): free_port()} for name, svc in services.items()}
    socket = str(tmp_path / "drafter.sock")
    procs = {}

    with ExitStack() as stack:
        for name in _start_order(services):
            svc = services[name]
            env = _local_environment(name, svc, ports)
            if SOCKET_VAR in env:
                env[SOCKET_VAR] = socket
            cmd = _local_command(svc["command"])
            proc, _ = start_service(cmd, env, None, timeout=0, cwd=ROOT)  # ready = healthy
            stack.callback(stop_service, proc)
            procs[name] = proc
            address = f"127.0.0.1:{ports[name][_service_port(svc)]}"
            _wait_healthy(proc, address, name, timeout=300, http=name in HTTP_SERVICES)
            # The service's own health check command passes too.
            probe = _localize(svc["healthcheck"]["test"][1:], ports)
            if probe[0] in ("python", "python3"):  # the image's python is this venv's here
                probe[0] = sys.executable
            assert subprocess.run(probe, cwd=ROOT, timeout=30).returncode == 0

        # The target drafts on the drafter's socket (its listening line names the carrier).
        wait_until(
            lambda: f"(socket {socket})" in output_tail(procs["target"]),
            timeout=30,
            what="the target's listening line naming the socket",
        )
        target = f"127.0.0.1:{ports['target'][_service_port(services['target'])]}"
        speculative = _generate(target)
        plain = _generate(target, "--no-speculation")
        gateway = f"127.0.0.1:{ports['gateway'][_service_port(services['gateway'])]}"
        via_gateway = _complete(gateway)

    assert via_gateway == plain["text"]
    assert speculative["text"] == plain["text"]
    assert speculative["token_ids"] == plain["token_ids"]
    assert plain["speculation"]["draft_tokens"] == 0
    # The repeated prompt gives the n-gram drafter something to draft: the target really
    # reached the drafter service at the translated address.
    assert speculative["speculation"]["draft_tokens"] > 0, speculative["speculation"]


# --- helpers -----------------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def _interpolate(value: str) -> str:
    """Compose-style ${VAR:-default} / ${VAR} / $VAR / $$ with an empty shell environment,
    so the file's own defaults are what the test sees."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return m.group(2) or ""

    return _VAR.sub(sub, value)


def _environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _volume_at(svc: dict, folder: str) -> str:
    """The named volume `svc` mounts at `folder` ("name:/path" entries)."""
    for entry in svc.get("volumes") or []:
        source, _, target = str(entry).partition(":")
        if target.split(":")[0] == folder:
            return source
    raise AssertionError(f"no volume at {folder}: {svc.get('volumes')}")


def _service_port(svc: dict) -> str:
    env = _environment(svc)
    return next(env[var] for var in _PORT_VARS if var in env)


def _localize(args: list[str], ports: dict[str, dict[str, int]]) -> list[str]:
    """Point service addresses (`drafter:50052`, `127.0.0.1:50052`) at the local free ports."""
    out = []
    for arg in args:
        for name, mapping in ports.items():
            for container_port, local_port in mapping.items():
                arg = re.sub(
                    rf"\b(?:{re.escape(name)}|127\.0\.0\.1|localhost):{container_port}\b",
                    f"127.0.0.1:{local_port}",
                    arg,
                )
        out.append(arg)
    return out


def _local_environment(
    name: str, svc: dict, ports: dict[str, dict[str, int]]
) -> dict[str, str | None]:
    """The service's environment with loopback hosts and the free ports; the test overrides."""
    env = _environment(svc)
    local: dict[str, str | None] = dict(zip(env, _localize(list(env.values()), ports), strict=True))
    for var in _PORT_VARS:
        if var in env:
            local[var] = str(ports[name][env[var]])
    for var in _HOST_VARS:
        if var in env:
            local[var] = "127.0.0.1"
    local.update({k: v for k, v in LOCAL_OVERRIDES.items() if k in env})
    # Variables the file does not set must not leak in from the developer's shell.
    unset = {k: None for k in os.environ if k.startswith("SPECWIRE_") and k not in env}
    return {**unset, **local}


def _local_command(command: list[str]) -> list[str]:
    assert command[0] == "specwire", command
    script = Path(sys.executable).with_name("specwire")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "specwire.common.cli"]
    return head + list(command[1:])


def _start_order(services: dict) -> Iterator[str]:
    """Dependencies first (depends_on), as Compose starts them."""
    done: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        done.append(name)

    for name in services:
        visit(name)
    return iter(done)


def _http_health(address: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2) as reply:
            return "SERVING" if reply.status == 200 else str(reply.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)


def _wait_healthy(
    proc: subprocess.Popen, address: str, name: str, timeout: float, http: bool = False
) -> None:
    deadline = time.monotonic() + timeout
    status = "unreachable"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{output_tail(proc)}")
        try:
            status = _http_health(address) if http else healthcheck.check(address, timeout=2)
        except Exception as exc:  # noqa: BLE001 - not up yet
            status = type(exc).__name__
        if status == "SERVING":
            return
        time.sleep(0.3)
    tail = output_tail(proc)
    pytest.fail(f"{name} at {address} not SERVING after {timeout}s ({status}):\n{tail}")


def _complete(gateway: str) -> str:
    """Greedy text of PROMPT through the gateway's /v1/completions."""
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    req = urllib.request.Request(
        f"http://{gateway}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def _generate(target: str, *extra: str) -> dict:
    cmd = _local_command(["specwire", "generate"])
    cmd += ["--target", target, "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    cmd += ["--json", *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)
