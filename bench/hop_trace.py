"""Where the remote drafter's round trip goes: join `SPECWIRE_HOP_TRACE` rows (see
specwire/common/hoptrace.py) by step and print each hop's median, p90 and share of the round
trip (send -> handed).

Run a target and its drafter service with `SPECWIRE_HOP_TRACE=DIR` in their environment (for
`bench/serving.py` it is inherited by the servers it starts), then:

    python bench/hop_trace.py DIR [--skip N]

A step number repeats across streams (each starts at 1); a drafter row joins the target
question whose `send` is the latest one before it, within --window-ms.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import itertools
import os
import statistics
from collections import defaultdict

HOPS = (  # (name, from mark, to mark): the round trip in order. With --drafter-mode relay the
    # relay process marks "taken" and "recv", and the last hop includes the time the reply
    # waited in the relay's pipe for the executor to look for it.
    ("target queue -> gRPC thread (relay) took it", "send", "taken"),
    ("serialise + wire + drafter receive", "taken", "in"),
    ("drafter drafts", "in", "out"),
    ("drafter send + wire + target reader (relay)", "out", "recv"),
    ("target parses + hands over (relay: + waits)", "recv", "handed"),
)
# With --drafter-mode socket nobody marks "taken" or "recv" (no thread or process between the
# executor and the drafter): the hops around them join.
JOINED = {
    ("send", "in"): "serialise + socket + drafter receive (socket)",
    ("out", "handed"): "drafter send + socket + target reads, parses, hands over (socket)",
}


def hops(marks) -> list[tuple[str, str, str]]:
    """HOPS, less the marks nobody wrote (their neighbours joined)."""
    chain = [HOPS[0][1], *(b for _n, _a, b in HOPS)]
    chain = [m for m in chain if marks.get(m)]
    names = {(a, b): n for n, a, b in HOPS} | JOINED
    return [(names.get((a, b), f"{a} -> {b}"), a, b) for a, b in itertools.pairwise(chain)]


def load(directory: str) -> dict[str, dict[int, list[float]]]:
    """mark -> step -> sorted times, over every file of DIR."""
    marks: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in glob.glob(os.path.join(directory, "*.tsv")):
        with open(path, encoding="ascii") as f:
            for line in f:
                hop, step, t = line.split("\t")
                marks[hop][int(step)].append(float(t))
    for by_step in marks.values():
        for times in by_step.values():
            times.sort()
    return marks


def first_after(times: list[float], t: float, window: float) -> float | None:
    i = bisect.bisect_left(times, t)
    return times[i] if i < len(times) and times[i] - t <= window else None


def journeys(marks, window: float) -> list[dict[str, float]]:
    """One dict mark -> time per question sent whose every hop was found."""
    out = []
    for step, sends in marks["send"].items():
        for t0 in sends:
            j, t = {"send": t0}, t0
            for _name, _a, b in hops(marks):
                t = first_after(marks[b].get(step, []), t, window)
                if t is None:
                    break
                j[b] = t
            else:
                out.append(j)
    out.sort(key=lambda j: j["send"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--window-ms", type=float, default=50.0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N questions")
    args = ap.parse_args()
    marks = load(args.dir)
    js = journeys(marks, args.window_ms / 1000)[args.skip :]
    if not js:
        raise SystemExit(f"hop_trace: no complete round trip in {args.dir}")
    total = [j["handed"] - j["send"] for j in js]
    print(f"{len(js)} round trips; send -> handed p50 {statistics.median(total) * 1e3:.3f} ms")
    print("| hop | p50 ms | p90 ms | mean share |")
    print("|---|---|---|---|")
    mean_total = statistics.fmean(total)
    for name, a, b in hops(marks):
        d = sorted(j[b] - j[a] for j in js)
        p90 = d[min(len(d) - 1, int(0.9 * len(d)))]
        share = statistics.fmean(d) / mean_total
        print(f"| {name} | {statistics.median(d) * 1e3:.3f} | {p90 * 1e3:.3f} | {share:.0%} |")


if __name__ == "__main__":
    main()
