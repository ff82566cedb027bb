"""Pipelined or synchronous drafting steps, chosen per load by measurement (`--pipeline-choice
measured`).

With `--pipeline-drafts` a drafting step is launched before the step in flight is read. What
that gains: the host's work, and a remote drafter's round trip, leave the critical path. What
it costs: a remote drafter's drafts for such a step continue its last proposal on a hypothesis
about the step in flight, and where that fails they are verified and rejected, so fewer tokens
are committed a step. Which wins depends on the load. On the H100 (bench/RESULTS.md, round
56) the remote n-gram drafter ran 1.03x and 1.00x the in-process host lookup at 1 and 8
streams pipelined, against 0.90x synchronous; at 32 streams, pipelined 0.86x against 0.97x
synchronous (its hypotheses held 37-40 % of the time there, and a 32-row step's device time
hides less of the round trip's share).

`PipelineChoice` is the draft-length policy's helper for this (draft_policy.py). The policy
measures its speculative mode's rate over windows of steps; each speculative window runs one
variant, pipelined or synchronous, and its rate (tokens per second per row) counts toward that
variant's at its load (the batch-size bucket of its decode rows when it opened), weighed as the
policy weighs its modes' windows.
The next speculative window at a load runs:

- where both variants are measured, by `min_looks` windows each (they alternate until then),
  the faster, and the slower one every so often to re-measure it (the interval grows with the
  gap: `probe_interval`);
- where one is measured, the one other loads imply: pipelining pays less as the batch grows,
  so synchronous steps winning at a smaller load win here, pipelined ones winning at a larger
  load win here; with nothing implied (or once a probe is due), the unmeasured one;
- where neither is, the one implied, else pipelined (what `--pipeline-drafts` asked for).

A window's rate here is by the clock: its tokens over its wall time, the steps the policy gave
k = 0 included. The policy's own speculative rate counts only the steps that drafted, and a
synchronous window prices more steps to k = 0 (its host time is on the critical path), so by
that rate it looks at fewer and better steps: in one CPU-proxy run at one stream it put
synchronous steps at 1.18x pipelined ones, and whole passes ran 0.87x as fast synchronous.
The speculative mode's rate at a load, which the policy weighs against plain decoding, is its
faster variant's (by the policy's count): speculation is worth what it makes run the way it
runs best.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.target_service.mode_rates import ema, implied, probe_interval

PIPELINED, SYNCHRONOUS = True, False
NAMES = {PIPELINED: "pipelined", SYNCHRONOUS: "synchronous"}


@dataclass
class PipelineChoice:
    probe_every: int = 4  # least speculative windows at a load between probes
    max_probe_every: int = 32  # most
    probe_budget: float = 0.01  # throughput share probing may cost (sets the interval)
    # Windows of each variant at a load before the faster one is trusted: the two alternate
    # until then. A window's rate averages the requests it ran, so one window each compares
    # two sets of requests as much as the two variants.
    min_looks: int = 3
    # A window's least say in a variant's rate by the clock, as a share of the policy's
    # (`DraftLengthPolicy.window_weight`; its speculative rate keeps the policy's weight): the
    # two variants are both lossless and a window's rate is noisy, so a longer memory costs
    # little while the rates hold. On round 56's H100 gaps with one window's rate off by 10-30 %
    # (lognormal), half the policy's weight and half its probe budget ran the better variant on
    # 77-93 % of windows at 8 and 32 streams against 69-90 %, and on about as many at one
    # stream (where the policy's own floor is already an eighth); with the two rates trading
    # places mid-run they followed as well at 8 and 32 streams and ~1 % slower at one
    # (bench/pipeline_choice_sim.py, bench/RESULTS.md round 57).
    weight_scale: float = 0.5
    # (pipelined?, batch-size bucket) -> tokens per second per row by the clock (every step of
    # its windows), and the windows behind it
    rates: dict[tuple[bool, int], float] = field(default_factory=dict)
    # the same, the policy's speculative rate (its windows' drafting steps only)
    spec_rates: dict[tuple[bool, int], float] = field(default_factory=dict)
    looks: dict[tuple[bool, int], int] = field(default_factory=dict)
    steps: dict[bool, int] = field(default_factory=lambda: {PIPELINED: 0, SYNCHRONOUS: 0})
    _next: dict[int, bool] = field(default_factory=dict)  # load -> the next window's variant
    _best: dict[int, bool] = field(default_factory=dict)  # load -> the faster there
    _probe_at: dict[int, int] = field(default_factory=dict)  # load -> window of its next probe

    def variant(self, load: int) -> bool:
        """Whether the next speculative window at `load` runs pipelined."""
        planned = self._next.get(load)
        if planned is not None:
            return planned
        hint = self._infer(load)
        return PIPELINED if hint is None else hint

    def spec_rate(self, load: int) -> float | None:
        """The policy's speculative rate of the faster variant at `load` (None: not measured
        there)."""
        measured = [p for p, b in self.rates if b == load]
        if not measured:
            return None
        best = self._faster(load) if len(measured) == 2 else measured[0]
        return self.spec_rates.get((best, load))

    def record(
        self,
        load: int,
        pipelined: bool,
        rate: float,
        spec_rate: float | None,
        floor: float,
        share: float,
        steps: int,
    ) -> None:
        """A speculative window of `steps` steps, run `pipelined` or not, measured `rate` at
        `load` by the clock (`spec_rate` by the policy's count; None: it drafted too little to
        say). It is weighed as the policy weighs a window: the mean of the first windows (the
        n-th has at least 1/n of the say), an EMA weight of at least `floor` after, times its
        `share` of a whole window; then its next window there is planned."""
        key = (pipelined, load)
        self.steps[pipelined] += steps
        looks = self.looks[key] = self.looks.get(key, 0) + 1
        w = max(1.0 / looks, floor * self.weight_scale) * share
        self.rates[key] = ema(self.rates.get(key), rate, w)
        if spec_rate is not None:  # (speculation's rate against plain decoding: the policy's say)
            w = max(1.0 / looks, floor) * share
            self.spec_rates[key] = ema(self.spec_rates.get(key), spec_rate, w)
        other = not pipelined
        seen = looks + self.looks.get((other, load), 0)  # speculative windows at `load`
        if (other, load) in self.rates:
            if min(self.looks[key], self.looks[(other, load)]) < self.min_looks:
                self._next[load] = other  # not trusted yet: alternate
                return
            best = self._faster(load)
            interval = probe_interval(
                self.rates[(PIPELINED, load)],
                self.rates[(SYNCHRONOUS, load)],
                self.probe_budget,
                self.probe_every,
                self.max_probe_every,
            )
            if self._best.get(load) != best:  # a new winner: the loser is probed on the gap
                self._best[load] = best
                self._probe_at[load] = seen + interval
            if seen >= self._probe_at[load]:
                self._probe_at[load] = seen + 1 + interval
                self._next[load] = not best
            else:
                self._next[load] = best
            return
        hint = self._infer(load)
        probe_at = self._probe_at.setdefault(load, seen - 1 + self.max_probe_every)
        if hint is None or hint == other or seen >= probe_at:
            self._probe_at[load] = seen + 1 + self.probe_every
            self._next[load] = other
        else:
            self._next[load] = pipelined

    def _faster(self, load: int) -> bool:
        """The faster variant at `load` (both measured; a tie goes to pipelining)."""
        return self.rates[(PIPELINED, load)] >= self.rates[(SYNCHRONOUS, load)]

    def _infer(self, load: int) -> bool | None:
        """The variant other loads imply wins at `load`, or None: synchronous steps winning at
        a load no larger, or pipelined ones winning at a load no smaller. The nearest such
        load decides."""
        winners = {
            b: self._faster(b)
            for pipelined, b in self.rates
            if pipelined and (SYNCHRONOUS, b) in self.rates
        }
        return implied(winners, load, small=PIPELINED, large=SYNCHRONOUS)

    def snapshot(self) -> dict:
        return dict(
            rates={(NAMES[p], b): r for (p, b), r in self.rates.items()},
            windows={(NAMES[p], b): n for (p, b), n in self.looks.items()},
            steps={NAMES[p]: n for p, n in self.steps.items()},
        )
