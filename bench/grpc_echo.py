"""The bare Python gRPC round trip, with no specwire code: a bidi stream echoing 64 bytes, over
loopback TCP and over a unix-domain socket, side by side. It bounds what any remote drafter
over Python gRPC can reach (bench/RESULTS.md, rounds 19-20). Host-only.

    python bench/grpc_echo.py [--steps 2000] [--warmup 200] [--transports tcp,unix]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from procs import free_port  # noqa: E402

METHOD = "/echo.Echo/Stream"


def _echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


def _serve(address: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    return server


def round_trips(target: str, steps: int, warmup: int) -> list[float]:
    """Seconds per message: sent on the stream -> its echo read back."""
    outbox: queue.Queue[bytes | None] = queue.Queue()

    def messages() -> Iterator[bytes]:
        while (m := outbox.get()) is not None:
            yield m

    with grpc.insecure_channel(target) as channel:
        replies = channel.stream_stream(METHOD)(messages())
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outbox.put(b"x" * 64)
            next(replies)
            times.append(time.perf_counter() - t0)
        outbox.put(None)
    return times[warmup:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--transports", default="tcp,unix")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    print("| transport | median ms | mean ms | p90 ms |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for transport in args.transports.split(","):
            if transport == "tcp":
                address = f"127.0.0.1:{free_port()}"
                target = address
            elif transport == "unix":
                address = target = f"unix:{os.path.join(tmp, 'echo.sock')}"
            else:
                ap.error(f"unknown transport {transport!r}: use tcp, unix")
            server = _serve(address)
            try:
                t = sorted(round_trips(target, args.steps, args.warmup))
            finally:
                server.stop(None)
            p90 = t[int(0.9 * (len(t) - 1))]
            print(
                f"| {transport} | {statistics.median(t) * 1e3:.3f} | "
                f"{statistics.mean(t) * 1e3:.3f} | {p90 * 1e3:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
