"""What the draft-length policy's per-step decision costs on the host: µs a call of
`DraftLengthPolicy.step_draft_len` in the speculative mode, K = 8, at several batch sizes,
every row's estimate moved before each call (as a drafting step's `observe` moves them, which
rebuilds each row's table). With `presum`, the step's sums are made first, as the executor makes
them while the device runs (`Executor._compute`), and only `step_draft_len` is timed: the part
left on the critical path. The chosen k's histogram is printed too, so two runs can be compared
for the same decisions (presum prices with estimates one step older).

    python bench/policy_cost.py [--rows 1,8,32,64] [--steps 3000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from specwire.target_service.draft_policy import DraftLengthPolicy
from specwire.target_service.request import Request

K = 8


def run(rows: int, steps: int, presum: bool, seed: int = 0) -> tuple[float, list[int]]:
    rng = random.Random(seed)
    p = DraftLengthPolicy(K, adaptive=True)
    p.seed_costs({b: 0.0008 + 2e-6 * b for b in (8, 16, 32, 64, 128, 256, 512, 1024)})
    p.host = {1: 2e-4, 2: 2.2e-4, 4: 2.5e-4, 8: 3e-4, 16: 5e-4, 32: 8e-4, 64: 1.4e-3}
    p.host_bare = dict(p.host)
    reqs = [
        Request(request_id=f"r{i}", prompt_ids=[1, 2, 3], max_new_tokens=500, max_draft_len=K)
        for i in range(rows)
    ]
    for r in reqs:
        r.step_draft_cap = K
    ks, total = [], 0.0
    for _ in range(steps):
        p.mode = "spec"
        if presum:
            p.presum(reqs)  # while the device runs the step
        for r in reqs:  # the step's verification
            d = rng.choice((0, K, K, K))
            p.observe(r, d, rng.randint(0, d) if d else 0)
        p.mode = "spec"  # one long window: only the pricing is timed
        p._window[2] = max(p._window[2], 1)
        t0 = time.perf_counter()
        ks.append(p.step_draft_len(reqs))
        total += time.perf_counter() - t0
    return total / steps * 1e6, ks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    print("| rows | step_draft_len µs | with presum µs | k histogram (k = 0..8) | with presum |")
    print("|---|---|---|---|---|")
    for rows in (int(x) for x in args.rows.split(",")):
        # the median of 3 runs of each (the dev VM's timings move by ~30 % run to run)
        cold = statistics.median(run(rows, args.steps, presum=False)[0] for _ in range(3))
        warm = statistics.median(run(rows, args.steps, presum=True)[0] for _ in range(3))
        ks = run(rows, args.steps, presum=False)[1]
        ks_pre = run(rows, args.steps, presum=True)[1]
        hist = [ks.count(k) for k in range(K + 1)]
        hist_pre = [ks_pre.count(k) for k in range(K + 1)]
        print(f"| {rows} | {cold:.1f} | {warm:.1f} | {hist} | {hist_pre} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
