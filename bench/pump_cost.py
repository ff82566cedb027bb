"""The remote drafter's wire work on the target, alone, with warm caches and with cold ones.

Per step the target builds and sends a question (`RemoteSessions.write_updates`, the message's
serialisation, `FramedCall.send`) and takes the reply (`FramedCall.replies`,
`DraftStreamResponse.FromString`, `read_reply`, `RemoteSessions.apply`), each on the critical
path of a drafting step. This times exactly those calls, over a real unix socket pair, for R
rows whose drafter replies with a look-ahead's worth of tokens each (as the n-gram drafter
service does), without branches (the target asks for them up to 8 rows, and they come in a
second reply, read while the device runs: not timed here), in a tight loop and with
`--evict-mb` MB of memory copied before each timed part: in the engine, the work between two
steps (torch's launch path, the output thread, the scheduler) leaves the caches cold for it.
Round 46 used this to find out why the reply pump costs 31 us a call in the engine on an H100
host against 5-11 us alone (bench/RESULTS.md).

    python bench/pump_cost.py --rows 1,8,32 --evict-mb 0,8
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specwire.common.frames import QUESTION, reply_frame  # noqa: E402
from specwire.common.protogen import drafter_pb2  # noqa: E402
from specwire.target_service.drafters.remote_frames import FramedCall  # noqa: E402
from specwire.target_service.drafters.remote_sessions import (  # noqa: E402
    RemoteSessions,
    read_reply,
)
from specwire.target_service.request import Request  # noqa: E402


def _reply(step: int, sent: dict, tokens: int) -> bytes:
    """The drafter's reply frame to the question `sent` describes: `tokens` drafts each."""
    msg = drafter_pb2.DraftStreamResponse(step=step)
    for i, (rid, (n, _)) in enumerate(sent.items()):
        msg.drafts.add(
            request_id=rid, base_len=n, tokens=[(i * 7 + j) % 49152 for j in range(tokens)]
        )
    return reply_frame(msg.SerializeToString(), time.monotonic())


def run(
    rows: int, evict_mb: int, iters: int, k: int, lookahead: int, prewarm: bool = False
) -> tuple[float, float]:
    """Median microseconds of (question, reply) over `iters` steps. `prewarm`: after the
    eviction, the question's code runs once on throwaway state and the last reply is parsed
    again, before the timed calls (what a target could do in the device's shadow; round 48:
    it saves ~7 of 29 us of the question at 8 rows and nothing of the reply)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    call = FramedCall(ours.fileno(), ours.fileno())
    sessions, scratch = RemoteSessions(), RemoteSessions()
    last = None  # the last reply's payload (`prewarm`)
    reqs = [
        Request(f"req-{i:08d}-{'x' * 24}", list(range(100 + i, 400 + i)), max_new_tokens=1 << 20)
        for i in range(rows)
    ]
    junk, src = bytearray(evict_mb << 20), bytes(evict_mb << 20)
    asks = [(r, k + lookahead) for r in reqs]
    q_us, r_us = [], []
    for step in range(1, iters + 1):
        for r in reqs:  # what a step commits: a draft accepted and the bonus token
            r.output_ids += [step % 1000, (step * 3) % 1000]
        if evict_mb:
            junk[:] = src
        if prewarm:
            scratch.synced = dict(sessions.synced)
            throwaway = drafter_pb2.DraftStreamRequest(step=step)
            scratch.write_updates(throwaway, asks, 0)
            throwaway.SerializeToString()
            if last is not None:
                read_reply(drafter_pb2.DraftStreamResponse.FromString(last))
        t0 = time.perf_counter_ns()
        msg = drafter_pb2.DraftStreamRequest(step=step)
        sent = sessions.write_updates(msg, asks, 0)
        call.send(msg)
        q_us.append((time.perf_counter_ns() - t0) / 1000)
        got = theirs.recv(1 << 20)  # the whole question (a loopback socket: one read)
        assert QUESTION.unpack_from(got)[0] == len(got) - QUESTION.size
        theirs.sendall(_reply(step, sent, k + lookahead))
        if evict_mb:
            junk[:] = src
        t0 = time.perf_counter_ns()
        frames = call.replies()
        for payload, _at in frames:
            last = payload
            reply = read_reply(drafter_pb2.DraftStreamResponse.FromString(payload))
            refused = sessions.apply(reply, sent)
        r_us.append((time.perf_counter_ns() - t0) / 1000)
        assert len(frames) == 1 and not refused and len(sessions.runs) == rows
    ours.close()
    theirs.close()
    return statistics.median(q_us), statistics.median(r_us)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32", help="rows a question carries")
    ap.add_argument("--evict-mb", default="0,8", help="MB copied before each timed part")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--max-draft-len", type=int, default=8)
    ap.add_argument("--lookahead", type=int, default=36, help="auto: 4 (K + 1) at K = 8")
    ap.add_argument("--prewarm", action="store_true", help="each step also prewarmed (`run`)")
    args = ap.parse_args()
    print("| rows | evict MB | prewarmed | question us (p50) | reply us (p50) |")
    print("|---|---|---|---|---|")
    for rows in (int(x) for x in args.rows.split(",")):
        for mb in (int(x) for x in args.evict_mb.split(",")):
            for warm in (False, True) if args.prewarm else (False,):
                q, r = run(rows, mb, args.iters, args.max_draft_len, args.lookahead, warm)
                print(f"| {rows} | {mb} | {warm} | {q:.1f} | {r:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
