"""The remote drafter's bare round trip: one delta message on the stream (or a unary call) and
its drafts back, from the target's `RemoteDrafter` to a drafter service in another process on
loopback — the part of a drafting step that no look-ahead hides. Host-only: no model, no GPU.

Side by side in one run: the n-gram drafter run on the service's event loop (`cheap`, the
default for n-gram) and the same drafter run on a worker thread (`ThreadedNGram` below, loaded
through the service's `module:Class` seam), for each --modes and each --batches (sequences per
message). Each sequence commits one token per step; the first --warmup steps are not timed.

    python bench/drafter_ping.py [--steps 600] [--batches 1,8,32] [--modes stream,unary]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from procs import free_port, start_service, stop_service  # noqa: E402

from specwire.common.drafters.ngram import NGramDrafter  # noqa: E402
from specwire.target_service.drafters.remote import RemoteDrafter  # noqa: E402
from specwire.target_service.request import Request, RequestState  # noqa: E402
from specwire.target_service.resources.base import ResourceRegistry  # noqa: E402


class ThreadedNGram(NGramDrafter):
    """The n-gram drafter, drafted on the service's worker threads like any costly drafter."""

    cheap = False


DRAFTERS = {"ngram (event loop)": "ngram", "ngram (worker thread)": "drafter_ping:ThreadedNGram"}


def ping(address: str, mode: str, batch: int, steps: int, warmup: int) -> list[float]:
    """Seconds per `prepare_draft_tokens` (one message and its reply), after the warm-up."""
    d = RemoteDrafter(
        address, 4, 50_000, "fp", mode=mode, deadline_ms=1000, lookahead=0, connect_timeout_s=30
    )
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--modes", default="stream,unary")
    args = ap.parse_args()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
    print(f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print("| drafter | mode | sequences | round trip p50 ms | p90 ms |")
    print("|---|---|---|---|---|")
    for label, spec in DRAFTERS.items():
        port = free_port()
        cmd = [sys.executable, "-m", "specwire.common.cli", "drafter", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--drafter", spec]
        proc, _ = start_service(cmd, env, "listening", timeout=120, cwd=ROOT)
        try:
            for mode in args.modes.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    t = sorted(ping(f"127.0.0.1:{port}", mode, batch, args.steps, args.warmup))
                    p90 = t[int(0.9 * len(t))]
                    print(
                        f"| {label} | {mode} | {batch} | {statistics.median(t) * 1e3:.3f} | "
                        f"{p90 * 1e3:.3f} |",
                        flush=True,
                    )
        finally:
            stop_service(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
