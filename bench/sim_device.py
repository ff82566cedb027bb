"""A simulated serial device for `host_only.py` (`--device-ms`): the stub's steps take time as
a GPU's would, and the time the device sat idle between them is the host's critical path."""

from __future__ import annotations

import time


class DeviceClock:
    """A simulated device (`--device-ms`): steps run one after another, each taking a fixed
    time plus a time per token; `synchronize` sleeps (the GIL released, as a CUDA wait) until
    the step's end. A model of a GPU, not a measurement of one."""

    def __init__(self, ms: float, us_per_token: float) -> None:
        self.step_s, self.token_s = ms / 1e3, us_per_token / 1e6
        self.free_at = 0.0
        # kind -> [launches, seconds the device sat idle before them]: for a decode step, the
        # host time on the critical path since the step before it ended (`idle_summary`).
        self.idle: dict[str, list] = {}

    def launch(self, tokens: int, kind: str | None = None) -> _StepEnd:
        """`kind`: "drafted" or "plain" for a step that only decodes (its idle time is
        counted), None for one that prefills (the gap before it is the client's)."""
        now = time.perf_counter()
        if kind is not None and self.free_at:
            count = self.idle.setdefault(kind, [0, 0.0])
            count[0] += 1
            count[1] += max(0.0, now - self.free_at)
        start = max(now, self.free_at)
        self.free_at = start + self.step_s + tokens * self.token_s
        return _StepEnd(self.free_at)

    def idle_summary(self) -> str:
        """The device's idle time before each decode step's launch, by kind, since the last
        call (then reset)."""
        parts = [
            f"{kind} {secs * 1e6 / n:.0f} us (x{n})"
            for kind, (n, secs) in sorted(self.idle.items())
        ]
        self.idle = {}
        return "device idle before a decode step: " + (", ".join(parts) or "none")


class _StepEnd:
    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)
