"""The images, built and run for real with podman (run by `make test-containers`, which sets
SPECWIRE_CONTAINERS=1 and prepares podman and a Python base image; skipped otherwise).

Both images are built from docker/*.Dockerfile, started as docker-compose.yml says (its
environment and commands; containers on the host network where the hostname `drafter` is
loopback, since the compose network needs a bridge this sandbox may not have; no pod,
which would need the catatonit pause binary; the drafter's socket in a podman volume both
mount, as the compose file's named volume), probed with
their own HEALTHCHECK, and a generation through the containers must return the same tokens as
the same request to the repo's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack

import pytest
import yaml
from procs import running_service
from test_compose import COMPOSE_FILE, PROMPT, _environment, _wait_healthy

from specwire.common import healthcheck

pytestmark = pytest.mark.skipif(
    os.environ.get("SPECWIRE_CONTAINERS") != "1",
    reason="builds and runs container images: `make test-containers` (scripts/test-containers.sh)",
)
MAX_NEW_TOKENS = 24
MODEL = "tiny-random"  # the compose file's ${SPECWIRE_MODEL} override, for speed
TAG = "test"


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """Build both images; returns {service: image}."""
    ca = os.environ["CONTAINER_CA_BUNDLE"]
    built = {}
    for service in ("drafter", "target"):
        image = f"localhost/specwire-{service}:{TAG}"
        start = time.monotonic()
        # docker format: the OCI image format has no HEALTHCHECK, which the test runs.
        podman("build", "--format", "docker", "--network", "host", "--volume", f"{ca}:{ca}:ro",
               "--build-arg", f"PYTHON_IMAGE={os.environ['PYTHON_IMAGE']}",
               "-f", f"docker/{service}.Dockerfile", "-t", image, ".")  # fmt: skip
        print(f"built {image} in {time.monotonic() - start:.0f}s", file=sys.stderr)
        built[service] = image
    return built


def _generate(target: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "specwire.common.cli",
        "generate",
        "--target",
        target,
        "--prompt",
        PROMPT,
    ]
    cmd += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_compose_stack_in_containers_matches_the_repo(images: dict[str, str]) -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    services = compose["services"]
    pod = "specwire-test"  # container name prefix
    names = [f"{pod}-{s}" for s in ("drafter", "target")]
    podman("rm", "-f", "--ignore", *names, check=False)
    volumes: set[str] = set()
    try:
        for service in ("drafter", "target"):  # compose's depends_on order
            env = _environment(services[service])
            if "SPECWIRE_MODEL" in env:
                env["SPECWIRE_MODEL"] = MODEL
            args = [f"--env={k}={v}" for k, v in env.items()]
            for entry in services[service].get("volumes") or []:  # the socket's, shared
                name, _, path = entry.partition(":")
                args.append(f"--volume={pod}-{name}:{path}")
                volumes.add(f"{pod}-{name}")
            podman("run", "-d", "--network", "host", "--add-host", "drafter:127.0.0.1",
                   "--name", f"{pod}-{service}", *args,
                   images[service], *services[service]["command"])  # fmt: skip
            port = env.get("SPECWIRE_PORT") or env["SPECWIRE_DRAFTER_PORT"]
            _wait_container_healthy(f"{pod}-{service}", f"127.0.0.1:{port}", timeout=300)
        in_containers = _generate("127.0.0.1:50051")
        target_log = podman("logs", names[1], check=False)
    finally:
        logs = "".join(podman("logs", n, check=False).stderr[-1500:] for n in names)
        podman("rm", "-f", "--ignore", *names, check=False)
        if volumes:
            podman("volume", "rm", "-f", *sorted(volumes), check=False)

    # The same request to the repo's own processes (drafter, then target drafting through it).
    with ExitStack() as stack:
        drafter_cmd = [
            sys.executable,
            "-m",
            "specwire.common.cli",
            "drafter",
            "--host",
            "127.0.0.1",
        ]
        _, m = stack.enter_context(
            running_service(drafter_cmd + ["--port", "0"], None, r"listening on \S+:(\d+)", 60)
        )
        target_cmd = [sys.executable, "-m", "specwire.common.cli", "target", "--model", MODEL]
        target_cmd += ["--port", "0", "--no-progress", "--drafter", f"grpc://127.0.0.1:{m[1]}"]
        proc, t = stack.enter_context(
            running_service(target_cmd, None, r"listening on ([\d.]+:\d+)", 120)
        )
        _wait_healthy(proc, t[1], "target", timeout=60)
        in_repo = _generate(t[1])

    assert in_containers["token_ids"] == in_repo["token_ids"], logs
    assert in_containers["text"] == in_repo["text"]
    # The containers' target really drafted through the drafter container, on its socket in
    # the shared volume (the listening line names the carrier).
    assert in_containers["speculation"]["draft_tokens"] > 0, (in_containers, logs)
    socket = _environment(services["target"])["SPECWIRE_DRAFTER_SOCKET"]
    assert f"(socket {socket})" in target_log.stdout + target_log.stderr, logs


def test_target_image_kernel_cache_in_a_fresh_volume_is_the_service_users(
    images: dict[str, str],
) -> None:
    """`target-gpu` mounts a named volume at the folder of the image's TRITON_CACHE_DIR: a
    fresh volume there must take the folder's owner, so the service user can create the cache
    (Triton would fail to compile, or compile again at every start)."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    entries = compose["services"]["target-gpu"]["volumes"]
    # the folder's owner (the volume's, once mounted), then a cache the service user writes
    probe = (
        'stat -c %u "$(dirname "$TRITON_CACHE_DIR")"'
        ' && mkdir -p "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/probe"'
    )
    for entry in entries:
        name, _, path = entry.partition(":")
        if name != "kernel-cache":
            continue
        volume = f"specwire-test-{name}"
        podman("volume", "rm", "-f", volume, check=False)
        try:
            out = podman("run", "--rm", f"--volume={volume}:{path}", "--entrypoint", "sh",
                         images["target"], "-c", probe)  # fmt: skip
            # and again: what the first run wrote is there for the next container
            again = podman("run", "--rm", f"--volume={volume}:{path}", "--entrypoint", "sh",
                           images["target"], "-c", 'ls "$TRITON_CACHE_DIR"')  # fmt: skip
        finally:
            podman("volume", "rm", "-f", volume, check=False)
        assert out.stdout.strip() == "10001", out  # the image's user (USER 10001) owns it
        assert again.stdout.split() == ["probe"], again
        return
    pytest.fail(f"target-gpu mounts no kernel-cache volume: {entries}")


def _wait_container_healthy(name: str, address: str, timeout: float) -> None:
    """The image's own HEALTHCHECK passes (`podman healthcheck run`), and so does a probe from
    the host."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout
        if state.strip() not in ("running", "created", ""):
            logs = podman("logs", name, check=False)
            pytest.fail(f"{name} is {state.strip()}:\n{(logs.stdout + logs.stderr)[-3000:]}")
        if podman("healthcheck", "run", name, check=False).returncode == 0:
            assert healthcheck.check(address) == "SERVING"
            return
        time.sleep(1)
    logs = podman("logs", name, check=False)
    pytest.fail(f"{name} not healthy after {timeout}s:\n{(logs.stdout + logs.stderr)[-3000:]}")
