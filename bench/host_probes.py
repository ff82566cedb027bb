"""Probes `host_only.py` wraps around the target engine it runs: how many drafts each drafting
row got (`--draft-lengths`) and the executor thread's CPU time in its steps."""

from __future__ import annotations

import time
from collections import Counter


class DraftLengths:
    """`--draft-lengths`: per decode row of every step that asked the drafter (a budget > 0),
    how many drafts it got, wrapped around this engine's draft intake."""

    def __init__(self, intake) -> None:
        self.counts: Counter[int] = Counter()
        prepare = intake.prepare

        def counted(rows, ask_drafter, step_no, **kwargs):
            asked = prepare(rows, ask_drafter, step_no, **kwargs)
            if asked:
                self.counts.update(len(r.drafts) for r in rows if r.request.draft_budget > 0)
            return asked

        intake.prepare = counted

    def summary(self) -> str:
        rows = sum(self.counts.values())
        none = self.counts[0]
        drafted = sum(n * c for n, c in self.counts.items())
        return (
            f"{rows} drafting rows, {none} ({100 * none / max(rows, 1):.0f} %) without drafts, "
            f"{drafted / max(rows - none, 1):.2f} drafts a row that had any; "
            f"by length {sorted(self.counts.items())}"
        )


class StepCPU:
    """The executor thread's CPU time in its steps (`time.thread_time`: time spent waiting for
    the GIL or sleeping is not counted, so it is steadier on a small shared machine than
    throughput)."""

    def __init__(self, executor) -> None:
        self.seconds, self.steps = 0.0, 0
        step = executor.step

        def timed() -> None:
            t0 = time.thread_time()
            step()
            self.seconds += time.thread_time() - t0
            self.steps += 1

        executor.step = timed

    def reset(self) -> None:
        self.seconds, self.steps = 0.0, 0
