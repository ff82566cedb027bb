"""What `--pipeline-choice measured` costs and gains, given the two variants' true rates at a
load and how noisy one window's rate is: `PipelineChoice` (the code the policy runs) is fed
windows whose rates are the true rate times lognormal noise, and the run's throughput is
compared with always running the better variant, and with always pipelining.

No GPU and no engine: the rates are inputs (by default round 56's H100 ratios of the remote
n-gram drafter to the in-process host lookup: pipelined 1.026 / 1.002 / 0.861 and synchronous
0.895 / 0.896 / 0.968 at 1 / 8 / 32 streams). How noisy a window is is the open question, so
the noise is swept.

    python bench/pipeline_choice_sim.py [--windows 100] [--seeds 400] [--noise 0.05,0.1,0.2,0.3]
        [--swap-at 0.5: the rates trade places half way]
        [--budget B --weight-scale S --min-looks N: PipelineChoice's, else as the engine builds it]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specwire.target_service.draft_policy import DraftLengthPolicy  # noqa: E402
from specwire.target_service.mode_rates import row_bucket  # noqa: E402
from specwire.target_service.pipeline_choice import PIPELINED  # noqa: E402

# streams -> (pipelined, synchronous): round 56, bench/RESULTS.md, remote ÷ host lookup
ROUND56 = {1: (1.026, 0.895), 8: (1.002, 0.896), 32: (0.861, 0.968)}


def simulate(
    streams: int, pipe: float, sync: float, noise: float, rng: random.Random, args
) -> tuple[float, float]:
    """One server's life at one load (`streams` rows): `args.windows` speculative windows;
    with `args.swap_at`, the two variants' true rates trade places after that share of them.
    Returns (throughput of the choice ÷ the better variant's, share of windows run by the
    better variant). A window's throughput is its true rate (the measured one is noisy); the
    run's is the mean over equal-step windows."""
    # As the engine builds it (the policy's probe settings), unless overridden.
    policy = DraftLengthPolicy(4, pipelined=True, choose_pipelining=True)
    c = policy.choice
    if args.budget is not None:
        c.probe_budget = args.budget
    if args.weight_scale is not None:
        c.weight_scale = args.weight_scale
    c.min_looks = args.min_looks if args.min_looks is not None else c.min_looks
    # A window's least say as the policy computes it (`_record`): less below 8 rows.
    floor = policy.window_weight * min(1.0, streams / policy.full_weight_rows)
    load = row_bucket(streams)
    true = {PIPELINED: pipe, not PIPELINED: sync}
    got = best = 0.0
    on_better = 0
    swap = round(args.windows * args.swap_at) if args.swap_at else -1
    for i in range(args.windows):
        if i == swap:
            true = {PIPELINED: sync, not PIPELINED: pipe}
        v = c.variant(load)
        measured = true[v] * math.exp(rng.gauss(0.0, noise) - noise * noise / 2)
        c.record(load, v, measured, measured, floor=floor, share=1.0, steps=32)
        got += true[v]
        best += max(true.values())
        on_better += true[v] == max(true.values())
    return got / best, on_better / args.windows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=100, help="speculative windows per run")
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--noise", default="0.05,0.1,0.2,0.3", help="sigma of log(window rate)")
    ap.add_argument(
        "--swap-at",
        type=float,
        default=0.0,
        help="the two variants' true rates trade places after this share of the windows",
    )
    ap.add_argument("--budget", type=float, default=None, help="PipelineChoice.probe_budget")
    ap.add_argument("--weight-scale", type=float, default=None, help="PipelineChoice's")
    ap.add_argument("--min-looks", type=int, default=None, help="PipelineChoice.min_looks")
    args = ap.parse_args()
    print(
        f"{args.windows} windows a run, {args.seeds} runs each; rates: round 56 (remote ÷ host "
        "lookup); measured ÷ better variant (mean, 5th percentile), windows on the better one, "
        "and measured ÷ host lookup against always pipelining"
        + (
            f"; the rates trade places after {args.swap_at:.0%} of the windows"
            if args.swap_at
            else ""
        )
    )
    print(
        "| streams | pipelined | synchronous | noise | choice ÷ better (p5) | on better "
        "| choice ÷ host lookup | always pipelined ÷ host lookup |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for streams, (pipe, sync) in ROUND56.items():
        for noise in (float(x) for x in args.noise.split(",")):
            rng = random.Random(streams * 1000 + round(noise * 100))
            runs = [simulate(streams, pipe, sync, noise, rng, args) for _ in range(args.seeds)]
            ratios = sorted(r for r, _ in runs)
            mean = sum(ratios) / len(ratios)
            p5 = ratios[len(ratios) // 20]
            share = sum(s for _, s in runs) / len(runs)
            swap = args.swap_at or 1.0  # always pipelined: `pipe` until the swap, `sync` after
            always = pipe * swap + sync * (1.0 - swap)
            print(
                f"| {streams} | {pipe:.3f} | {sync:.3f} | {noise:.2f} | {mean:.3f} ({p5:.3f}) "
                f"| {share:.0%} | {mean * max(pipe, sync):.3f} | {always:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
