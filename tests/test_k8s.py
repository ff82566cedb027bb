"""deploy/k8s renders with kustomize and validates against the Kubernetes schemas, and says
what we mean (probes on the serving ports, non-root, 0.0.0.0 binds, the GPU overlay).

Rendering uses `kubectl kustomize` when kubectl is installed; otherwise the base's resources
are concatenated as listed in its kustomization.yaml (enough for the base, which uses no
patches), and the overlay tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.30"


def render(path: Path) -> list[dict]:
    if KUBECTL:
        out = subprocess.run(
            [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    if path != K8S:
        pytest.skip("kubectl is not installed: overlays need `kubectl kustomize` to render")
    return _concatenate(K8S)


def _concatenate(folder: Path) -> list[dict]:
    """The resources a patch-free kustomization lists, recursively (no kustomize needed)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for item in kustomization["resources"]:
        entry = folder / item
        if entry.is_dir():
            docs += _concatenate(entry)
        else:
            docs += [d for d in yaml.safe_load_all(entry.read_text()) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(K8S)


OVERLAYS = K8S / "overlays"


@pytest.mark.parametrize(
    "path", [K8S, OVERLAYS / "gpu", OVERLAYS / "gpu-sidecar"], ids=["base", "gpu", "gpu-sidecar"]
)
def test_manifests_validate_against_the_schemas(path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = render(path)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_bad_manifest(base: list[dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = yaml.safe_load(yaml.safe_dump(by_kind(base, "Deployment")["specwire-target"]))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_probes_ports_and_security(base: list[dict]) -> None:
    config = by_kind(base, "ConfigMap")["specwire-config"]["data"]
    deployments = by_kind(base, "Deployment")
    services = by_kind(base, "Service")
    ports = {
        "specwire-target": int(config["SPECWIRE_PORT"]),
        "specwire-drafter": int(config["SPECWIRE_DRAFTER_PORT"]),
    }
    # Pods must listen on all interfaces to be reachable through their Service.
    assert config["SPECWIRE_HOST"] == config["SPECWIRE_DRAFTER_HOST"] == "0.0.0.0"
    # The target drafts through the drafter's Service.
    assert config["SPECWIRE_DRAFTER"] == f"grpc://specwire-drafter:{ports['specwire-drafter']}"
    for name, port in ports.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert {"cpu", "memory"} <= set(container["resources"]["limits"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (name, probe)
        grpc_port = next(p for p in container["ports"] if p["name"] == "grpc")
        assert grpc_port["containerPort"] == port
        service = services[name]["spec"]
        assert service["selector"] == deployments[name]["spec"]["selector"]["matchLabels"]
        assert any(p["port"] == port and p["targetPort"] == "grpc" for p in service["ports"])


def test_gpu_overlay_puts_the_target_on_a_gpu() -> None:
    docs = render(K8S / "overlays" / "gpu")
    target = by_kind(docs, "Deployment")["specwire-target"]["spec"]["template"]["spec"]
    (container,) = target["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":gpu")
    assert by_kind(docs, "ConfigMap")["specwire-config"]["data"]["SPECWIRE_DEVICE"] == "cuda"
    drafter = by_kind(docs, "Deployment")["specwire-drafter"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in drafter["containers"][0]["resources"]["limits"]


def test_gpu_sidecar_overlay_runs_the_drafter_in_the_targets_pod_on_a_socket() -> None:
    """One pod: the GPU target and its drafter as a native sidecar (started first, so the
    target finds it), sharing an emptyDir for the drafter's unix socket; the target names the
    drafter on loopback and that socket; the base's drafter Deployment and Service are gone."""
    docs = render(OVERLAYS / "gpu-sidecar")
    assert set(by_kind(docs, "Deployment")) == {"specwire-target"}
    assert set(by_kind(docs, "Service")) == {"specwire-target"}
    config = by_kind(docs, "ConfigMap")["specwire-config"]["data"]
    pod = by_kind(docs, "Deployment")["specwire-target"]["spec"]["template"]["spec"]
    (target,) = pod["containers"]
    (drafter,) = pod["initContainers"]
    assert drafter["restartPolicy"] == "Always"  # a sidecar, not a run-once init container
    assert target["resources"]["limits"]["nvidia.com/gpu"] == 1
    (volume,) = pod["volumes"]
    assert "emptyDir" in volume

    def env(container: dict) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in container["env"]}

    def mount(container: dict) -> str:
        (m,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        return m["mountPath"]

    socket = env(target)["SPECWIRE_DRAFTER_SOCKET"]
    assert env(drafter)["SPECWIRE_DRAFTER_SOCKET"] == socket
    assert mount(target) == mount(drafter) == socket.rsplit("/", 1)[0]
    assert env(target)["SPECWIRE_DRAFTER"] == f"grpc://127.0.0.1:{config['SPECWIRE_DRAFTER_PORT']}"
    assert env(drafter)["SPECWIRE_DRAFTER"] == "ngram"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert drafter[probe]["grpc"]["port"] == int(config["SPECWIRE_DRAFTER_PORT"])
    assert drafter["securityContext"]["allowPrivilegeEscalation"] is False
