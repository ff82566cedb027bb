"""The remote drafter's bare round trip: one delta message on the stream (or a unary call) and
its drafts back, from the target's `RemoteDrafter` to a drafter service in another process on
loopback — the part of a drafting step that no look-ahead hides. Host-only: no model, no GPU.

Side by side in one run: the n-gram drafter run on the service's event loop (`cheap`, the
default for n-gram) and the same drafter run on a worker thread (`ThreadedNGram` below, loaded
through the service's `module:Class` seam), for each --modes and each --batches (sequences per
message). Each sequence commits one token per step; the first --warmup steps are not timed.

`--busy-threads N` runs N pure-Python threads in the pinging process for every measurement
(with the target's 0.5 ms GIL switch interval), as a loaded target's gRPC loop and output
thread are: every thread that must take the GIL back on the way from the reply to the caller
then waits for it. `unary-future` is the round-6 unary exchange (a call future the caller
waits on, completed by gRPC's channel thread), kept here to compare with today's blocking call.

`--submit-host-ms H` (e.g. 0.6) measures the other way a target asks instead: the submit path
(`RemoteDrafter.submit`, sent the moment a step commits, not waited for). The caller sends,
then goes on with H ms of pure Python (the next step's host work) and `--submit-gpu-ms` without
the GIL (waiting for the device), then takes what arrived: the round trip is the time from
sending to the reply's arrival (its reader or callback thread's clock), and "late" counts the
replies not back by the end of that step, which serve a step later. Here the caller's own
thread is the busy one, as a target's executor is between a step's commit and its next wait.

    python bench/drafter_ping.py [--steps 600] [--batches 1,8,32] \
        [--modes stream,relay,socket,socket-spin,unary] [--busy-threads 0,1] \
        [--submit-host-ms 0.3,0.6 --submit-gpu-ms 0.8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from procs import free_port, start_service, stop_service  # noqa: E402

from specwire.common.drafters.ngram import NGramDrafter  # noqa: E402
from specwire.target_service.drafters.remote import RemoteDrafter  # noqa: E402
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig  # noqa: E402
from specwire.target_service.request import Request, RequestState  # noqa: E402
from specwire.target_service.resources.base import ResourceRegistry  # noqa: E402


class ThreadedNGram(NGramDrafter):
    """The n-gram drafter, drafted on the service's worker threads like any costly drafter."""

    cheap = False


DRAFTERS = {"ngram (event loop)": "ngram", "ngram (worker thread)": "drafter_ping:ThreadedNGram"}


class FutureUnary(RemoteDrafter):
    """Round 6's unary exchange: a call future, waited on by the caller."""

    def _exchange_unary(self, msg):
        deadline_s = self.config.deadline_ms / 1000
        future = self.connection.stub.Draft.future(msg, timeout=deadline_s)
        return self._unary_reply(future, deadline_s + 0.05)


class Busy:
    """N threads running pure Python until stopped (a loaded target's other threads)."""

    def __init__(self, n: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(n)]

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i * i

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def ping(
    address: str, mode: str, batch: int, steps: int, warmup: int, sock: str = ""
) -> list[float]:
    """Seconds per `prepare_draft_tokens` (one message and its reply), after the warm-up;
    `sock`: the service's unix socket (socket mode)."""
    cls = FutureUnary if mode == "unary-future" else RemoteDrafter
    carrier = mode.removesuffix("-future").removesuffix("-spin")
    config = RemoteDrafterConfig(
        address,
        mode=carrier,
        deadline_ms=1000,
        connect_timeout_s=30,
        socket=sock if carrier == "socket" else "",
        spin_ms=20.0 if mode == "socket-spin" else 0.0,  # both ends poll (--drafter-spin-ms)
        startup_wait_s=30,
    )
    d = cls(config, 4, 50_000, "fp", lookahead=0)
    res = ResourceRegistry()
    res.add(d.spec_resource_manager)
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", list(range(100 + i, 400 + i)), max_new_tokens=10**6, max_draft_len=4)
        r.state, r.step_draft_cap = RequestState.DECODE, 4
        reqs.append(r)
    times = []
    try:
        for step in range(warmup + steps):
            for r in reqs:
                r.output_ids.append(7 + step % 50)
            t0 = time.perf_counter()
            d.prepare_draft_tokens(reqs, res)
            times.append(time.perf_counter() - t0)
        late = d.counters()["late"] + d.counters()["failed"]
        if late:
            raise SystemExit(f"{late} steps went without a reply: not a round-trip measurement")
    finally:
        d.close()
    return times[warmup:]


def busy_for(seconds: float, release_s: float = 0.0) -> None:
    """Python work for `seconds`: with `release_s`, the GIL is given up and taken back every
    `release_s` (as a CUDA call does: an event record, a copy, a graph replay); otherwise
    only when the interpreter forces it (pure Python)."""
    now = time.perf_counter()
    end, release_at = now + seconds, now + release_s
    x = 0
    while (now := time.perf_counter()) < end:
        x += 1
        if release_s and now >= release_at:
            time.sleep(0)
            release_at = now + release_s


def submit_ping(
    address: str,
    mode: str,
    batch: int,
    host_ms: float,
    gpu_ms: float,
    steps: int,
    warmup: int,
    release_us: float = 0.0,
) -> tuple[list[float], int]:
    """(seconds from each `submit` to its reply's arrival, replies not back by the end of the
    step after it) — see the module docstring. Reads the drafter's prefetch bookkeeping
    (`_prefetch`, `_take_answered`): a benchmark of that path, not an API."""
    config = RemoteDrafterConfig(
        address, mode=mode, deadline_ms=1000, connect_timeout_s=30, startup_wait_s=30
    )
    d = RemoteDrafter(config, 4, 50_000, "fp", lookahead=20)
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", list(range(100 + i, 400 + i)), max_new_tokens=10**6, max_draft_len=4)
        r.state, r.step_draft_cap = RequestState.DECODE, 4
        reqs.append(r)
    times, late = [], 0
    try:
        for step in range(warmup + steps):
            for r in reqs:
                r.output_ids.append(7 + step % 50)
            d.submit(reqs)
            pre = d._prefetch
            busy_for(host_ms / 1000, release_us / 1e6)  # the next step's host work
            time.sleep(gpu_ms / 1000)  # its device time: the GIL is free
            d._take_answered()
            if pre is None:
                raise SystemExit("submit sent nothing: not a round-trip measurement")
            if step >= warmup:
                if d._prefetch is pre:
                    late += 1
                else:
                    at = pre.answered_at if pre.future is not None else d.connection.reply_at
                    times.append(at - pre.since)
            t0 = time.perf_counter()  # let a late reply in before the next step sends
            while d._prefetch is not None and time.perf_counter() - t0 < 1.0:
                time.sleep(2e-4)
                d._take_answered()
    finally:
        d.close()
    return times, late


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--modes",
        default="stream,unary",
        help="stream, relay, socket, socket-spin (both ends polling), unary, unary-future",
    )
    ap.add_argument("--busy-threads", default="0", help="e.g. 0,1: busy Python threads")
    ap.add_argument(
        "--submit-host-ms", default="", help="e.g. 0.3,0.6: the submit path instead (see above)"
    )
    ap.add_argument("--submit-gpu-ms", type=float, default=0.8, help="with --submit-host-ms")
    ap.add_argument("--rounds", type=int, default=3, help="with --submit-host-ms")
    ap.add_argument(
        "--submit-release-us",
        default="0",
        help="with --submit-host-ms, e.g. 0,50: the host work gives the GIL up every N µs"
        " (as every CUDA call does; 0: pure Python)",
    )
    args = ap.parse_args()
    sys.setswitchinterval(5e-4)  # as `specwire target` sets it
    # Keep the caller's PYTHONPATH (on the device the wheels are staged there).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench"), *inherited])}
    print(f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    if args.submit_host_ms:
        return submit_main(args, env)
    print("| drafter | busy threads | mode | sequences | round trip p50 ms | p90 ms |")
    print("|---|---|---|---|---|---|")
    for label, spec in DRAFTERS.items():
        port = free_port()
        cmd = [sys.executable, "-m", "specwire.common.cli", "drafter", "--host", "127.0.0.1"]
        sock = f"{tempfile.mkdtemp(prefix='specwire-')}/drafter.sock"
        cmd += ["--port", str(port), "--drafter", spec, "--socket", sock]
        proc, _ = start_service(cmd, env, "listening", timeout=120, cwd=ROOT)
        try:
            cases = [
                (int(n), mode, int(b))
                for n in args.busy_threads.split(",")
                for mode in args.modes.split(",")
                for b in args.batches.split(",")
            ]
            for busy, mode, batch in cases:
                with Busy(busy):
                    t = ping(f"127.0.0.1:{port}", mode, batch, args.steps, args.warmup, sock)
                    t.sort()
                p90 = t[int(0.9 * len(t))]
                print(
                    f"| {label} | {busy} | {mode} | {batch} | {statistics.median(t) * 1e3:.3f} | "
                    f"{p90 * 1e3:.3f} |",
                    flush=True,
                )
        finally:
            stop_service(proc)
    return 0


def submit_main(args: argparse.Namespace, env: dict[str, str]) -> int:
    """The submit-path table: the n-gram drafter on the service's loop, each (host ms, mode,
    sequences) once per round, rounds interleaved so that a slow spell hits every mode."""
    port = free_port()
    cmd = [sys.executable, "-m", "specwire.common.cli", "drafter", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--drafter", "ngram"]
    proc, _ = start_service(cmd, env, "listening", timeout=120, cwd=ROOT)
    print(f"submit path; device wait {args.submit_gpu_ms} ms a step; {args.rounds} rounds\n")
    print("| round | host ms | GIL given up every µs | mode | sequences | round trip p50 ms |"
          " p90 ms | late |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    cases = [
        (float(h), float(r), mode, int(b))
        for h in args.submit_host_ms.split(",")
        for r in args.submit_release_us.split(",")
        for mode in args.modes.split(",")
        for b in args.batches.split(",")
    ]
    try:
        for rnd in range(args.rounds):
            for host, release, mode, batch in cases:
                t, late = submit_ping(
                    f"127.0.0.1:{port}", mode, batch, host, args.submit_gpu_ms,
                    args.steps, args.warmup, release,
                )  # fmt: skip
                t.sort()
                p50, p90 = statistics.median(t) * 1e3, t[int(0.9 * len(t))] * 1e3
                print(
                    f"| {rnd} | {host} | {release:g} | {mode} | {batch} | {p50:.3f} | "
                    f"{p90:.3f} | {late} of {args.steps} |",
                    flush=True,
                )
    finally:
        stop_service(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
