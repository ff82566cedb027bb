"""Soak test: many concurrent streams against one real target for N minutes; does it leak?

One fresh `specwire target` (bench/servers.py, same target flags as bench/serving.py) gets
--streams client threads, each sending requests back to back for --minutes, a mix of:

- normal:    greedy, --max-new-tokens
- sampled:   random temperature / top-k / top-p / seed, sometimes speculation off
- cancelled: the client cancels the stream after 1..--cancel-after chunks

Every --interval seconds it records the target's RSS (psutil if installed, else VmRSS from
/proc/PID/status), GetModelInfo.kv_blocks_free and the requests completed / errored / cancelled
so far. At the end it stops sending, waits for the target to go idle and prints start and end
RSS and free KV blocks. The free KV blocks must return to the start value (exit status 1 if not,
or if any request errored).

    python bench/soak.py --model tiny-random --minutes 2 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from prompt_pool import build_pool  # noqa: E402
from servers import CONFIGS, add_target_flags, running_config  # noqa: E402
from serving import environment  # noqa: E402

from specwire.common.client import FINISH_NAMES, build_request  # noqa: E402
from specwire.common.protogen import generation_pb2 as pb  # noqa: E402
from specwire.common.protogen import generation_pb2_grpc as pb_grpc  # noqa: E402

MIX = ("normal", "sampled", "cancelled")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss_mib(pid: int) -> float:
    """Resident set size of process `pid` in MiB."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
        raise RuntimeError(f"no VmRSS for pid {pid}") from None


class Tally:
    """Request outcomes across all stream threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # completed / errored / cancelled, and by kind
        self.finish: Counter[str] = Counter()
        self.errors: list[str] = []

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{kind}:{outcome}"] += 1
            if outcome == "completed":
                self.finish[detail] += 1
            elif outcome == "errored" and len(self.errors) < 20:
                self.errors.append(detail)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: self.counts[k] for k in ("completed", "errored", "cancelled")}


def one_request(stub, prompt, kind: str, rng: random.Random, args, tally: Tally) -> None:
    kw: dict = dict(max_new_tokens=rng.randint(1, args.max_new_tokens), ignore_eos=True)
    if kind == "sampled":
        kw.update(
            temperature=rng.uniform(0.1, 1.5),
            top_k=rng.choice([0, 1, 20, 200]),
            top_p=rng.uniform(0.3, 1.0),
            seed=rng.randrange(2**32),
            speculate=rng.random() < 0.8,
        )
    if rng.random() < 0.5:
        req = build_request(chat=[{"role": "user", "content": prompt.text}], **kw)
    else:
        req = build_request(prompt.text, **kw)
    cancel_after = rng.randint(1, args.cancel_after) if kind == "cancelled" else None
    call = stub.Generate(req, timeout=args.request_timeout)
    chunks = 0
    try:
        for resp in call:
            which = resp.WhichOneof("response")
            if which == "chunk":
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
                    tally.add(kind, "cancelled")
                    return
            elif which == "complete":
                tally.add(kind, "completed", FINISH_NAMES.get(resp.complete.finish_reason, "?"))
                return
            else:
                tally.add(kind, "errored", f"{resp.error.code}: {resp.error.message}")
                return
        tally.add(kind, "errored", "stream ended without a completion")
    except grpc.RpcError as exc:
        tally.add(kind, "errored", f"{exc.code().name}: {exc.details()}")


def stream_worker(i: int, stub, pool, args, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(args.seed * 100_003 + i)
    weights = (1 - args.sampled_share - args.cancel_share, args.sampled_share, args.cancel_share)
    while not stop.is_set():
        kind = rng.choices(MIX, weights)[0]
        one_request(stub, rng.choice(pool), kind, rng, args, tally)


def table(rows: list[dict]) -> str:
    lines = [
        "| when | t s | target RSS MiB | KV free blocks | completed | errored | cancelled |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['when']} | {r['t_s']:.0f} | {r['rss_mib']:.1f} | {r['kv_free']} | "
            f"{r['completed']} | {r['errored']} | {r['cancelled']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_flags(ap)
    ap.add_argument("--config", default="ngram", choices=list(CONFIGS))
    ap.add_argument("--streams", type=int, default=64, help="concurrent client streams")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="each request: 1..this")
    ap.add_argument("--sampled-share", type=float, default=0.3)
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--cancel-after", type=int, default=5, help="cancel after 1..this chunks")
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="wait for idle at the end")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    if not 0 <= args.sampled_share + args.cancel_share <= 1:
        ap.error("--sampled-share + --cancel-share must be within [0, 1]")

    pool, source = build_pool(chat=True)
    env = environment(args)
    tally = Tally()
    rows: list[dict] = []
    with running_config(args.config, args) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.GenerationServiceStub(channel)

        def sample(when: str, t0: float) -> dict:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            row = dict(when=when, t_s=time.monotonic() - t0, rss_mib=rss_mib(server.pid))
            row.update(kv_free=info.kv_blocks_free, kv_total=info.kv_blocks_total)
            row.update(tally.snapshot())
            rows.append(row)
            log(
                f"{when}: t={row['t_s']:.0f}s rss={row['rss_mib']:.1f} MiB kv_free="
                f"{row['kv_free']}/{row['kv_total']} completed={row['completed']} "
                f"errored={row['errored']} cancelled={row['cancelled']}"
            )
            return row

        t0 = time.monotonic()
        start = sample("start (idle)", t0)
        stop = threading.Event()
        threads = [
            threading.Thread(target=stream_worker, args=(i, stub, pool, args, stop, tally))
            for i in range(args.streams)
        ]
        for t in threads:
            t.start()
        end_at = t0 + 60 * args.minutes
        while not stop.wait(max(0.0, min(args.interval, end_at - time.monotonic()))):
            if time.monotonic() >= end_at:
                stop.set()
            else:
                sample("load", t0)
        log("stopping the streams; each finishes its current request")
        for t in threads:
            t.join(timeout=args.request_timeout)
        deadline = time.monotonic() + args.idle_timeout
        while True:  # the last cancellations are processed by the executor asynchronously
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            if info.kv_blocks_free == start["kv_free"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        end = sample("end (idle)", t0)
        channel.close()

    returned = end["kv_free"] == start["kv_free"]
    errored = tally.counts["errored"]
    md = table(rows) + (
        f"\nKV free blocks: start {start['kv_free']}, end {end['kv_free']} "
        f"(of {start['kv_total']}): {'returned' if returned else 'NOT RETURNED'}. RSS: start "
        f"{start['rss_mib']:.1f} MiB, end {end['rss_mib']:.1f} MiB "
        f"({end['rss_mib'] - start['rss_mib']:+.1f}). Requests by kind: "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.counts.items()) if ":" in k)
        + f". Finish reasons: {dict(tally.finish)}.\n"
    )
    print("\n" + md, flush=True)
    report = dict(
        env=env,
        args=vars(args),
        prompt_source=source,
        commands=server.commands,
        samples=rows,
        kv_returned=returned,
        counts=dict(tally.counts),
        finish_reasons=dict(tally.finish),
        error_samples=tally.errors,
        markdown=md,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    return 0 if returned and not errored else 1


if __name__ == "__main__":
    sys.exit(main())
