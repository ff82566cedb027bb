"""Shared fixtures: the models, loaded once per session (SmolLM2's GGUF takes ~10 s to read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specwire.common.model.checkpoint import Checkpoint, write_hf_folder
from specwire.common.model.loader import LoadedModel, build_model, load_checkpoint, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random", progress=False)


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> tuple[str, Checkpoint]:
    return load_checkpoint("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint: tuple[str, Checkpoint]) -> LoadedModel:
    """What `load_model("smollm2-135m")` returns (it is `load_checkpoint` then `build_model`)."""
    return build_model(*smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_folder(
    smollm2_checkpoint: tuple[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """SmolLM2's GGUF exported as a Hugging Face folder (dequantized, fp32), as
    `export_hf_folder("smollm2-135m", ...)` writes it."""
    folder = tmp_path_factory.mktemp("smollm2-hf")
    write_hf_folder(smollm2_checkpoint[1], folder)
    return folder


# One torch thread per process: tests start servers as subprocesses next to the test process,
# and two processes each running two threads on 2 cores slow each other down many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def servers():
    """Drafter services on loopback (`servers(instance=None, port=0, **config)`), each also on
    a unix socket of its own (`--socket`), and remote drafter harnesses against them
    (`servers.harness(address, **kw)`; with mode="socket", on that service's socket), all
    stopped after."""
    from remote_harness import Harness, Sockets

    from specwire.drafter_service.config import DrafterServiceConfig
    from specwire.drafter_service.server import serve

    started, harnesses = [], []
    sockets = Sockets()

    def start(instance=None, port: int = 0, **overrides):
        overrides.setdefault("max_draft_len", 4)
        overrides.setdefault("socket", sockets.path(port, len(started)))
        cfg = DrafterServiceConfig(host="127.0.0.1", port=port, **overrides)
        server = serve(cfg, instance)
        started.append(server)
        return server

    def harness(address: str, **kw) -> Harness:
        if kw.get("mode") == "socket" and "socket" not in kw:
            (kw["socket"],) = [s.config.socket for s in started if address.endswith(f":{s.port}")]
        h = Harness(address, **kw)
        harnesses.append(h)
        return h

    start.harness = harness
    yield start
    for h in harnesses:
        h.drafter.close()
    for s in started:
        s.stop(None)
    sockets.remove()
