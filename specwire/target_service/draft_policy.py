"""The one owner of K: how many drafts each step may verify (adaptive draft length).

Speculation pays when the tokens a step commits grow faster than its cost. Each step the
policy picks one draft length k for the batch (0 = plain decoding) that maximises expected
committed tokens per second:

    goodput(k) = sum_i E_i(min(k, cap_i)) / cost(tokens(k))

- E_i(k) = 1 + p_i * (a_i + a_i^2 + ... + a_i^k): the bonus/next token plus the expected
  accepted prefix, with a_i the request's per-draft acceptance (an EMA over its verified steps)
  and p_i how often its drafter has a draft at all (n-gram lookup often has none);
- tokens(k) = the step's prefill tokens + sum_i (1 + p_i * min(k, cap_i)) (varlen steps are
  not padded per row);
- cost(T) = the measured wall time of a step of T tokens: a table per graph bucket, seeded at
  warm-up from graph replays and then kept current from real steps (an EMA per bucket), so it
  includes attention over the live contexts and the host's share of the step.

Requests start from a prior (a = 0.5, p = 1) so a new request is tried with drafts; a
request whose drafts are almost never accepted (a < `min_accept`) stops drafting and is
re-tried now and then (`explore_every`). With a static
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


@dataclass
class DraftLengthPolicy:
    max_draft_len: int
    adaptive: bool = False
    ema: float = 0.2  # weight of the newest observation
    explore_every: int = 16  # steps between forced tries for a request that stopped drafting
    min_accept: float = 0.1  # below this per-draft acceptance a request stops drafting
    # tokens-bucket -> seconds; `buckets` is sorted
    buckets: list[int] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)
    _est: dict[str, _Estimate] = field(default_factory=dict)

    # -- cost table ------------------------------------------------------------------------------
    def seed_costs(self, table: dict[int, float]) -> None:
        """Initial cost per token bucket (seconds), e.g. graph replay times at warm-up."""
        self.buckets = sorted(table)
        self.costs = [table[b] for b in self.buckets]
        self.adaptive = self.adaptive and bool(self.buckets)

    def _bucket_index(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return i if i < len(self.buckets) else None

    def cost(self, tokens: int) -> float:
        i = self._bucket_index(tokens)
        if i is None:  # beyond the table: extrapolate linearly from the largest bucket
            return self.costs[-1] * tokens / self.buckets[-1]
        return self.costs[i]

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A real step of `tokens` tokens took `seconds`: keep its bucket's cost current."""
        i = self._bucket_index(tokens) if self.buckets else None
        if i is not None:
            self.costs[i] += self.ema * (seconds - self.costs[i])

    # -- per-request acceptance --------------------------------------------------------------------
    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        est = self._est.setdefault(req.request_id, _Estimate())
        est.steps += 1
        if req.draft_budget <= 0 and drafted == 0:
            return  # no budget this step: nothing learned
        w = self.ema
        est.has_draft += w * ((1.0 if drafted else 0.0) - est.has_draft)
        if drafted:
            est.drafted_steps += 1
            # Per-draft acceptance from an accepted prefix of length `accepted` out of `drafted`:
            # the maximum-likelihood a of a geometric prefix, clipped away from 0 and 1.
            a = accepted / (accepted + (1 if accepted < drafted else 0)) if drafted else 0.0
            est.accept += w * (min(max(a, 0.02), 0.98) - est.accept)

    def forget(self, req: Request) -> None:
        self._est.pop(req.request_id, None)

    # -- the decision ----------------------------------------------------------------------------
    def _expected(self, est: _Estimate, k: int) -> float:
        a, gain, term = est.accept, 0.0, 1.0
        for _ in range(k):
            term *= a
            gain += term
        return 1.0 + est.has_draft * gain

    def step_draft_len(self, decode: list[Request], prefill_tokens: int = 0) -> int:
        """The draft length for a step whose decode rows are `decode` (caps still apply)."""
        if not self.adaptive or not decode:
            # Static, or only prefills finishing this step (their drafts cost little next to
            # the chunk): the maximum, which request caps then trim.
            return self.max_draft_len
        ests = [self._est.get(r.request_id) or _Estimate() for r in decode]
        caps = [r.useful_drafts for r in decode]
        best_k, best = 0, -1.0
        for k in range(self.max_draft_len + 1):
            tokens = prefill_tokens
            committed = 0.0
            for est, cap in zip(ests, caps, strict=True):
                kk = min(k, cap)
                tokens += 1 + round(est.has_draft * kk)
                committed += self._expected(est, kk)
            goodput = committed / max(self.cost(tokens), 1e-9)
            if goodput > best * 1.0001:  # ties go to the shorter draft
                best_k, best = k, goodput
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
