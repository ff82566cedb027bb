"""Start services as subprocesses and wait for their "listening" line (shared by tests).

    proc, match = start_service(["specwire", "target", "--port", "0"], None,
                                r"listening on (\\S+):(\\d+)", timeout=120)
    ...
    stop_service(proc)

Or, as a context manager that always stops the service:

    with running_service(cmd, env, pattern, timeout) as (proc, match): ...

Each service runs in its own process group, so stopping it also stops anything it spawned.
Output is drained by background threads (a chatty child never blocks on a full pipe) and the
tail of it is kept for error messages: a service that exits or never gets ready fails the test
with its command and its last output lines.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

_TAIL_LINES = 200
_LIVE: set[subprocess.Popen] = set()


class ServiceError(RuntimeError):
    """A service exited or did not print its ready line in time."""


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def output_tail(proc: subprocess.Popen) -> str:
    """The last lines the service wrote (stdout and stderr interleaved, stderr marked)."""
    tail = getattr(proc, "_tail", None)
    return "".join(tail) if tail else ""


def _drain(stream, name: str, lines: queue.Queue, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line if name == "stdout" else f"[stderr] {line}")
        lines.put(line)
    stream.close()


def start_service(
    cmd: list[str],
    env: dict[str, str | None] | None,
    ready_pattern: str | re.Pattern[str] | None,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[subprocess.Popen, re.Match[str] | None]:
    """Start `cmd` and return once a line of its output matches `ready_pattern`.

    `env` is applied on top of os.environ (None: inherit as is; a None value unsets the
    variable). Both stdout and stderr are searched; `ready_pattern=None` returns at once (the
    caller waits its own way, e.g. for a health check). Raises ServiceError (after killing the
    process group) when the process exits or `timeout` seconds pass first; the message holds the
    command and its last output lines.
    """
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(
        cmd,
        env=full_env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        start_new_session=True,  # its own process group: stop_service kills children too
    )
    _LIVE.add(proc)
    lines: queue.Queue[str] = queue.Queue()
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    proc._tail = tail  # type: ignore[attr-defined]
    for name in ("stdout", "stderr"):
        threading.Thread(
            target=_drain, args=(getattr(proc, name), name, lines, tail), daemon=True
        ).start()
    if ready_pattern is None:
        return proc, None
    pattern = re.compile(ready_pattern) if isinstance(ready_pattern, str) else ready_pattern

    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stop_service(proc)
            raise ServiceError(_failure(cmd, f"not ready after {timeout:.0f}s", proc))
        try:
            line = lines.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                time.sleep(0.1)  # let the drain threads pick up the last words
                stop_service(proc)
                raise ServiceError(
                    _failure(cmd, f"exited with code {proc.returncode} before ready", proc)
                ) from None
            continue
        match = pattern.search(line)
        if match:
            return proc, match


def stop_service(proc: subprocess.Popen, grace: float = 10.0) -> int | None:
    """SIGTERM the service's process group, SIGKILL it after `grace` seconds; return its code."""
    _LIVE.discard(proc)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=grace)
    # Children that outlived the leader (same group) go too.
    _signal_group(proc, signal.SIGKILL)
    return proc.returncode


@contextlib.contextmanager
def running_service(
    cmd: list[str],
    env: dict[str, str | None] | None,
    ready_pattern: str | re.Pattern[str] | None,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
) -> Iterator[tuple[subprocess.Popen, re.Match[str] | None]]:
    """start_service as a context manager that always stops the service."""
    proc, match = start_service(cmd, env, ready_pattern, timeout, cwd=cwd)
    try:
        yield proc, match
    finally:
        stop_service(proc)


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    """Poll `predicate()` until it is truthy; raise TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _failure(cmd: list[str], what: str, proc: subprocess.Popen) -> str:
    return f"{' '.join(cmd)}: {what}\n--- last output ---\n{output_tail(proc)}"


@atexit.register
def _stop_leftovers() -> None:
    for proc in list(_LIVE):
        stop_service(proc, grace=2.0)
