"""The Node.js examples (examples/node): the custom drafter and the streaming client.

- The Node drafter speaks `specwire.v1.DrafterService` correctly (handshake, deltas, resync, finish,
  unpadded drafts, the stream path, health), checked with the Python stubs over loopback.
- The Node client streams from a `Generation` server and prints text + statistics / JSON.
- End to end: a real `specwire target` drafting through the Node drafter gives the same greedy
  text as decoding without speculation, and accepts drafts on a repetitive prompt.

Skipped (with the reason) when node/npm are missing. `npm ci` runs once when node_modules is
missing or older than package-lock.json.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from procs import free_port, running_service, start_service, stop_service

from specwire.common import healthcheck
from specwire.common.protogen import (
    drafter_pb2,
    drafter_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "examples" / "node"
DRAFTER_READY = r"node drafter listening on (\S+):(\d+)"
TARGET_READY = r"specwire target listening on (\S+):(\d+)"
MAX_DRAFT_LEN = 4
# tiny-random (seeded random weights) falls into loops under greedy decoding, which prompt lookup
# then drafts; a real model on a code prompt is the fallback if that ever stops being true.
E2E_MODEL = "tiny-random"
E2E_PROMPT = "one two three four five. " * 8
E2E_MAX_NEW_TOKENS = 48


def _specwire() -> list[str]:
    """The `specwire` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("specwire")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specwire.common.cli"]


@pytest.fixture(scope="module")
def node_modules() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node/npm not installed: the Node.js examples need Node.js >= 18")
    lock = NODE_DIR / "package-lock.json"
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stderr[-3000:]}"
    return NODE_DIR / "node_modules"


@pytest.fixture
def node_drafter(node_modules) -> Iterator[str]:
    """A running Node drafter; yields its HOST:PORT."""
    cmd = ["node", "drafter.js", "--port", "0", "--max-draft-len", str(MAX_DRAFT_LEN)]
    with running_service(cmd, None, DRAFTER_READY, timeout=30, cwd=NODE_DIR) as (_, match):
        yield f"127.0.0.1:{match.group(2)}"


def _update(rid: str, base_len: int, new: list[int], budget: int = MAX_DRAFT_LEN, **kw):
    return drafter_pb2.SequenceUpdate(
        request_id=rid, base_len=base_len, new_tokens=new, max_draft_tokens=budget, **kw
    )


# --- the Node drafter, checked with the Python stubs --------------------------------------------


def test_node_drafter_handshake_and_health(node_drafter: str) -> None:
    with grpc.insecure_channel(node_drafter) as channel:
        info = drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
            drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5
        )
    assert info.protocol_version == 1
    assert info.vocab_size == 0 and info.tokenizer_fingerprint == ""  # token-agnostic
    assert info.max_draft_len == MAX_DRAFT_LEN
    assert "stream" in info.capabilities
    assert healthcheck.check(node_drafter) == "SERVING"
    assert healthcheck.check(node_drafter, "specwire.v1.DrafterService") == "SERVING"
    probe = subprocess.run(
        [sys.executable, "-m", "specwire.common.healthcheck", node_drafter], cwd=ROOT, timeout=30
    )
    assert probe.returncode == 0


def test_node_drafter_sessions_deltas_resync_and_finish(node_drafter: str) -> None:
    with grpc.insecure_channel(node_drafter) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)

        def draft(step: int, *updates) -> dict[str, drafter_pb2.SequenceDraft]:
            reply = stub.Draft(drafter_pb2.DraftRequest(step=step, sequences=updates), timeout=5)
            assert reply.step == step
            return {d.request_id: d for d in reply.drafts}

        # First update carries the prompt; the suffix [1, 2, 3] occurred before, followed by 4 ...
        d = draft(1, _update("a", 0, [1, 2, 3, 4, 1, 2, 3]), _update("b", 0, [9, 8, 7]))
        assert (list(d["a"].tokens), d["a"].base_len, d["a"].resync) == ([4, 1, 2, 3], 7, False)
        assert (list(d["b"].tokens), d["b"].base_len) == ([], 3)  # nothing to look up: unpadded
        # A delta on top of what the drafter holds; the budget caps the draft.
        d = draft(2, _update("a", 7, [4], budget=2), _update("b", 3, [9], budget=0))
        assert (list(d["a"].tokens), d["a"].base_len) == ([1, 2], 8)
        assert (list(d["b"].tokens), d["b"].base_len) == ([], 4)  # budget 0: just record
        # A budget above the drafter's max is capped at its max.
        d = draft(3, _update("a", 8, [1], budget=10))
        assert len(d["a"].tokens) == MAX_DRAFT_LEN
        # base_len mismatch: the drafter asks for the full prefix and drops its session ...
        d = draft(4, _update("a", 5, [2]))
        assert d["a"].resync and list(d["a"].tokens) == []
        d = draft(5, _update("a", 9, [2]))
        assert d["a"].resync
        # ... which the target then sends with base_len 0.
        d = draft(6, _update("a", 0, [1, 2, 3, 4, 1, 2, 3, 4, 1]))
        assert not d["a"].resync and d["a"].base_len == 9
        assert list(d["a"].tokens) == [2, 3, 4, 1]
        # finished frees the session and gets no draft; a later delta must resync.
        d = draft(7, _update("b", 4, [], finished=True))
        assert "b" not in d
        d = draft(8, _update("b", 4, [5]))
        assert d["b"].resync
        # An id the drafter never saw, with base_len > 0 (e.g. after a drafter restart).
        d = draft(9, _update("never-seen", 12, [3]))
        assert d["never-seen"].resync


def test_node_drafter_offers_branches_when_asked(node_drafter: str) -> None:
    """The Node drafter implements the branches extension: other tokens that followed the
    suffix, each with what came after it, only when the update asks."""
    forked = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]  # after "1 2": 3 once, 5 (the latest) once
    with grpc.insecure_channel(node_drafter) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        info = stub.GetInfo(drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5)
        assert "branches" in info.capabilities
        ask = _update("f", 0, forked, max_branches=2, branch_positions=2)
        plain = _update("g", 0, forked)
        reply = stub.Draft(drafter_pb2.DraftRequest(step=1, sequences=[ask, plain]), timeout=5)
    got = {d.request_id: d for d in reply.drafts}
    assert list(got["f"].tokens) == [5, 6, 9, 1]
    branches = [(b.position, b.token, list(b.tokens)) for b in got["f"].branches]
    assert branches == [(0, 3, [4, 9, 1])]  # budget 4: 4 - 0 - 1 tokens after the branch token
    assert list(got["g"].tokens) == [5, 6, 9, 1] and not got["g"].branches


def test_node_drafter_stream_answers_in_order(node_drafter: str) -> None:
    steps = [2**40 + i for i in range(3)]  # uint64 step numbers round-trip exactly
    requests = [
        drafter_pb2.DraftStreamRequest(step=steps[0], sequences=[_update("s", 0, [5, 6, 5])]),
        drafter_pb2.DraftStreamRequest(step=steps[1], sequences=[_update("s", 3, [6])]),
        drafter_pb2.DraftStreamRequest(
            step=steps[2], sequences=[_update("s", 4, [], finished=True)]
        ),
    ]
    with grpc.insecure_channel(node_drafter) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        replies = list(stub.DraftStream(iter(requests), timeout=10))
    assert [r.step for r in replies] == steps
    # A loop is drafted for the whole budget, not just up to the end of the sequence.
    assert list(replies[0].drafts[0].tokens) == [6, 5, 6, 5]
    assert replies[1].drafts[0].base_len == 4
    assert list(replies[1].drafts[0].tokens) == [5, 6, 5, 6]
    assert list(replies[2].drafts) == []


def test_node_drafter_reads_env_and_stops_on_sigterm(node_modules) -> None:
    port = free_port()
    env = {"SPECWIRE_DRAFTER_PORT": str(port), "SPECWIRE_MAX_DRAFT_LEN": "2"}
    proc, match = start_service(["node", "drafter.js"], env, DRAFTER_READY, 30, cwd=NODE_DIR)
    try:
        assert int(match.group(2)) == port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
                drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5
            )
        assert info.max_draft_len == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        stop_service(proc)


def test_node_drafter_bad_flag_is_one_line(node_modules) -> None:
    result = subprocess.run(
        ["node", "drafter.js", "--max-draft-len", "x"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- the Node client, against a scripted Generation server -------------------------------------


class _ScriptedGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Streams two chunks and a completion, or fails the way a real target would."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if request.prompt == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens too large")
        if request.prompt == "boom":
            yield generation_pb2.GenerateResponse(
                request_id="r1", error=generation_pb2.GenerateError(code="INTERNAL", message="oom")
            )
            return
        chunk = generation_pb2.GenerateChunk
        yield generation_pb2.GenerateResponse(
            request_id="r1", chunk=chunk(token_ids=[7], text="He")
        )
        yield generation_pb2.GenerateResponse(
            request_id="r1",
            chunk=chunk(token_ids=[8, 9, 10], text="llo!", draft_tokens=3, accepted_tokens=2),
        )
        stats = generation_pb2.SpeculationStats(
            steps=2,
            draft_tokens=3,
            accepted_tokens=2,
            acceptance_rate=2 / 3,
            mean_accepted_length=2.0,
            accepted_length_histogram=[1, 0, 1, 0, 0],
        )
        yield generation_pb2.GenerateResponse(
            request_id="r1",
            complete=generation_pb2.GenerateComplete(
                finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=4),
                speculation=stats,
                text="Hello!",
            ),
        )


@pytest.fixture
def scripted_target() -> Iterator[tuple[str, _ScriptedGeneration]]:
    servicer = _ScriptedGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def _node_client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["node", "client.js", *args], cwd=NODE_DIR, capture_output=True, text=True, timeout=120
    )


def test_node_client_json(node_modules, scripted_target) -> None:
    target, servicer = scripted_target
    result = _node_client("--target", target, "--prompt", "Hi", "--max-new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out == {
        "text": "Hello!",
        "token_ids": [7, 8, 9, 10],
        "finish_reason": "length",
        "speculation": {
            "steps": 2,
            "draft_tokens": 3,
            "accepted_tokens": 2,
            "acceptance_rate": pytest.approx(2 / 3),
            "mean_accepted_length": 2.0,
            "histogram": [1, 0, 1, 0, 0],
        },
    }
    (request,) = servicer.requests
    assert request.prompt == "Hi" and request.max_new_tokens == 4
    assert not request.speculation.disable


def test_node_client_streams_text_then_stats(node_modules, scripted_target) -> None:
    target, servicer = scripted_target
    result = _node_client("--target", target, "--prompt", "Hi", "--no-speculation")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello!\n")
    for needle in ("steps: 2", "accepted: 2", "66.7%", "2.00", "0:1 1:0 2:1"):
        assert needle in result.stdout
    assert servicer.requests[0].speculation.disable


@pytest.mark.parametrize("prompt", ["bad", "boom"])
def test_node_client_errors_are_one_line(node_modules, scripted_target, prompt: str) -> None:
    target, _ = scripted_target
    result = _node_client("--target", target, "--prompt", prompt, "--json")
    assert result.returncode != 0
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert ("INVALID_ARGUMENT" if prompt == "bad" else "INTERNAL") in line


def test_node_client_unreachable_target(node_modules) -> None:
    result = _node_client("--target", f"127.0.0.1:{free_port()}", "--prompt", "x")
    assert result.returncode != 0
    assert "UNAVAILABLE" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- end to end: the real target drafting through the Node drafter ------------------------------


def _python_generate(target: str, *extra: str) -> dict:
    cmd = [*_specwire(), "generate", "--target", target, "--prompt", E2E_PROMPT]
    cmd += ["--max-new-tokens", str(E2E_MAX_NEW_TOKENS), "--json", *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_target_with_node_drafter_is_lossless_and_accepts(node_drafter: str) -> None:
    port = free_port()  # `--port 0` may not be supported; the ready line names the real port
    cmd = [*_specwire(), "target", "--model", E2E_MODEL, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--drafter", f"grpc://{node_drafter}", "--max-draft-len", str(MAX_DRAFT_LEN)]
    # Every reply waited for (patience = the 50 ms deadline): this checks the Node drafter's
    # drafts reach verification, not how a millisecond step trades a round trip for them.
    cmd += ["--drafter-patience-ms", "50"]
    with running_service(cmd, None, TARGET_READY, timeout=240, cwd=ROOT) as (_, match):
        target = f"127.0.0.1:{match.group(2)}"
        node = _node_client(
            "--target", target, "--prompt", E2E_PROMPT,
            "--max-new-tokens", str(E2E_MAX_NEW_TOKENS), "--json",
        )  # fmt: skip
        assert node.returncode == 0, node.stderr
        spec = json.loads(node.stdout)
        plain = _python_generate(target, "--no-speculation")
        via_python = _python_generate(target)

    assert spec["text"] == plain["text"]
    assert spec["token_ids"] == plain["token_ids"]
    assert via_python["text"] == plain["text"]
    stats = spec["speculation"]
    assert stats["draft_tokens"] > 0, stats
    assert stats["accepted_tokens"] > 0, stats
    assert plain["speculation"]["draft_tokens"] == 0
    assert sum(stats["histogram"]) == stats["steps"]
