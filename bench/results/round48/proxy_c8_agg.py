"""Aggregate proxy_c8.sh's lines: per drafter, runs, mean and median tok/s (and the standard
deviation of one run), mean executor CPU per step and mean device idle before a drafted step.

    python bench/results/round48/proxy_c8_agg.py proxy_c8_devvm.txt
"""

from __future__ import annotations

import collections
import re
import statistics
import sys

LINE = re.compile(r"(\w+)\s+replay: .*\((\d+) tok/s\) executor CPU (\d+) us/step drafted (\d+) us")


def main(path: str) -> int:
    runs = collections.defaultdict(list)
    for line in open(path):
        m = LINE.match(line)
        if m:
            runs[m[1]].append(tuple(int(x) for x in m.groups()[1:]))
    base = statistics.mean(r[0] for r in runs["ngram"]) if runs.get("ngram") else None
    print("| drafter | runs | tok/s mean (median, sd) | ÷ in-process | CPU us/step | idle us |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        tps = [r[0] for r in rs]
        mean = statistics.mean(tps)
        ratio = f"{mean / base:.3f}" if base else "n/a"
        sd = statistics.stdev(tps) if len(tps) > 1 else 0.0
        cpu = statistics.mean(r[1] for r in rs)
        idle = statistics.mean(r[2] for r in rs)
        print(
            f"| {name} | {len(rs)} | {mean:.0f} ({statistics.median(tps):.0f}, {sd:.0f}) "
            f"| {ratio} | {cpu:.0f} | {idle:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
