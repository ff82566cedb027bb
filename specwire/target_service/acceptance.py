"""Per-request acceptance: what a request's drafts are expected to commit at each draft length,
learnt from its verified steps. The draft-length policy (draft_policy.py) prices a step's k with
it; the policy owns one.

    E_i(k) = 1 + p_i * (q_1 + q_1 q_2 + ... + q_1 ... q_k)

the bonus/next token plus the expected accepted prefix, with p_i how often its drafter has a
draft at all (n-gram lookup often has none), q_1 = a_i the request's per-draft acceptance (an
EMA over its verified steps) and q_m = max(a_i, d_m) past the first draft, d_m the population's
acceptance of draft m given the drafts before it were accepted (an EMA over every request's
rows, updated every `deeper_every` drafted rows). A geometric prefix (q_m = a_i) priced lookup
drafters' long drafts far too low: their drafts are all right or all wrong (a match goes on or
does not start), and at 8 streams the policy chose k = 0 where drafting the maximum paid
(bench/RESULTS.md, round 40). A new request starts from the population's estimate (an EMA over
every request's steps). Tokens fed per row: 1 + p_i * k (varlen steps are not padded per row).

A step without drafts teaches nothing, so an estimate low enough to make k = 0 a request's best
would hold it there for good — and a lookup drafter's requests miss for a while and then match
for long runs. So every `recover_every` steps a request runs without a draft budget in the
speculative mode, its a_i and p_i move `recover` of the way back to the population's: after a
stretch of plain steps it drafts again, and what its drafter proposes then decides. (In the
plain mode nobody drafts whatever the estimates say; recovering there too handed every request
the population's estimate when speculation came back, and the CPU proxy's 32-stream replay pass
lost 16 %.) In the CPU proxy at one stream the policy had chosen k = 0 in ~40 % of its
speculative steps, where a static K = 8 ran 2-6 % faster; with the recovery, +3 % at one stream
for the in-process and the remote drafter (bench/RESULTS.md, round 44).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.target_service.request import Request


@dataclass
class Estimate:
    """One request's acceptance (or the population's)."""

    accept: float = 0.5  # per-draft acceptance a
    has_draft: float = 1.0  # probability the drafter proposes anything, p
    steps: int = 0
    drafted_steps: int = 0  # steps in which drafts were verified (what `accept` learnt from)
    misses: int = 0  # drafting steps in a row with no draft accepted
    idle: int = 0  # steps since it last drafted or recovered (`AcceptanceModel.recover_every`)
    # per k = 0..K: (expected committed tokens, expected tokens fed); rebuilt when the estimate
    # or the population's deeper acceptance (`shape`: its version) moves. Tokens fed stay
    # fractional: rounding each row's 1 + p*k (p = 0.6, k = 2: 2.2 -> 2) would misprice a step
    # by up to half a token per row.
    table: list[tuple[float, float]] | None = None
    shape: int = -1

    def per_k(self, max_k: int, deeper: list[float], version: int) -> list[tuple[float, float]]:
        """`deeper[m]` (m >= 1): the population's acceptance of draft m given drafts 0..m-1
        were accepted. Draft 0 is accepted with the request's own a; each later one with the
        larger of a and the population's `deeper` there (module docstring)."""
        if self.table is None or self.shape != version:
            a, p = self.accept, self.has_draft
            gain, term, out = 0.0, 1.0, [(1.0, 1.0)]
            for k in range(1, max_k + 1):
                d = deeper[k - 1]
                term *= a if k == 1 or d < a else d
                gain += term
                out.append((1.0 + p * gain, 1.0 + p * k))
            self.table, self.shape = out, version
        return self.table


@dataclass
class AcceptanceModel:
    """Every live request's `Estimate`, and the population's (module docstring). Only the
    executor's thread writes it; the policy's metrics read `accept`, `has_draft`, `deeper`."""

    max_draft_len: int
    ema: float = 0.2  # weight of a request's newest step in its own estimate
    population_ema: float = 0.02  # weight of one request's step in the population estimate
    # Drafted rows between two updates of the population's deeper acceptance (`_deeper`): its
    # version invalidates every request's table, so it moves in batches.
    deeper_every: int = 64
    # A request that runs without drafting learns nothing, so an estimate that made k = 0 its
    # best would keep it there; every `recover_every` such steps (speculative mode) it moves
    # `recover` of the way back to the population's (module docstring).
    recover_every: int = 8
    recover: float = 0.5
    _est: dict[str, Estimate] = field(default_factory=dict)
    _population: Estimate = field(default_factory=Estimate)
    # [m] (1 <= m < K): the population's acceptance of draft m given drafts 0..m-1 were
    # accepted (EMA, starting at the prior a); its version; and the rows reaching / passing
    # each position since the last update, and how many drafted rows that was.
    _deeper: list[float] = field(default_factory=list)
    _deeper_version: int = 0
    _deeper_counts: list[list[int]] = field(default_factory=list)
    _deeper_rows: int = 0
    # `presum`'s sums for the next `sums` call and what each request added to them: (ids,
    # caps, {id: (table, cap)}, (committed, fed)).
    _presummed: tuple | None = None

    def __post_init__(self) -> None:
        self._deeper = [self._population.accept] * max(1, self.max_draft_len)
        self._deeper_counts = [[0, 0] for _ in self._deeper]

    # -- what the policy reads -----------------------------------------------------------------
    @property
    def accept(self) -> float:
        """The population's per-draft acceptance a."""
        return self._population.accept

    @property
    def has_draft(self) -> float:
        """How often the population's drafter proposes anything, p."""
        return self._population.has_draft

    @property
    def deeper(self) -> list[float]:
        """d_1 .. d_{K-1}: the population's acceptance of each draft past the first."""
        return list(self._deeper[1:])

    def estimate(self, req: Request) -> Estimate | None:
        """`req`'s estimate; None before its first verified step."""
        return self._est.get(req.request_id)

    def table(self, req: Request) -> list[tuple[float, float]]:
        """(expected committed, tokens fed) for k = 0..K: `req`'s, or (a request not seen yet)
        the population's."""
        return self.tables([req])[0]

    def tables(self, requests: list[Request]) -> list[list[tuple[float, float]]]:
        """`table` for each of `requests` (a step's hot path: tables are cached on the
        estimates and rebuilt only when an estimate moves)."""
        K, deeper, version = self.max_draft_len, self._deeper, self._deeper_version
        est, prior, out = self._est, None, []
        for r in requests:
            e = est.get(r.request_id)
            if e is None:
                if prior is None:
                    prior = self._new().per_k(K, deeper, version)
                out.append(prior)
            else:
                out.append(e.per_k(K, deeper, version))
        return out

    def sums(self, requests: list[Request], caps: list[int]) -> tuple[list[float], list[float]]:
        """Summed over `requests`, each held to its draft cap: (expected committed tokens,
        tokens fed) at each k = 0..K — `table` of each at min(k, cap), added up (a step's hot
        path). From the sums `presum` made, if it did (they serve one call), less the requests
        that have gone since, plus those that joined, each request whose cap moved (its last
        drafts) re-added at its new cap with the table it was summed with."""
        pre, self._presummed = self._presummed, None
        if pre is None:
            return self._sum(requests, caps)
        ids, was_caps, added, (committed, fed) = pre
        if caps == was_caps and ids == [r.request_id for r in requests]:
            return committed, fed  # the same rows (the usual case)
        joined = []
        for r, cap in zip(requests, caps, strict=True):
            was = added.pop(r.request_id, None)
            if was is None:
                joined.append((r, cap))
            elif was[1] != cap:
                _add(committed, fed, was[0], was[1], -1.0)
                _add(committed, fed, was[0], cap, 1.0)
        for table, cap in added.values():  # gone (or not scheduled) since
            _add(committed, fed, table, cap, -1.0)
        new = [r for r, _ in joined]
        for table, (_, cap) in zip(self.tables(new), joined, strict=True):
            _add(committed, fed, table, cap, 1.0)
        return committed, fed

    def presum(self, requests: list[Request], caps: list[int]) -> None:
        """Make the next `sums` call's sums now (while the device runs a step), with the
        estimates as they are now."""
        tables = self.tables(requests)
        ids = [r.request_id for r in requests]
        added = dict(zip(ids, zip(tables, caps, strict=True), strict=True))
        self._presummed = (ids, caps, added, self._sum(requests, caps, tables))

    def drop_presum(self) -> None:
        self._presummed = None

    def _sum(
        self, requests: list[Request], caps: list[int], tables: list | None = None
    ) -> tuple[list[float], list[float]]:
        rows = list(zip(tables or self.tables(requests), caps, strict=True))
        committed, fed = [], []
        for k in range(self.max_draft_len + 1):  # (faster k outer than row outer)
            c_sum = t_sum = 0.0
            for table, cap in rows:
                c, t = table[k if k < cap else cap]
                c_sum += c
                t_sum += t
            committed.append(c_sum)
            fed.append(t_sum)
        return committed, fed

    # -- learning ------------------------------------------------------------------------------
    def _new(self) -> Estimate:
        pop = self._population
        return Estimate(accept=pop.accept, has_draft=pop.has_draft)

    def observe(self, req: Request, drafted: int, accepted: int, recovering: bool = True) -> None:
        """`req` verified `drafted` drafts this step and accepted the first `accepted`.
        `recovering`: a step without a budget counts toward the request's recovery (the
        policy says so only where its estimate withheld the budget: not in the plain mode)."""
        est = self._est.get(req.request_id)
        if est is None:
            est = self._est[req.request_id] = self._new()
        est.steps += 1
        if req.draft_budget <= 0 and drafted == 0:  # no budget this step: nothing learned
            # (Not a request that can never draft: speculation off, or no room left. Its table
            # would be rebuilt for nothing, and an "off" pass of a paired benchmark would pay.)
            if self.recover_every and recovering and req.useful_drafts > 0:
                est.idle += 1
                if est.idle >= self.recover_every:
                    pop, est.idle, est.table = self._population, 0, None
                    est.has_draft += self.recover * (pop.has_draft - est.has_draft)
                    est.accept += self.recover * (pop.accept - est.accept)
            return
        est.idle = 0
        w, pw, pop = self.ema, self.population_ema, self._population
        seen = 1.0 if drafted else 0.0
        est.has_draft += w * (seen - est.has_draft)
        pop.has_draft += pw * (seen - pop.has_draft)
        est.table = None
        if drafted:
            est.drafted_steps += 1
            est.misses = 0 if accepted else est.misses + 1
            # Per-draft acceptance from an accepted prefix of length `accepted` out of `drafted`:
            # the maximum-likelihood a of a geometric prefix, clipped away from 0 and 1.
            a = accepted / (accepted + (1 if accepted < drafted else 0))
            a = min(max(a, 0.02), 0.98)
            est.accept += w * (a - est.accept)
            pop.accept += pw * (a - pop.accept)
            self._observe_deeper(drafted, accepted)

    def _observe_deeper(self, drafted: int, accepted: int) -> None:
        """Draft m (m >= 1) was reached when drafts 0..m-1 were accepted and it was drafted;
        it passed when it was accepted too. Every `deeper_every` drafted rows the population's
        `_deeper` moves toward what they saw (the weight `population_ema` per row reaching it)."""
        # [depth]: rows that reached drafts 1..depth, as [stopped there, passed it too]
        counts = self._deeper_counts
        depth = min(drafted - 1, accepted, len(counts) - 1)
        if depth >= 1:
            counts[depth][accepted > depth] += 1
        self._deeper_rows += 1
        if self._deeper_rows < self.deeper_every:
            return
        self._deeper_rows = 0
        beyond = 0  # rows that reached past m (and so passed draft m)
        for m in range(len(counts) - 1, 0, -1):
            stopped, passed = counts[m]
            reached = stopped + passed + beyond
            if reached:
                weight = 1.0 - (1.0 - self.population_ema) ** reached
                self._deeper[m] += weight * ((passed + beyond) / reached - self._deeper[m])
            beyond = reached
            counts[m] = [0, 0]
        self._deeper_version += 1

    def forget(self, req: Request) -> None:
        self._est.pop(req.request_id, None)


def _add(committed: list[float], fed: list[float], table: list, cap: int, sign: float) -> None:
    """Add (sign 1) or take away (-1) one request's `table` at its cap to/from a step's sums."""
    for k in range(len(committed)):
        c, t = table[k if k < cap else cap]
        committed[k] += sign * c
        fed[k] += sign * t
