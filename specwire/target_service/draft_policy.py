"""The one owner of K: how many drafts each step may verify (adaptive draft length).

Speculation pays when the tokens a step commits grow faster than its cost. Each step the
policy picks one draft length k for the batch (0 = plain decoding) that maximises expected
committed tokens per second:

    goodput(k) = sum_i E_i(min(k, cap_i)) / cost_k

- E_i(k) = 1 + p_i * (a_i + a_i^2 + ... + a_i^k): the bonus/next token plus the expected
  accepted prefix, with a_i the request's per-draft acceptance (an EMA over its verified steps)
  and p_i how often its drafter has a draft at all (n-gram lookup often has none). A new request
  starts from the population's estimate (an EMA over every request's steps), not a fixed guess;
- tokens(k) = the step's prefill tokens + sum_i (1 + p_i * min(k, cap_i)) (varlen steps are
  not padded per row).

The two kinds of step cost differently, so each has its own measured model:
- a speculative step is synchronous: host work (scheduling, drafting, input preparation,
  verification; grows with the rows) and then the GPU (grows with the tokens):
  cost = host(rows) + gpu(tokens), each an EMA per bucket of real synchronous steps (host =
  the step's time not spent waiting for the device, gpu = the wait); gpu is seeded at warm-up
  from graph replays;
- a plain step (k = 0) is overlapped with the next one's preparation when the executor can
  (`overlap`): cost = its measured launch-to-launch period per token bucket (until one is
  seen, the GPU time: optimistic, so it gets tried). Without overlap it costs what a
  synchronous step does.
- switching from overlapped plain steps to speculation first drains the pipeline (waits for the
  step in flight): a one-off cost (`observe_switch`, an EMA), spread over `switch_run` steps,
  that a speculative step pays on top when the policy is in plain mode — and it must then
  beat plain steps by `switch_margin`. Once speculating, steps compare without it.

A request whose drafts are almost never accepted (a < `min_accept`) stops drafting and is
re-tried now and then (`explore_every`); a policy that stopped drafting altogether tries the
best k > 0 every `explore_steps` steps, so it notices when drafting starts to pay. With a static
policy (`adaptive=False`, e.g. on the CPU where no cost table exists) k is always the maximum.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specwire.target_service.request import Request


@dataclass
class _Estimate:
    accept: float = 0.5  # per-draft acceptance a
    has_draft: float = 1.0  # probability the drafter proposes anything, p
    steps: int = 0
    drafted_steps: int = 0  # steps in which drafts were verified (what `accept` learnt from)
    # per k = 0..K: (expected committed tokens, tokens fed); rebuilt when the estimate moves
    table: list[tuple[float, int]] | None = None

    def per_k(self, max_k: int) -> list[tuple[float, int]]:
        if self.table is None:
            a, p = self.accept, self.has_draft
            gain, term, out = 0.0, 1.0, [(1.0, 1)]
            for k in range(1, max_k + 1):
                term *= a
                gain += term
                out.append((1.0 + p * gain, 1 + round(p * k)))
            self.table = out
        return self.table


def _ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else old + w * (new - old)


def _row_bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()  # 1, 2, 4, 8, ...


@dataclass
class DraftLengthPolicy:
    max_draft_len: int
    adaptive: bool = False
    ema: float = 0.2  # weight of the newest observation
    explore_every: int = 16  # steps between forced tries for a request that stopped drafting
    explore_steps: int = 64  # steps between forced tries when no request drafts
    min_accept: float = 0.1  # below this per-draft acceptance a request stops drafting
    population_ema: float = 0.02  # weight of one request's step in the population estimate
    switch_margin: float = 0.05  # drafting must beat overlapped plain steps by this much
    switch_run: int = 8  # speculative steps a switch's drain is spread over
    switch_cost: float = 0.0  # seconds a switch to speculation waits for the step in flight
    speculating: bool = False  # the last decision drafted
    overlap: bool = True  # plain steps are overlapped (the executor sets this every step)
    # token bucket -> seconds; `buckets` is sorted
    buckets: list[int] = field(default_factory=list)
    gpu: list[float] = field(default_factory=list)  # synchronous steps: device wait
    period: list[float | None] = field(default_factory=list)  # overlapped plain steps
    host: dict[int, float] = field(default_factory=dict)  # row bucket -> host seconds
    _est: dict[str, _Estimate] = field(default_factory=dict)
    _population: _Estimate = field(default_factory=_Estimate)
    _decisions: int = 0

    # -- cost model ------------------------------------------------------------------------------
    def seed_costs(self, table: dict[int, float]) -> None:
        """Device time per token bucket (seconds), e.g. graph replay times at warm-up."""
        self.buckets = sorted(table)
        self.gpu = [table[b] for b in self.buckets]
        self.period = [None] * len(self.buckets)
        self.adaptive = self.adaptive and bool(self.buckets)

    def _bucket_index(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return i if i < len(self.buckets) else None

    def _gpu(self, tokens: int) -> float:
        i = self._bucket_index(tokens)
        if i is None:  # beyond the table: extrapolate linearly from the largest bucket
            return self.gpu[-1] * tokens / self.buckets[-1]
        return self.gpu[i]

    def _host(self, rows: int) -> float:
        """Host seconds of a synchronous step of `rows` rows: its bucket's, else the nearest
        measured bucket's scaled by rows, else 0 (unmeasured: optimistic, so it gets tried)."""
        b = _row_bucket(rows)
        if b in self.host:
            return self.host[b]
        if not self.host:
            return 0.0
        near = min(self.host, key=lambda x: abs(x.bit_length() - b.bit_length()))
        return self.host[near] * b / near

    def sync_cost(self, rows: int, tokens: int) -> float:
        return self._host(rows) + self._gpu(tokens)

    def plain_cost(self, rows: int, tokens: int) -> float:
        if not self.overlap:
            return self.sync_cost(rows, tokens)
        i = self._bucket_index(tokens)
        seen = self.period[i] if i is not None else None
        return seen if seen is not None else self._gpu(tokens)

    def observe_sync(self, rows: int, tokens: int, seconds: float, device_wait: float) -> None:
        """A synchronous step of `rows` rows and `tokens` tokens took `seconds`, of which it
        waited `device_wait` for the device."""
        if not self.buckets or rows <= 0:
            return
        b = _row_bucket(rows)
        self.host[b] = _ema(self.host.get(b), max(0.0, seconds - device_wait), self.ema)
        i = self._bucket_index(tokens)
        if i is not None:
            self.gpu[i] = _ema(self.gpu[i], device_wait, self.ema)

    def observe_switch(self, seconds: float) -> None:
        """Leaving overlapped steps waited `seconds` for the step in flight."""
        self.switch_cost = _ema(self.switch_cost or None, seconds, self.ema)

    def observe_plain(self, tokens: int, period: float) -> None:
        """An overlapped plain step of `tokens` tokens: `period` from its launch to the next."""
        i = self._bucket_index(tokens) if self.buckets else None
        if i is not None:
            self.period[i] = _ema(self.period[i], period, self.ema)

    # -- per-request acceptance --------------------------------------------------------------------
    def _new_estimate(self) -> _Estimate:
        pop = self._population
        return _Estimate(accept=pop.accept, has_draft=pop.has_draft)

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        est = self._est.get(req.request_id)
        if est is None:
            est = self._est[req.request_id] = self._new_estimate()
        est.steps += 1
        if req.draft_budget <= 0 and drafted == 0:
            return  # no budget this step: nothing learned
        w, pw, pop = self.ema, self.population_ema, self._population
        seen = 1.0 if drafted else 0.0
        est.has_draft += w * (seen - est.has_draft)
        pop.has_draft += pw * (seen - pop.has_draft)
        est.table = None
        if drafted:
            est.drafted_steps += 1
            # Per-draft acceptance from an accepted prefix of length `accepted` out of `drafted`:
            # the maximum-likelihood a of a geometric prefix, clipped away from 0 and 1.
            a = accepted / (accepted + (1 if accepted < drafted else 0))
            a = min(max(a, 0.02), 0.98)
            est.accept += w * (a - est.accept)
            pop.accept += pw * (a - pop.accept)

    def forget(self, req: Request) -> None:
        self._est.pop(req.request_id, None)

    # -- the decision ----------------------------------------------------------------------------
    def step_draft_len(self, decode: list[Request], prefill_tokens: int = 0) -> int:
        """The draft length for a step whose decode rows are `decode` (caps still apply)."""
        if not self.adaptive or not decode:
            # Static, or only prefills finishing this step (their drafts cost little next to
            # the chunk): the maximum, which request caps then trim.
            return self.max_draft_len
        K = self.max_draft_len
        prior = self._new_estimate().per_k(K)
        est = self._est
        rows = len(decode) + (1 if prefill_tokens else 0)
        self._decisions += 1
        switching = self.overlap and not self.speculating
        switch = self.switch_cost / self.switch_run if switching else 0.0
        # Per request, (expected committed, tokens fed) at each k its cap allows (hot path:
        # tables cached on the estimates, rebuilt only when an estimate moves).
        tables = []
        for r in decode:
            e = est.get(r.request_id)
            tables.append((e.per_k(K) if e is not None else prior, min(r.useful_drafts, K)))
        goodput = []
        for k in range(K + 1):
            tokens = prefill_tokens
            committed = 0.0
            for table, cap in tables:
                c, t = table[k if k < cap else cap]
                committed += c
                tokens += t
            if k == 0:
                cost = self.plain_cost(rows, tokens)
            else:
                cost = self.sync_cost(rows, tokens) + switch
            goodput.append(committed / max(cost, 1e-9))
        best_k = 0
        for k in range(1, len(goodput)):
            # Ties go to the shorter draft; leaving overlapped plain steps needs a clear gain
            # (the estimates are noisy and every switch drains the pipeline).
            margin = 1.0 + (self.switch_margin if best_k == 0 and switching else 0.0001)
            if goodput[k] > goodput[best_k] * margin:
                best_k = k
        if best_k == 0 and len(goodput) > 1 and self._decisions % self.explore_steps == 0:
            best_k = max(range(1, len(goodput)), key=goodput.__getitem__)  # look again
        self.speculating = best_k > 0
        return best_k

    def request_cap(self, req: Request, step_k: int) -> int:
        """The drafts `req` may propose this step: the step's k and its own limits, and none
        for a request whose drafts are almost never accepted (re-tried every
        `explore_every` steps). A budget the drafter leaves unused costs nothing (rows are not
        padded), so how often a drafter has no draft at all never withdraws the budget."""
        cap = min(step_k, req.useful_drafts)
        est = self._est.get(req.request_id)
        if (
            self.adaptive
            and est is not None
            and est.drafted_steps >= 4
            and est.steps % self.explore_every
            and est.accept < self.min_accept
        ):
            return 0
        return cap
