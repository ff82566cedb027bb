"""What branches cost per drafter message, on each side, in Python (no gRPC transport):

- drafter: `DraftEngine.draft` (the n-gram proposal, plus `alternatives` when asked) and the
  reply's protobuf built and serialised (`response_to_proto`);
- target: the reply parsed and every proposal kept (`RemoteSessions.keep`; branches are kept as
  the protobuf came and read only when a step leaves the proposal).

The sequences are real greedy outputs saved by `bench/branch_replay.py --save-outputs F`
(prompt + output, ~1,000 tokens each); every message asks each of `--rows` sequences for
K + look-ahead = 9 tokens, and, with branches, 4 alternatives at the first `--positions`.
Prints each side's time with branches ÷ without, measured back to back in one process.

    python bench/branch_cost.py --outputs F [--rows 1,8,32] [--positions 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from specwire.common.drafters.ngram import NGramDrafter  # noqa: E402
from specwire.common.protogen import drafter_pb2  # noqa: E402
from specwire.drafter_service.engine import DraftEngine, SeqUpdate  # noqa: E402
from specwire.drafter_service.server import response_to_proto  # noqa: E402
from specwire.drafter_service.sessions import SessionStore  # noqa: E402
from specwire.target_service.drafters.remote_sessions import RemoteSessions  # noqa: E402

ASK = 9


def measure(seqs: list[list[int]], branches: int, positions: int, iters: int) -> dict:
    drafter = NGramDrafter()
    engine = DraftEngine(drafter, SessionStore(drafter), max_draft_len=64)
    pos = positions if branches else 0

    def updates(first: bool) -> list[SeqUpdate]:
        """The whole sequences once, then empty deltas (each message asks afresh)."""
        out = []
        for i, s in enumerate(seqs):
            base, new = (0, s) if first else (len(s), [])
            out.append(SeqUpdate(f"r{i}", base, new, ASK, False, branches, pos))
        return out

    engine.draft(updates(True))
    t0 = time.perf_counter()
    for step in range(iters):
        wire = response_to_proto(step, engine.draft(updates(False))).SerializeToString()
    drafter_s = (time.perf_counter() - t0) / iters
    sessions = RemoteSessions()
    for i, s in enumerate(seqs):
        sessions.synced[f"r{i}"] = len(s)
    t0 = time.perf_counter()
    for _ in range(iters):
        reply = drafter_pb2.DraftResponse.FromString(wire)
        for d in reply.drafts:
            sessions.keep(d.request_id, d.base_len, list(d.tokens), None, ASK, d.branches)
    target_s = (time.perf_counter() - t0) / iters
    n_branches = sum(len(d.branches) for d in drafter_pb2.DraftResponse.FromString(wire).drafts)
    return {"drafter_us": drafter_s * 1e6, "target_us": target_s * 1e6, "bytes": len(wire),
            "branches": n_branches}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", required=True, help="JSON from branch_replay.py --save-outputs")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--positions", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    data = json.loads(Path(args.outputs).read_text())
    # Ratios only: absolute times on this machine say little about a serving host.
    print("| sequences | drafter: with ÷ without | target: with ÷ without | bytes | branches |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        seqs = [d["prompt"] + d["output"] for d in data[:rows]]
        plain = measure(seqs, 0, args.positions, args.iters)
        with_ = measure(seqs, 4, args.positions, args.iters)
        print(
            f"| {rows} | {with_['drafter_us'] / plain['drafter_us']:.1f}× | "
            f"{with_['target_us'] / plain['target_us']:.2f}× | "
            f"{plain['bytes']} → {with_['bytes']} | {with_['branches']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
