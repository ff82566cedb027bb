"""Round 49: the metric updates a synchronous step's `Executor.emit` makes (SpecStats totals,
acceptance by draft position, inter-token latencies, generated tokens), µs a step, at 8/32/64
rows of random (drafted <= 8, accepted <= drafted) rows. Run once at a commit before the
by-length count and once after:

    python bench/results/round49/emit_cost.py
"""

from __future__ import annotations

import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specwire.target_service.metrics import TargetMetrics  # noqa: E402
from specwire.target_service.request import SpecStats  # noqa: E402


def main() -> None:
    metrics, stats = TargetMetrics("m"), SpecStats()
    metrics._scrape.grow(8)
    rng = random.Random(0)
    for rows in (8, 32, 64):
        steps = []
        for _ in range(512):
            drafted = [rng.choice([0, 8, 8, 5]) for _ in range(rows)]
            steps.append([(d, min(d, rng.randrange(0, 5))) for d in drafted])
        itls = [[rng.random() * 0.01 for _ in range(rows)] for _ in range(512)]
        at = [0]

        def one(rows=rows, steps=steps, itls=itls, at=at) -> None:
            k = at[0] % 512
            at[0] += 1
            stats.record_many(steps[k])
            metrics.on_verified(steps[k])
            metrics.observe_itl(itls[k])
            metrics.on_generated(2 * rows)

        n = 5000
        tail = timeit.timeit(one, number=n) / n * 1e6
        alone = timeit.timeit(lambda s=steps: metrics._scrape.record(s[3]), number=n) / n * 1e6
        print(f"rows {rows}: emit's metric updates {tail:.1f} us a step (by position: {alone:.1f})")


if __name__ == "__main__":
    main()
