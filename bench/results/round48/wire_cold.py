"""Round 48, measured and not built: two ways to cut the remote drafter's per-step wire work
on the target, with the caches cold (8 MB copied before each timed call, as in
bench/pump_cost.py).

1. `encoding`: a question and a reply as flat int32 arrays (`array.array`, no protobuf, request
   slots instead of ids) against protobuf's `sequences.add(...)` + `SerializeToString()` and
   `FromString()` + reading the fields a step reads.
2. bench/pump_cost.py's question and reply, with its `prewarm`: the same code run once on
   throwaway data between the eviction and the timed call (what a target could do in the
   device's shadow, just before the commit).

    python bench/results/round48/wire_cold.py
"""

from __future__ import annotations

import statistics
import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from pump_cost import run  # noqa: E402

from specwire.common.protogen import drafter_pb2  # noqa: E402

ROWS, K, LOOKAHEAD = 8, 8, 36
JUNK, SRC = bytearray(8 << 20), bytes(8 << 20)


def _median_us(fn, evict: bool, iters: int = 1500) -> float:
    times = []
    for _ in range(iters):
        if evict:
            JUNK[:] = SRC
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(times)


def encoding() -> None:
    ids = [f"req-{i:08d}-{'x' * 24}" for i in range(ROWS)]
    news = [[(i * 31 + j) % 49152 for j in range(2 + i % 8)] for i in range(ROWS)]
    toks = [[(i * 7 + j) % 49152 for j in range(K + LOOKAHEAD)] for i in range(ROWS)]
    reply = drafter_pb2.DraftStreamResponse(step=5)
    flat = array("i", (5, ROWS))
    for i in range(ROWS):
        reply.drafts.add(request_id=ids[i], base_len=300 + i, tokens=toks[i])
        flat.extend((i, 300 + i, len(toks[i])))
        flat.extend(toks[i])
    pb_reply, flat_reply = reply.SerializeToString(), flat.tobytes()

    def pb_question() -> bytes:
        msg = drafter_pb2.DraftStreamRequest(step=3)
        add = msg.sequences.add
        for i in range(ROWS):
            add(request_id=ids[i], base_len=300 + i, new_tokens=news[i], max_draft_tokens=44,
                max_branches=4, branch_positions=2)  # fmt: skip
        return msg.SerializeToString()

    def flat_question() -> bytes:
        out = array("i", (3, ROWS))
        for i in range(ROWS):
            out.extend((i, 300 + i, len(news[i]), 44, 4, 2))
            out.extend(news[i])
        return out.tobytes()

    def pb_read() -> list:
        msg = drafter_pb2.DraftStreamResponse.FromString(pb_reply)
        return [(d.request_id, d.base_len, d.resync, d.tokens[: K + 1]) for d in msg.drafts]

    def flat_read() -> list:
        v = memoryview(flat_reply).cast("i").tolist()
        at, out = 2, []
        for _ in range(v[1]):
            slot, base, n = v[at : at + 3]
            out.append((slot, base, False, v[at + 3 : at + 3 + K + 1]))
            at += 3 + n
        return out

    print("| 8 rows | warm us | cold us |\n|---|---|---|")
    for name, fn in (
        ("protobuf question", pb_question),
        ("flat question", flat_question),
        ("protobuf reply", pb_read),
        ("flat reply", flat_read),
    ):
        print(f"| {name} | {_median_us(fn, False):.1f} | {_median_us(fn, True):.1f} |")


def main() -> int:
    encoding()
    print("\n| rows | caches | question us | reply us |\n|---|---|---|---|")
    for rows in (1, 8):
        for label, evict, warm in (("warm", False, False), ("cold", True, False),
                                   ("cold, prewarmed", True, True)):  # fmt: skip
            q, r = run(rows, 8 if evict else 0, 1500, K, LOOKAHEAD, prewarm=warm)
            print(f"| {rows} | {label} | {q:.1f} | {r:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
