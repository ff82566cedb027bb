"""Arithmetic shared by the choices made from measured rates per load (batch-size bucket):
speculate or not (`DraftLengthPolicy`, draft_policy.py) and, while speculating, pipelined or
synchronous drafting steps (`PipelineChoice`, pipeline_choice.py)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping


def ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else old + w * (new - old)


def row_bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()  # 1, 2, 4, 8, ...


def probe_interval(a: float, b: float, budget: float, least: int, most: int) -> int:
    """Windows until the slower of two choices (rates `a`, `b`) is measured again: a probe
    window costs up to (1 - slower/faster) of one window's throughput, so probe as often as
    that stays within `budget`, between `least` and `most` windows."""
    if max(a, b) <= 0:
        return least
    gap = 1.0 - min(a, b) / max(a, b)
    return max(least, min(most, round(gap / budget)))


def implied(winners: Mapping[int, Hashable], load: int, small: Hashable, large: Hashable):
    """The choice that wins at `load` by the winners measured at other loads (`winners`: load
    -> the choice that won there), or None. `small` pays less as the batch grows, `large`
    more: `large` winning at a load no larger wins here, `small` winning at a load no smaller
    wins here. The nearest such load decides."""
    best, dist = None, None
    for b, winner in winners.items():
        if (winner == large and b <= load) or (winner == small and b >= load):
            d = abs(b.bit_length() - load.bit_length())
            if dist is None or d < dist:
                best, dist = winner, d
    return best
