"""`specwire target --engine-process on` (auto: on for CUDA): the engine in a child process,
the gRPC front end in the server's. Real services on loopback: the same tokens as speculation
off, errors named, blocks given back, and a dead engine process turns the target NOT_SERVING
and ends it non-zero."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path

import grpc
import pytest
from procs import output_tail, running_service, wait_until

from specwire.common.client import GenerationClient, build_request

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
READY = r"listening on 127\.0\.0\.1:(\d+) .*engine-pid=(\d+)"
PROMPTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "hello hello hello hello",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]


def _cmd(*extra: str, engine_process: str = "on", drafter: str = "ngram") -> list[str]:
    return SPECWIRE + [
        "target", "--model", "tiny-random", "--port", "0", "--no-progress",
        "--engine-process", engine_process, "--drafter", drafter, "--max-batch-size", "4",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def target():
    env = {**ENV, "SPECWIRE_LOG_LEVEL": "INFO"}
    with running_service(_cmd(), env, READY, timeout=180) as (proc, m):
        yield proc, f"127.0.0.1:{m.group(1)}", int(m.group(2))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_the_engine_logs_as_the_front_end_asked(target):
    """--log-level reaches the child (a spawned interpreter starts with no logging set up)."""
    proc, address, _pid = target
    with GenerationClient(address, timeout=60) as client:
        client.generate(PROMPTS[0], max_new_tokens=3, ignore_eos=True)
    wait_until(lambda: "engine ready" in output_tail(proc), 10, 0.1, what="the engine's log")


def test_greedy_output_through_the_engine_process_equals_speculation_off(target):
    """Lossless through the pipe: with speculation, at once and one at a time, the same
    tokens as without it; the engine's counters come back through GetModelInfo."""
    _proc, address, _pid = target
    with GenerationClient(address, timeout=120) as client:
        plain = [
            client.generate(p, max_new_tokens=40, ignore_eos=True, speculate=False).token_ids
            for p in PROMPTS
        ]
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = client.generate(PROMPTS[i], max_new_tokens=40, ignore_eos=True).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(len(PROMPTS))] == plain
        info = client.model_info()
        assert info.model == "tiny-random" and info.max_draft_len == 4
        assert info.speculation.draft_tokens > 0  # speculation really ran in the child
        assert info.kv_blocks_free == info.kv_blocks_total - 1  # all back (block 0: dummy)


def test_bad_input_is_named_and_the_next_request_runs(target):
    _proc, address, _pid = target
    with GenerationClient(address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(build_request(token_ids=[1, 10**6], max_new_tokens=4)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the vocabulary" in err.value.details()
        assert len(client.generate(PROMPTS[0], max_new_tokens=5, ignore_eos=True).token_ids) == 5


def test_a_client_that_goes_away_gives_its_blocks_back(target):
    _proc, address, _pid = target
    with GenerationClient(address, timeout=60) as client:
        total = client.model_info().kv_blocks_total
        stream = client.stream(build_request(token_ids=[5, 6, 7], max_new_tokens=1500))
        next(stream)  # generation is under way
        assert client.model_info().kv_blocks_free < total - 1
        stream.cancel()
        wait_until(
            lambda: client.model_info().kv_blocks_free == total - 1,
            30,
            0.05,
            what="the cancelled request's blocks to come back",
        )


def _under_way(client: GenerationClient):
    """A long generation whose first response has arrived."""
    stream = client.stream(build_request(token_ids=[5, 6, 7], max_new_tokens=1500, ignore_eos=True))
    next(stream)
    return stream


def test_a_dead_engine_process_fails_requests_and_ends_the_target_nonzero():
    with running_service(_cmd(), ENV, READY, timeout=180) as (proc, m):
        address, pid = f"127.0.0.1:{m.group(1)}", int(m.group(2))
        with GenerationClient(address, timeout=60) as client:
            stream = _under_way(client)
            os.kill(pid, signal.SIGKILL)
            rest = list(stream)
        error = rest[-1].error
        assert error.code == "INTERNAL" and "engine" in error.message, rest[-1]
        assert proc.wait(30) == 1, output_tail(proc)
    assert re.search(r"the engine process exited", output_tail(proc))


def test_a_model_that_cannot_load_is_one_line_and_a_nonzero_exit():
    import subprocess

    out = subprocess.run(
        SPECWIRE + ["target", "--model", "/nonexistent/model.gguf", "--engine-process", "on"],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "does not exist" in out.stderr, out.stderr


def test_the_engine_child_is_spawned_before_anything_imports_torch():
    """The CLI spawns the engine child first, so that it imports and loads while the front end
    imports its own modules: that only overlaps if spawning imports no torch."""
    import subprocess

    code = (
        "import sys\n"
        "from specwire.target_service.engine_spawn import spawn_engine\n"
        "from specwire.target_service.cli import run\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **ENV}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_front_end_that_cannot_listen_leaves_no_engine_behind():
    """The child is spawned before the front end binds its port: when the bind fails, the
    target exits non-zero with its error line naming the problem, and no engine process
    stays. (The outcome only: on Linux the child's PR_SET_PDEATHSIG would end it as well as
    the CLI's kill does.)"""
    import socket
    import subprocess
    import uuid

    mark = uuid.uuid4().hex
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = _cmd()
        cmd[cmd.index("--port") + 1] = str(port)
        out = subprocess.run(
            cmd, env={**os.environ, **ENV, "SPECWIRE_TEST_MARK": mark}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode != 0
    # (gRPC's core may log its own line about the bind before ours)
    errors = [line for line in out.stderr.splitlines() if line.startswith("specwire: error:")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0], out.stderr
    wait_until(lambda: not _marked(mark), 30, 0.1, what="the engine process to end")


def _marked(mark: str) -> list[int]:
    """Processes of ours whose environment carries `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SPECWIRE_TEST_MARK={mark}".encode() in f.read() and _alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_n_completions_logprobs_and_stop_strings_cross_the_pipe(target):
    """What the output thread makes in the child — n completions tagged by index, logprobs,
    text cut at a stop string — reaches the client as it does in-process."""
    _proc, address, _pid = target
    with GenerationClient(address, timeout=60) as client:
        responses = list(
            client.stream(
                build_request(
                    PROMPTS[1], max_new_tokens=8, n=2, temperature=1.0, seed=7, logprobs=True
                )
            )
        )
        done = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
        assert sorted(c.index for c in done) == [0, 1]
        chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            ids = [t for c in mine for t in c.token_ids]
            assert len(ids) == done[[c.index for c in done].index(index)].usage.completion_tokens
            assert [lp.token_id for c in mine for lp in c.logprobs] == ids
        full = client.generate(PROMPTS[2], max_new_tokens=30, ignore_eos=True)
        stop = full.text[5:9]
        cut = client.generate(PROMPTS[2], max_new_tokens=30, ignore_eos=True, stop=[stop])
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert full.text.startswith(cut.text)


def test_the_front_end_tokenises_as_the_in_process_target_does(target):
    """Admission runs on a tokenizer the engine saved for the front end: a chat prompt gives
    the same prompt tokens and the same greedy output as a target with the engine in-process;
    SIGUSR1 to the engine prints its stacks and leaves it serving."""
    proc, address, pid = target
    chat = [{"role": "user", "content": "Write a function that adds two numbers."}]
    with GenerationClient(address, timeout=60) as client:
        mine = client.generate(chat=chat, max_new_tokens=12, ignore_eos=True)
        os.kill(pid, signal.SIGUSR1)
        assert client.generate(PROMPTS[0], max_new_tokens=3, ignore_eos=True).token_ids
    cmd = _cmd(engine_process="off")
    with running_service(cmd, ENV, r"listening on 127\.0\.0\.1:(\d+)", timeout=180) as (_p, m):
        with GenerationClient(f"127.0.0.1:{m.group(1)}", timeout=60) as client:
            theirs = client.generate(chat=chat, max_new_tokens=12, ignore_eos=True)
    assert mine.usage["prompt_tokens"] == theirs.usage["prompt_tokens"]
    assert mine.token_ids == theirs.token_ids
    wait_until(lambda: "in engine_main" in output_tail(proc), 10, 0.1, what="the engine's stacks")


def test_an_engine_outlives_no_front_end():
    """The front end killed (-9) with a request in flight: its engine process does not stay
    behind holding the device."""
    with running_service(_cmd(), ENV, READY, timeout=180) as (proc, m):
        address, pid = f"127.0.0.1:{m.group(1)}", int(m.group(2))
        with GenerationClient(address, timeout=60) as client:
            stream = _under_way(client)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError):
                list(stream)
        wait_until(lambda: not _alive(pid), 30, 0.1, what="the engine process to end")


def test_a_remote_drafter_drafts_for_the_engine_process():
    """The remote drafter client lives in the engine process (its config, TLS settings
    included, crosses the spawn): lossless output, and its counters reach GetModelInfo."""
    dcmd = SPECWIRE + ["drafter", "--port", "0", "--drafter", "ngram", "--max-draft-len", "16"]
    with running_service(dcmd, ENV, r"drafter listening on (\S+):(\d+)", timeout=120) as (_d, dm):
        cmd = _cmd(drafter=f"grpc://127.0.0.1:{dm.group(2)}")
        with running_service(cmd, ENV, READY, timeout=180) as (_p, m):
            with GenerationClient(f"127.0.0.1:{m.group(1)}", timeout=60) as client:
                for prompt in PROMPTS[1:3]:
                    spec = client.generate(prompt, max_new_tokens=30, ignore_eos=True)
                    plain = client.generate(
                        prompt, max_new_tokens=30, ignore_eos=True, speculate=False
                    )
                    assert spec.token_ids == plain.token_ids
                info = client.model_info()
    assert info.drafter.startswith("grpc://") and info.speculation.draft_tokens > 0
    assert info.drafter_counters.reconnects >= 1  # the first connection counts
