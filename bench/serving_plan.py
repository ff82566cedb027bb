"""The serving benchmark's plan: which prompts each pass sends (`plan_passes`; `plan_paired`
for `--paired`: halves with the same mix of prompt kinds, speculation on and off), and the
per-server ledger that refuses a timed pass a prompt its server has already seen
(bench/serving.py, which runs the plans)."""

from __future__ import annotations

from dataclasses import dataclass

from prompt_pool import ALL_KINDS, Prompt


class FirstSightError(AssertionError):
    """A timed pass would send a prompt its server has already seen."""


class Ledger:
    """The prompts one server process has been sent; guards the first-sight rule."""

    def __init__(self) -> None:
        self.sent: set[str] = set()

    def admit(self, prompts: tuple[Prompt, ...], replay: bool) -> None:
        texts = [p.text for p in prompts]
        if len(set(texts)) != len(texts):
            raise FirstSightError("a pass holds the same prompt twice")
        if replay:
            unseen = [p.id for p in prompts if p.text not in self.sent]
            if unseen:
                raise FirstSightError(f"replay of prompts never sent: {unseen[:3]}")
        else:
            repeated = [p.id for p in prompts if p.text in self.sent]
            if repeated:
                raise FirstSightError(f"timed pass would repeat prompts: {repeated[:3]}")
        self.sent.update(texts)


@dataclass(frozen=True)
class PassPlan:
    name: str  # "warm-up", "c=8", "replay"; paired: "warm-up on", "c=8 off #1"
    concurrency: int
    prompts: tuple[Prompt, ...]
    replay: bool = False
    speculate: bool = True  # False: every request sets `speculation.disable`
    pair: int | None = None  # --paired: the pair's number at its concurrency

    @property
    def timed(self) -> bool:
        return not self.name.startswith("warm-up")


def plan_passes(
    pool: list[Prompt],
    levels: list[int],
    per_pass: int | None,
    warmup: int,
    least: int = 16,
    factor: int = 2,
) -> list[PassPlan]:
    """Consecutive slices of the pool: warm-up, one per level, then the replay of the last.

    A pass at c holds max(factor * c, least) prompts: factor "waves" of c requests, so the
    larger factor, the smaller the share of the pass spent ramping up and draining."""
    sizes = [warmup] + [per_pass or max(factor * c, least) for c in levels]
    if sum(sizes) > len(pool):
        raise SystemExit(
            f"the passes need {sum(sizes)} unique prompts, the pool has {len(pool)}: "
            "lower --prompts-per-pass / --pass-factor / --warmup-prompts or add --kinds"
        )
    plans, start = [], 0
    for i, n in enumerate(sizes):
        chunk = tuple(pool[start : start + n])
        start += n
        if i == 0:
            if n:
                plans.append(PassPlan("warm-up", min(max(levels), n), chunk))
        else:
            plans.append(PassPlan(f"c={levels[i - 1]}", levels[i - 1], chunk))
    top = max((p for p in plans if p.name != "warm-up"), key=lambda p: p.concurrency)
    plans.append(PassPlan("replay", top.concurrency, top.prompts, replay=True))
    return plans


def split_by_kind(prompts: tuple[Prompt, ...]) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...]]:
    """Two halves of a batch with the same mix of kinds: each kind's prompts alternate between
    them (in pool order), so the sizes differ by at most one and each kind's counts by at most
    one. (The pool cycles through the kinds, so a plain even/odd split would give one half
    'edit' and 'tests' and the other 'complete' and 'explain'.)"""
    order = sorted(range(len(prompts)), key=lambda i: ALL_KINDS.index(prompts[i].kind))
    return (
        tuple(prompts[i] for i in sorted(order[0::2])),
        tuple(prompts[i] for i in sorted(order[1::2])),
    )


def plan_paired(
    pool: list[Prompt],
    levels: list[int],
    per_pass: int | None,
    warmup: int,
    least: int = 16,
    factor: int = 2,
    pairs: int = 2,
    rnd: int = 0,
) -> list[PassPlan]:
    """--paired: warm-up (half with speculation on, half off), then at each level `pairs`
    pairs, each from a fresh slice of 2 x the pass size (the same size as plan_passes' pass)
    split by `split_by_kind`. Pair p of the i-th level in round `rnd` goes "on" first when
    p + i + rnd is even: the two orders alternate (on/off, off/on: drift cancels over an even
    number of pairs), and round to round; the "on" half is the first half in even pairs."""
    sizes = [per_pass or max(factor * c, least) for c in levels]
    need = warmup + 2 * pairs * sum(sizes)
    if need > len(pool):
        raise SystemExit(
            f"--paired needs {need} unique prompts per server, the pool has {len(pool)}: lower "
            "--pairs / --prompts-per-pass / --pass-factor / --min-prompts or add --kinds all"
        )
    top = max(levels)
    warm_on, warm_off = split_by_kind(tuple(pool[:warmup]))
    plans = [
        PassPlan(f"warm-up {name}", min(top, max(1, len(half))), half, speculate=on)
        for name, half, on in (("on", warm_on, True), ("off", warm_off, False))
        if half
    ]
    start = warmup
    for i, (c, n) in enumerate(zip(levels, sizes, strict=True)):
        for p in range(pairs):
            first, second = split_by_kind(tuple(pool[start : start + 2 * n]))
            start += 2 * n
            on, off = (first, second) if p % 2 == 0 else (second, first)
            both = [
                PassPlan(f"c={c} on #{p}", c, on, pair=p),
                PassPlan(f"c={c} off #{p}", c, off, speculate=False, pair=p),
            ]
            plans += both if (p + i + rnd) % 2 == 0 else both[::-1]
    return plans
