"""Would a relay process take the remote drafter's gRPC work off the target's GIL? A 200-byte
bidi echo (a `grpc.aio` server in its own process, as the drafter service is) asked the way
the executor asks: send, then H ms of host work that gives the GIL up every 50 us (as CUDA
calls do), then wait for the reply. Two clients side by side:

- `direct`: the target's own stream (`DraftStreamCall`'s shape: a queue feeding the request
  iterator, a reader thread), in the asking process;
- `relay`: the asking process writes length-prefixed frames to a child process's pipe and
  reads its replies from another; the child owns the stream and its threads, so the asking
  process runs no gRPC thread at all.

Prints the step (send -> reply in hand) and the wait left after the host work. Host-only
(bench/RESULTS.md, round 27). Kept for that record: the relay built since is
`--drafter-mode relay` (specwire/target_service/drafters/remote_relay.py), and
`bench/drafter_ping.py --modes stream,relay` measures it against a real drafter service.

    python bench/grpc_relay.py [--host-ms 0,0.3,0.6] [--steps 800] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from procs import free_port  # noqa: E402

METHOD = "/echo.Echo/Stream"
_LEN = struct.Struct("<I")


async def _serve(port: int) -> None:
    async def echo(requests, context):
        async for r in requests:
            yield r

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class Direct:
    """The stream in this process: a queue feeds the request iterator, a reader thread."""

    def __init__(self, target: str) -> None:
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._in: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._channel = grpc.insecure_channel(target)
        replies = self._channel.stream_stream(METHOD)(self._requests())
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _requests(self) -> Iterator[bytes]:
        while (m := self._out.get()) is not None:
            yield m

    def _read(self, replies) -> None:
        try:
            for r in replies:
                self._in.put(r)
        except grpc.RpcError:
            pass

    def send(self, msg: bytes) -> None:
        self._out.put(msg)

    def recv(self) -> bytes:
        return self._in.get()

    def close(self) -> None:
        self._out.put(None)
        self._channel.close()


def _relay_child(target: str) -> None:
    """The relay: frames on stdin -> the stream -> frames on stdout."""
    out = Direct(target)

    def back() -> None:
        while True:
            r = out.recv()
            os.write(1, _LEN.pack(len(r)) + r)

    threading.Thread(target=back, daemon=True).start()
    stdin = os.fdopen(0, "rb", buffering=0)
    while len(head := stdin.read(4)) == 4:
        out.send(stdin.read(_LEN.unpack(head)[0]))


class Relay:
    """The stream in a child process, reached through two pipes (no thread here)."""

    def __init__(self, target: str) -> None:
        cmd = [sys.executable, __file__, "--relay-child", target]
        self._p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def send(self, msg: bytes) -> None:
        os.write(self._p.stdin.fileno(), _LEN.pack(len(msg)) + msg)

    def recv(self) -> bytes:
        fd = self._p.stdout.fileno()
        return os.read(fd, _LEN.unpack(os.read(fd, 4))[0])

    def close(self) -> None:
        self._p.kill()
        self._p.wait()


def host_work(seconds: float, release_s: float = 50e-6) -> None:
    """Pure Python for `seconds`, giving the GIL up every `release_s` (as CUDA calls do)."""
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        stop = min(end, now + release_s)
        while time.perf_counter() < stop:
            pass
        time.sleep(0)


def run(client, host_s: float, steps: int, warmup: int = 50) -> tuple[float, float]:
    """Median ms of a step (send -> host work -> reply in hand), mean ms waited after it."""
    msg = b"x" * 200
    for _ in range(warmup):
        client.send(msg)
        client.recv()
    step, wait = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        client.send(msg)
        host_work(host_s)
        t1 = time.perf_counter()
        client.recv()
        t2 = time.perf_counter()
        step.append(t2 - t0)
        wait.append(t2 - t1)
    return statistics.median(step) * 1e3, statistics.mean(wait) * 1e3


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--relay-child":
        _relay_child(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-ms", default="0,0.3,0.6")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.setswitchinterval(5e-4)  # as `specwire target` sets it
    port = free_port()
    code = f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += f"import grpc_relay; asyncio.run(grpc_relay._serve({port}))"
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.5)
        print("| host ms | client | step p50 ms | wait after host, mean ms |\n|---|---|---|---|")
        for host_ms in (float(x) for x in args.host_ms.split(",")):
            for _ in range(args.rounds):
                for name, kind in (("direct", Direct), ("relay", Relay)):
                    client = kind(f"127.0.0.1:{port}")
                    try:
                        step, wait = run(client, host_ms / 1e3, args.steps)
                    finally:
                        client.close()
                    print(f"| {host_ms:g} | {name} | {step:.3f} | {wait:.3f} |", flush=True)
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
