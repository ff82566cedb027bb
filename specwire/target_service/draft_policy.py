"""The one owner of K: how many drafts each step may verify (adaptive draft length).

Two decisions, at two time scales.

**The mode: speculate or not — measured, not modelled.** A speculative step is synchronous
(drafting needs every token on the host), a plain one is overlapped with the next step's
preparation, and which one yields more tokens per second depends on everything at once: the
batch, the drafts' real acceptance (bursty on code), the host's speed, a remote drafter's round
trip, the cost of draining the pipeline to switch. So the policy runs one mode for a window of
`mode_window` steps (a probe that trails the other mode's rate there by more than `early_exit`
after `first_window` steps ends there), measures the tokens generated per second and per row
over it (the executor reports every step, a switch's drain and the loop between steps included,
and the policy counts those that say something about the mode; a step in which no request may
speculate at all, each having turned it off, runs plainly in either mode, so it counts in the
plain mode's window only, and teaches neither the host time nor any acceptance below; so does a
step the speculative mode overlaps, to which the model below gave k = 0: speculation's rate is
that of the steps it drafts), keeps an average per mode and batch-size bucket (a rate means
nothing at another load: the mean of the windows measured there, then an EMA whose weight
shrinks below `full_weight_rows` rows, where a window samples few requests and measures their
drafts as much as the mode), and then runs the mode with the better rate at the load just seen
(speculation only when it is `spec_margin` faster: a near tie goes to the mode that cannot lose
to no drafter; when the winner changes, the mode it beat is next probed on the interval the new
gap sets); a window that starts at another load starts in the mode best there, and one whose
load moves on (a pass ramping up or draining) ends once it has run `load_shift_steps` steps in
a row at a load where its mode is known to trail the other by more than `early_exit`. At a load
where the other mode has no rate yet it goes by what other loads imply (speculation pays less
as the batch grows: plain winning at a smaller load wins here, speculation winning at a larger
one wins here), and measures the other mode only when nothing is implied or a probe is due.
Where nothing is known or implied it decodes plainly first and then probes speculation; a first
look that trails by more than `first_look_exit` after `first_window` steps ends there too (on
the H200 a synchronous speculative step at 32-64 rows took 3.5x an overlapped plain one, and
whole first looks at speculation cost 5-8 % of a serving pass). Now and then it runs the losing
mode for one window to re-measure it. How often: a probe costs one window at the losing rate,
so the gap sets the interval — every `probe_every` windows when the modes are close, up to
`max_probe_every` when the loser is far behind, keeping what probing costs near `probe_budget`
of the throughput. It starts speculating.

**The draft length inside the speculative mode — modelled per step.** It picks the k that
maximises expected committed tokens per second:

    goodput(k) = sum_i E_i(min(k, cap_i)) / cost(k)
    cost(k > 0) = host(rows) + gpu(tokens(k))        (synchronous: drafting needs every token)
    cost(0) = gpu(tokens(0)) + exposed(rows)         (overlapped: the host hides behind the GPU)

- E_i(k): what request i is expected to commit when it may draft k, from its acceptance as
  learnt so far (acceptance.py: its own per-draft acceptance for the first draft, the
  population's acceptance of each deeper draft past it; how often its drafter has a draft at
  all, p_i);
- tokens(k) = the step's prefill tokens + sum_i (1 + p_i * min(k, cap_i)) (varlen steps are
  not padded per row);
- host(rows): per row bucket, the least of the last 4 host times (a step's time not spent
  waiting for the device) of real synchronous decode steps; an unmeasured bucket scales from the
  nearest measured one (0 before any: optimistic, so drafting gets tried). Where plain decoding
  wins only by this host time, one drafting step in 64 re-measures it, and a window that
  probes speculation drafts regardless (it measures speculation, not the model's guess);
- gpu(tokens): an EMA per token bucket of those steps' device wait, seeded at warm-up from graph
  replays;
- exposed(rows): an EMA per row bucket of what an overlapped plain step's period (launch to
  launch) took beyond gpu(its tokens): the host work the overlap did not hide (0 until measured).

With pipelined drafting steps (`pipelined`) a step of any k is priced as an overlapped one
(no synchronous host time); with `choice` (`--pipeline-choice measured`, pipeline_choice.py)
each speculative window runs its drafting steps pipelined or synchronous, whichever measured
faster at its load, and is priced accordingly (`pipelines`).

k = 0 there means a plain step, and the executor overlaps it: pricing it like a synchronous
step (host + gpu) made drafting look better than it is wherever the host is a large share of a
step. On the H200 in fp32 at 32-64 rows that chose verify steps of 12.6-18.2 ms against
overlapped plain steps of 7.9 ms, and the n-gram drafter ran at 0.95x of no drafter
(bench/RESULTS.md, round 13, run C). A request whose drafts are almost never accepted
(`max_misses` drafting steps in a row with none accepted) stops drafting and is re-tried now
and then (`explore_every`). With a static
policy (`adaptive=False`, e.g. on the CPU where no cost table exists) k is always the maximum.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from specwire.target_service.acceptance import AcceptanceModel
from specwire.target_service.mode_rates import ema as _ema
from specwire.target_service.mode_rates import implied, probe_interval
from specwire.target_service.mode_rates import row_bucket as _row_bucket
from specwire.target_service.pipeline_choice import PipelineChoice
from specwire.target_service.request import Request


@dataclass
class DraftLengthPolicy:
    max_draft_len: int
    adaptive: bool = False
    ema: float = 0.2  # weight of the newest observation
    explore_every: int = 16  # steps between forced tries for a request that stopped drafting
    # After this many drafting steps in a row with no draft accepted, a request stops drafting
    # (re-tried every `explore_every` steps, until one of its drafts is accepted). Not a
    # threshold on its acceptance estimate: a lookup drafter's requests miss for a while and then
    # match for long runs, and withdrawing those under a per-draft acceptance of 0.1 cost 2-5 %
    # at 1 and 8 streams in the host-only proxy (round 40).
    max_misses: int = 16
    mode_window: int = 32  # steps per measured window of one mode
    # Overlapped steps (k = 0) in a row after which a speculative window ends without a rate
    idle_handoff: int = 32
    # A probe of the losing mode that, after `first_window` steps, trails the winner's rate at
    # this load by more than `early_exit` ends there: finding out that a mode still loses
    # costs a few steps, not a whole window (a remote drafter's losing windows cost up to 12 %
    # of a serving pass on the H200: bench/RESULTS.md, round 7), and counts in the rate's
    # average by its share of a whole window. A mode's first look at a load stays a whole
    # window: a few steps at the start of a response (n-gram drafts have nothing to match
    # yet) would misjudge speculation for a long while.
    first_window: int = 8
    early_exit: float = 0.25
    # A window whose load has moved to another bucket for this many steps in a row, where both
    # modes are measured and its mode trails the other by more than `early_exit`, ends there
    # (`_moved_away`): its mode was chosen for the load it started at, and a pass that ramps up
    # from a few rows to many ran a whole window of speculation at 32 rows, where it lost by
    # 28 %, in the host-only proxy (bench/RESULTS.md, round 41).
    load_shift_steps: int = 4
    _shifted: int = 0  # steps in a row at a load bucket other than the planned one
    # A mode's first look at a load ends after `first_window` steps only when it trails the
    # other mode's rate there by more than this (a wide gap no start-of-response effect
    # explains: on the H200 a synchronous speculative step at 32-64 rows took 3.5x an
    # overlapped plain one, and whole first looks cost 5-8 % of a pass).
    first_look_exit: float = 0.4
    # Least windows between tries of the mode not in use (when the two are within 4 %: a
    # probe then costs under 1 % of a window). At 8 streams, where speculation's windows swing
    # with the requests in flight, 4 gave +2 % over 8 in the host-only proxy (round 40).
    probe_every: int = 4
    max_probe_every: int = 32  # most windows between them
    probe_budget: float = 0.01  # throughput share probing may cost (sets the interval)
    spec_margin: float = 0.05  # speculation runs only when measured this much faster
    # A window's say in its mode's rate at a load: the mean of the windows measured there
    # (1/n: no single look, the first included, outweighs the others), down to an EMA weight
    # of 0.5 per whole window from `full_weight_rows` rows and proportionally less below.
    # A window's rate averages the requests it ran; at a few rows those are one or two, and
    # what speculation gains varies several-fold between requests (per kind at c=1 on the
    # H200: edit 2.9x, review 0.97x; bench/RESULTS.md, round 12), so a 32-step window at one
    # stream measures a third of one request more than the mode. With half the say per
    # window the mode followed the request in flight: it left speculation after one poor
    # request and came back only when a probe, >= `probe_every` windows later, landed on a
    # good one (a remote drafter that paid 1.21x at one stream in one round decoded plainly
    # on 83 % of the steps in the next, 1.00x; round 12, run C). From 8 rows a window
    # averages enough requests (the n-gram drafter kept speculating on 77-89 % of the steps
    # at c=8 there); the weight, and so the policy under load, is as it was.
    full_weight_rows: int = 8
    window_weight: float = 0.5  # a whole window's EMA weight from `full_weight_rows` rows
    # Steps on which plain decoding won only by a synchronous step's host time (drafting would
    # pay without it) between two drafting steps that re-measure that host time.
    host_refresh_every: int = 64
    host_window: int = 4  # a row bucket's host time: the least of its last this many readings
    _host_vetoes: int = 0
    _host_recent: dict[int, deque] = field(default_factory=dict)
    # False: the seeded device times are the whole cost model (no host or exposed terms are
    # learnt). For a GPU policy driven on the CPU, where a step's forward runs inside its host
    # time, so measured host times would price synchronous steps by the CPU's forward.
    measure_costs: bool = True
    # Drafting steps overlap as plain ones do (`--pipeline-drafts`): a step of any k is
    # priced as an overlapped one (`plain_cost`), no synchronous host time in it.
    pipelined: bool = False
    # With `pipelined`: each speculative window runs its drafting steps pipelined or
    # synchronous, whichever measured faster at its load (`--pipeline-choice measured`,
    # pipeline_choice.py: `choice`, built with the probe settings above); else always pipelined.
    choose_pipelining: bool = False
    choice: PipelineChoice | None = None
    _variant: bool = True  # the current speculative window's: pipelined?
    _variant_load: int = 0  # the load it was chosen for (0: no speculative window open)
    # The open speculative window's steps by the clock (tokens, seconds, steps, rows as
    # `_window`), the plain ones (k = 0) included
    _span: list[float] = field(default_factory=lambda: [0.0, 0.0, 0, 0])
    mode: str = "spec"  # "spec" | "plain"
    # (mode, batch-size bucket) -> generated tokens per second per row (EMA over windows)
    rates: dict[tuple[str, int], float] = field(default_factory=dict)
    # token bucket -> seconds; `buckets` is sorted
    buckets: list[int] = field(default_factory=list)
    gpu: list[float] = field(default_factory=list)  # synchronous steps: device wait
    host: dict[int, float] = field(default_factory=dict)  # row bucket -> host seconds
    # The same without the step's wait for its drafter (what `wait_worth_s` prices a wait
    # against: pricing it with host times that hold the waits it allowed would lengthen them)
    host_bare: dict[int, float] = field(default_factory=dict)
    _bare_recent: dict[int, deque] = field(default_factory=dict)
    # row bucket -> seconds an overlapped plain step took beyond its device time
    exposed: dict[int, float] = field(default_factory=dict)
    acceptance: AcceptanceModel | None = None  # per-request acceptance (built from K)
    _window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0, 0])  # tok, s, steps, rows
    _windows: dict[int, int] = field(default_factory=dict)  # windows seen per load bucket
    _looks: dict[tuple[str, int], int] = field(default_factory=dict)  # windows per rate
    _probe_at: dict[int, int] = field(default_factory=dict)  # load -> window of its next probe
    _best: dict[int, str] = field(default_factory=dict)  # load -> the winner there
    _spec_idle: int = 0  # overlapped steps in a row in the speculative mode (k = 0)
    _planned: int = 0  # the load the current mode was chosen for
    # The last drafting step's worth of waiting for its drafts (`wait_worth`), None when
    # the last step did not draft or nothing prices it (static policy).
    wait_worth_s: float | None = None
    _probing: bool = False  # the current window measures a mode chosen to be measured
    # What the policy did, for its metrics (read when scraped): steps per mode (counted as
    # each window closes), and steps run per draft length (k = 0..K; 0: a plain step; `ran`).
    mode_steps: dict[str, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})
    k_steps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.k_steps = [0] * (self.max_draft_len + 1)
        if self.pipelined and self.choose_pipelining and self.choice is None:
            # Half the probe budget: a probe of the slower variant buys less than one of the
            # slower mode (both variants speculate; pipeline_choice.py, `weight_scale`).
            self.choice = PipelineChoice(
                self.probe_every, self.max_probe_every, self.probe_budget / 2
            )
        if self.acceptance is None:
            self.acceptance = AcceptanceModel(self.max_draft_len, ema=self.ema)
        if not 1 <= self.first_window <= self.mode_window:
            raise ValueError(
                f"need 1 <= first_window <= mode_window, got {self.first_window}, "
                f"{self.mode_window}"
            )
        if self.full_weight_rows < 1:
            raise ValueError(f"need full_weight_rows >= 1, got {self.full_weight_rows}")
        if not 1 <= self.probe_every <= self.max_probe_every or not 0 < self.probe_budget < 1:
            raise ValueError(
                "need 1 <= probe_every <= max_probe_every and 0 < probe_budget < 1, got "
                f"{self.probe_every}, {self.max_probe_every}, {self.probe_budget}"
            )

    # -- cost model ------------------------------------------------------------------------------
    def seed_costs(self, table: dict[int, float]) -> None:
        """Device time per token bucket (seconds), e.g. graph replay times at warm-up."""
        self.buckets = sorted(table)
        self.gpu = [table[b] for b in self.buckets]
        self.adaptive = self.adaptive and bool(self.buckets)

    def _bucket_index(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return i if i < len(self.buckets) else None

    def _gpu(self, tokens: int) -> float:
        i = self._bucket_index(tokens)
        if i is None:  # beyond the table: extrapolate linearly from the largest bucket
            return self.gpu[-1] * tokens / self.buckets[-1]
        return self.gpu[i]

    def _host(self, rows: int, table: dict[int, float] | None = None) -> float:
        """Host seconds of a synchronous step of `rows` rows (`table`: `host`, or
        `host_bare`): its bucket's, else the nearest measured bucket's scaled by rows, else 0
        (unmeasured: optimistic, so it gets tried)."""
        table = self.host if table is None else table
        b = _row_bucket(rows)
        if b in table:
            return table[b]
        if not table:
            return 0.0
        near = min(table, key=lambda x: abs(x.bit_length() - b.bit_length()))
        return table[near] * b / near

    def sync_cost(self, rows: int, tokens: int) -> float:
        return self._host(rows) + self._gpu(tokens)

    def plain_cost(self, rows: int, tokens: int) -> float:
        """Seconds of an overlapped plain step of `rows` rows and `tokens` tokens: its device
        time plus the host work the overlap left exposed at that load (0 until measured)."""
        return self._gpu(tokens) + self.exposed.get(_row_bucket(rows), 0.0)

    def observe_plain(self, rows: int, tokens: int, seconds: float) -> None:
        """An overlapped plain step of `rows` rows and `tokens` tokens took `seconds` from its
        launch to the next one's."""
        if not self.buckets or rows <= 0 or not self.measure_costs:
            return
        b = _row_bucket(rows)
        over = max(0.0, seconds - self._gpu(tokens))
        self.exposed[b] = _ema(self.exposed.get(b), over, self.ema)

    def observe_sync(
        self,
        rows: int,
        tokens: int,
        seconds: float,
        device_wait: float,
        may_draft: bool = True,
        draft_wait: float = 0.0,
    ) -> None:
        """A synchronous step of `rows` rows and `tokens` tokens took `seconds`, of which it
        waited `device_wait` for the device and spent `draft_wait` getting its drafts
        (asking, waiting, checking: `host_bare` leaves it out). Only a decode step (at most
        1 + K tokens a row) teaches the host time of its row bucket: a step that prefills
        prompts spends far more host time per row, and the host time prices decode steps.
        `may_draft`: whether any of its requests may speculate at all; a step where none may
        (each turned speculation off) has no drafting work on the host, so it teaches the
        device time only."""
        if not self.buckets or rows <= 0 or not self.measure_costs:
            return
        b = _row_bucket(rows)
        if may_draft and tokens <= rows * (1 + self.max_draft_len):
            # The least of the last `host_window` readings, not an EMA: a few slow steps (a
            # remote drafter's first round trips, a burst on the machine) priced drafting out,
            # and with no drafting step to re-measure it the reading stayed for hundreds of steps
            # (fp32 at one stream: 5-17 drafting steps of 1,360 with the remote drafter, 1.00x
            # of no drafter, against 1.13x before plain steps were priced as overlapped).
            recent = self._host_recent.setdefault(b, deque(maxlen=self.host_window))
            recent.append(max(0.0, seconds - device_wait))
            self.host[b] = min(recent)
            bare = self._bare_recent.setdefault(b, deque(maxlen=self.host_window))
            bare.append(max(0.0, seconds - device_wait - draft_wait))
            self.host_bare[b] = min(bare)
        i = self._bucket_index(tokens)
        if i is not None:
            self.gpu[i] = _ema(self.gpu[i], device_wait, self.ema)

    # -- the mode ---------------------------------------------------------------------------------
    def observe_rate(
        self,
        generated: int,
        seconds: float,
        rows: int,
        may_draft: bool = True,
        overlapped: bool = False,
    ) -> bool:
        """A step of the current mode with `rows` rows generated `generated` tokens in
        `seconds` (a speculative step's time includes draining the step in flight). True when
        this step ended the mode's window (the mode may change for the next step).
        `may_draft`: whether any of its requests may speculate at all. A step where none may
        (each turned speculation off) decodes plainly in either mode: in the speculative mode
        it is no evidence about speculation and does not count (counted, a stretch of such
        requests pulled speculation's rate to plain decoding's). `overlapped`: a plain step
        launched before the previous one was read. In the speculative mode that is a step the
        cost model gave k = 0 (no request's drafts were worth it), the very step the plain mode
        runs, so it does not count either: speculation's rate is its drafting steps' (with
        the plain steps they drain). Counted, a stretch of requests whose drafts miss (chat,
        where code drafts well) pulled speculation's rate to plain decoding's, the 5 % margin
        then chose plain decoding, and that ran until the next probe, after the requests that
        draft well had come back (bench/RESULTS.md, round 40)."""
        if not self.adaptive:  # a static policy drafts K whatever it measures
            return False
        if self._variant_load and may_draft:
            # Every step of the open speculative window, plain ones included, for its
            # variant's rate by the clock (`_record`); a step where no request may draft runs
            # the same either way and says nothing about the variant.
            span = self._span
            span[0] += generated
            span[1] += seconds
            span[2] += 1
            span[3] += rows
        if self.mode == "spec" and (overlapped or not may_draft):
            if overlapped and may_draft:
                # The cost model drafted nothing for a window's worth of steps in a row: such a
                # window would never end (a probe never give up, a new load never be planned).
                # End it without a rate; the next window starts in the mode best at its load
                # (`_start_window`). Handing the load to plain decoding instead cost ~3 % at
                # one stream in the host-only proxy: one request's stretch of poor drafts
                # turned speculation off for the next (round 40).
                self._spec_idle += 1
                if self._spec_idle >= self.idle_handoff:
                    self._spec_idle = 0
                    self._window = [0.0, 0.0, 0, 0]
                    # The variant's window decoded plainly throughout: that is its rate by the
                    # clock here (else a synchronous window whose host time prices every step
                    # to k = 0 would never end in a record, and keep its load synchronous).
                    self._close_variant(None, None, 1.0)
                    self._probing = False
                    self._planned = 0
                    return True
            return False
        self._spec_idle = 0
        w = self._window
        w[0] += generated
        w[1] += seconds
        w[2] += 1
        w[3] += rows
        moved = self._moved_away(rows)  # (every step: it counts the steps off the plan)
        if w[1] <= 0 or (w[2] < self.first_window and not moved):
            return False
        # Rates depend on the load as much as on the mode: keep them per batch-size bucket,
        # and per row (tokens/s/row), so a window of 5 rows and one of 8 in the same bucket
        # measure the mode, not how many requests happened to be running.
        mean = w[3] / w[2]
        load = _row_bucket(max(1, round(mean)))
        key = (self.mode, load)
        rate = w[0] / w[1] / max(mean, 1.0)
        if moved:  # the next window: the mode best where the load is now
            self._record(load, rate, mean)
            self._planned = _row_bucket(rows)
            self.mode = self._winner(self._planned)
            return True
        if w[2] < self.mode_window and not (w[2] == self.first_window and self._short(key, rate)):
            return False
        seen = self._record(load, rate, mean)
        self.mode = self._next_mode(load, seen)
        self._planned = load
        return True

    def _record(self, load: int, rate: float, rows: float) -> int:
        """Close the current window: its `rate` (per row, `rows` its mean) counts toward its
        mode's rate at `load` by its share of a whole window. Returns the windows seen at
        `load`, this one included."""
        w = self._window
        key = (self.mode, load)
        self.mode_steps[self.mode] += w[2]
        looks = self._looks[key] = self._looks.get(key, 0) + 1
        floor = self._least_weight(rows)
        share = w[2] / self.mode_window
        self.rates[key] = _ema(self.rates.get(key), rate, max(1.0 / looks, floor) * share)
        if self.mode == "spec":
            # Speculation's rate here, against plain decoding, is its faster variant's.
            chosen_for, best = self._close_variant(rate, floor, share)
            if best is not None and chosen_for == load:
                self.rates[key] = best
        self._window = [0.0, 0.0, 0, 0]
        self._probing = False
        self._shifted = 0
        seen = self._windows[load] = self._windows.get(load, 0) + 1
        return seen

    def _least_weight(self, rows: float) -> float:
        """A whole window's least EMA weight at a mean of `rows` rows (`full_weight_rows`)."""
        return self.window_weight * min(1.0, rows / self.full_weight_rows)

    def _close_variant(
        self, rate: float | None, floor: float | None, share: float
    ) -> tuple[int, float | None]:
        """Close the open speculative window's variant (`choice`): its rate by the clock
        counts toward that variant's at the load it was chosen for, weighted as `_record`
        weighs a window (`floor` None: from the window's rows), and `rate` (None: no drafting
        step counted) toward its speculative rate there. The variants are compared
        by the clock, every step counted, not by `rate` (the policy's: only the steps that
        drafted): a synchronous step's host time prices more steps to k = 0, so by that rate
        a synchronous window looks at fewer, better steps (in one CPU-proxy run at one stream it
        put them at 1.18x pipelined ones, and whole passes ran 0.87x as fast synchronous;
        bench/RESULTS.md, round 57). Returns (that load, speculation's rate by the policy's
        count of the faster variant there, or None)."""
        span, self._span = self._span, [0.0, 0.0, 0, 0]
        load, self._variant_load = self._variant_load, 0
        if self.choice is None or not load or span[1] <= 0:
            return load, None
        rows = max(span[3] / max(span[2], 1), 1.0)
        if floor is None:
            floor = self._least_weight(rows)
        clock = span[0] / span[1] / rows
        self.choice.record(load, self._variant, clock, rate, floor, share, int(span[2]))
        return load, self.choice.spec_rate(load)

    def _moved_away(self, rows: int) -> bool:
        """Whether this step's load has been in another bucket than the one the window (not a
        probe) was planned for for `load_shift_steps` steps in a row, where both modes are
        measured and the window's mode trails the other by more than `early_exit` (stored
        rates only: no noisy reading of the window itself decides)."""
        load = _row_bucket(max(1, rows))
        if load == self._planned or not self._planned or self._probing:
            self._shifted = 0  # (a probe measures its load; `_short` ends a hopeless one)
            return False
        self._shifted += 1
        if self._shifted < self.load_shift_steps:
            return False
        other = "plain" if self.mode == "spec" else "spec"
        mine, theirs = self.rates.get((self.mode, load)), self.rates.get((other, load))
        return mine is not None and theirs is not None and mine < theirs * (1 - self.early_exit)

    def _short(self, key: tuple[str, int], rate: float) -> bool:
        """Whether a window that has run `first_window` steps ends now: a probe trailing the
        other mode's rate at this load by more than `early_exit` (checked once, at this step:
        checking every step would stop a noisy probe at its worst moment and bias the loser's
        rate down)."""
        other = self.rates.get(("plain" if key[0] == "spec" else "spec", key[1]))
        gap = self.early_exit if key in self.rates else self.first_look_exit
        return self._probing and other is not None and rate < other * (1.0 - gap)

    def _start_window(self, rows: int) -> None:
        """A window starts with `rows` rows: at the load the last window ended with, or when
        the last window's end chose to measure a mode, run the mode chosen then; at another
        load, the mode best there (measured, or implied by other loads) — not a whole window
        of the last load's mode. Where nothing is known or implied, plain decoding first (it
        cannot lose to serving without a drafter); speculation is then a probe, cut short
        when far behind. Only the very first window, with nothing measured anywhere, keeps
        the starting mode."""
        load = _row_bucket(max(1, rows))
        if load == self._planned or self._probing:
            return
        self._planned = load
        if ("spec", load) in self.rates and ("plain", load) in self.rates:
            self.mode = self._winner(load)
        elif (implied := self._infer(load)) is not None:
            self.mode = implied
        elif self.rates and ("plain", load) in self.rates:  # speculation unmeasured here
            self.mode, self._probing = "spec", True
        elif self.rates:
            self.mode = "plain"

    def _next_mode(self, load: int, seen: int) -> str:
        """The mode of the next window, after `seen` windows at `load` (this one included)."""
        cur = self.mode
        other = "plain" if cur == "spec" else "spec"
        if (other, load) in self.rates:  # both measured here: the better one, or a probe
            best = self._winner(load)
            if self._best.get(load) != best:
                # The winner changed: the mode it beat is next measured on the interval the
                # gap now sets. (A probe time set while the other mode was far behind, up to
                # `max_probe_every` windows away, kept a mode that had just lost by a few
                # per cent out for 20 windows in the 8-stream proxy; round 40.)
                self._best[load] = best
                self._probe_at[load] = seen + self.probe_interval(load)
            probe_at = self._probe_at.setdefault(load, seen + self.probe_interval(load))
            if best == cur and seen >= probe_at:
                self._probe_at[load] = seen + 1 + self.probe_interval(load)
                self._probing = True
                return other
            return best
        # `other` never ran at this load. Take the winner other loads imply, if any; else
        # (or when a probe is due) measure it.
        inferred = self._infer(load)
        if inferred == other:
            return other
        probe_at = self._probe_at.setdefault(load, seen - 1 + self.max_probe_every)
        if inferred is None or seen >= probe_at:
            self._probe_at[load] = seen + 1 + self.probe_every
            self._probing = True
            return other
        return cur

    def _winner(self, load: int) -> str:
        """The better mode at `load` (both measured there). Speculation must beat plain
        decoding by `spec_margin`: a near tie goes to the mode that cannot be slower than
        decoding without a drafter."""
        spec, plain = self.rates[("spec", load)], self.rates[("plain", load)]
        return "spec" if spec > plain * (1.0 + self.spec_margin) else "plain"

    def _infer(self, load: int) -> str | None:
        """The mode that wins at `load` by what was measured at other loads, or None.
        Speculation pays less as the batch grows (the verify step's extra tokens stop riding
        free, host work grows per row): plain winning at a smaller load wins here, speculation
        winning at a larger load wins here. The nearest such load decides."""
        winners = {
            b: self._winner(b)
            for mode, b in self.rates
            if mode == "spec" and ("plain", b) in self.rates
        }
        return implied(winners, load, small="spec", large="plain")

    def probe_interval(self, load: int) -> int:
        """Windows until the losing mode at `load` is measured again (at most one window's
        throughput is lost per probe: one still far behind stops after `first_window` steps;
        `mode_rates.probe_interval`)."""
        spec, plain = self.rates.get(("spec", load)), self.rates.get(("plain", load))
        if not spec or not plain:
            return self.probe_every
        return probe_interval(
            spec, plain, self.probe_budget, self.probe_every, self.max_probe_every
        )

    def ran(self, k: int) -> None:
        """A step was scheduled with draft length `k` (the executor, once per step run)."""
        self.k_steps[min(k, self.max_draft_len)] += 1

    def snapshot(self) -> dict:
        """What the policy has learnt and done, for its metrics, read by another thread while
        the executor's writes it (each copy is one step under the GIL; {} if the cost table
        was being replaced, `seed_costs`, between the reads of its two lists)."""
        try:
            device = dict(zip(self.buckets, self.gpu, strict=True))
        except ValueError:
            return {}
        return dict(
            mode=self.mode,
            mode_steps=dict(self.mode_steps),
            k_steps=list(self.k_steps),
            rates=dict(self.rates),
            windows=dict(self._looks),
            host=dict(self.host),
            exposed=dict(self.exposed),
            device=device,
            accept=self.acceptance.accept,
            has_draft=self.acceptance.has_draft,
            deeper=self.acceptance.deeper,
            pipelining=None if self.choice is None else self.choice.snapshot(),
        )

    # -- per-request acceptance (acceptance.py) ---------------------------------------------------
    @property
    def recovering(self) -> bool:
        """Whether a step without a budget counts toward a request's recovery (acceptance.py):
        only the adaptive speculative mode's k = 0 is the estimate's doing; in the plain mode,
        or static, the estimates decide nothing."""
        return self.adaptive and self.mode == "spec"

    def observe(
        self, req: Request, drafted: int, accepted: int, recovering: bool | None = None
    ) -> None:
        """`req` verified `drafted` drafts this step and accepted the first `accepted`
        (`recovering`: `self.recovering` when the step ran, for an observation made later)."""
        recovering = self.recovering if recovering is None else recovering
        self.acceptance.observe(req, drafted, accepted, recovering)

    def expected_tokens(self, req: Request, k: int) -> tuple[float, float]:
        """(tokens `req` is expected to commit, tokens it feeds) in a step that lets it draft
        `k`, from its estimate (a new request: the population's)."""
        return self.acceptance.table(req)[k]

    def forget(self, req: Request) -> None:
        self.acceptance.forget(req)

    # -- the decision ----------------------------------------------------------------------------
    @property
    def pipelines(self) -> bool:
        """Whether this step's drafts run pipelined (`pipelined`, and the current speculative
        window's variant where `choice` picks one; outside an adaptive policy, always)."""
        if not self.pipelined:
            return False
        return self.choice is None or not self.adaptive or self._variant

    @property
    def plain_until_window_ends(self) -> bool:
        """Whether the next step decodes plainly whatever its rows (adaptive, in the plain
        mode, inside a window): the caller may skip collecting them (a hot path under load)."""
        return self.adaptive and self.mode == "plain" and self._window[2] > 0

    def plain_step(self) -> bool:
        """`plain_until_window_ends`, for the scheduler about to skip `step_draft_len`: when
        True the next step prices no wait for drafts either (`wait_worth_s` cleared)."""
        if self.plain_until_window_ends:
            self.wait_worth_s = None
            self.acceptance.drop_presum()
            return True
        return False

    def step_draft_len(self, decode: list[Request], prefill_tokens: int = 0) -> int:
        """The draft length for a step whose decode rows are `decode` (caps still apply)."""
        if self.adaptive and self._window[2] == 0:
            self._start_window(len(decode) + (1 if prefill_tokens else 0))
            if self.mode != "spec":
                self._span, self._variant_load = [0.0, 0.0, 0, 0], 0
            elif self.choice is not None and not self._variant_load:
                # A speculative window opens: its variant, for the load of its decode rows
                # (a prefill chunk's row would put 32 streams in the 64 bucket).
                self._variant_load = _row_bucket(max(1, len(decode)))
                self._variant = self.choice.variant(self._variant_load)
        self.wait_worth_s = None
        if not self.adaptive or self.mode == "plain" or not decode:
            self.acceptance.drop_presum()  # made for this step only
            # Plain: none. Static, or only prefills finishing this step (their drafts cost
            # little next to the chunk): the maximum, which request caps then trim.
            return 0 if self.adaptive and self.mode == "plain" else self.max_draft_len
        K = self.max_draft_len
        caps = [min(r.useful_drafts, K) for r in decode]
        if not any(caps):
            # No decode row may draft (speculation off for each, or none has room left):
            # every k ties, and pricing them was most of the policy's work on every step of
            # requests that do not speculate.
            self.acceptance.drop_presum()
            return 0
        rows = len(decode) + (1 if prefill_tokens else 0)
        sums = self.acceptance.sums(decode, caps)  # (from `presum`'s when it made them)
        pipelines = self.pipelines
        host = 0.0 if pipelines else self._host(rows)
        best_k, best, free_k, free = 0, -1.0, 0, -1.0
        per_k: list[tuple[float, int]] = []  # (expected committed, tokens fed) per k
        for k, (committed, fed) in enumerate(zip(*sums, strict=True)):
            tokens = math.ceil(fed + prefill_tokens - 1e-9)
            per_k.append((committed, tokens))
            if k == 0:
                goodput = committed / max(self.plain_cost(rows, tokens), 1e-9)
                best, free = goodput, goodput
                continue
            gpu = self.plain_cost(rows, tokens) if pipelines else self._gpu(tokens)
            goodput = committed / max(host + gpu, 1e-9)
            if goodput > best * 1.0001:  # ties go to the shorter draft
                best_k, best = k, goodput
            if committed / max(gpu, 1e-9) > free * 1.0001:
                free_k, free = k, committed / max(gpu, 1e-9)
        if best_k == 0 and free_k > 0 and any(caps):
            # Plain wins only by the host time of a synchronous step at this load. That estimate
            # is refreshed only by such steps, so one stale high reading would keep drafting off
            # for good: every `host_refresh_every` such decisions, draft once to re-measure it
            # (a decision where no row may draft cannot re-measure it and does not count).
            # A window that probes speculation drafts whatever the host estimate says: it is
            # there to measure speculation, and its drafting steps re-measure the host time. (A
            # rare drafting step's host time holds the drafter's catch-up on what was committed
            # since it last drafted; on the H100 at 8 streams one such reading, 1.08 ms against
            # 0.41 in steady drafting, vetoed drafting in 184 of 192 probing steps, so the
            # probes measured plain decoding under speculation's name and it lost to plain:
            # 0.99x of no drafter where static K=8 ran 1.15x; bench/RESULTS.md, round 40.)
            self._host_vetoes += 1
            if self._probing or self._host_vetoes >= self.host_refresh_every:
                self._host_vetoes = 0
                best_k = free_k
        if best_k:
            bare = self._host(rows, self.host_bare)
            self.wait_worth_s = self._wait_worth(bare, per_k[0], per_k[best_k])
        return best_k

    def presum(self, decode: list[Request]) -> None:
        """While the device runs a drafting step: sum the tables of its decode rows, which
        the next step decodes again unless they finish (the sums are most of
        `step_draft_len`'s work: `bench/policy_cost.py`, bench/RESULTS.md round 50). The next
        `step_draft_len` takes them, corrected for the rows that changed
        (`AcceptanceModel.sums`), so it prices the drafts with estimates one step older: what
        the step in between taught is in the step after."""
        caps = [min(r.useful_drafts, self.max_draft_len) for r in decode]
        if self.adaptive and self.mode == "spec" and any(caps):
            self.acceptance.presum(decode, caps)
        else:  # (none may draft: the next step is not priced, `step_draft_len`)
            self.acceptance.drop_presum()

    def _wait_worth(
        self, host: float, without: tuple[float, int], drafted: tuple[float, int]
    ) -> float:
        """How long a step that drafts k may wait for its drafts and still commit tokens
        faster than the same synchronous step without them: the w at which
        committed(k) / (host + gpu(tokens(k)) + w) = committed(0) / (host + gpu(tokens(0))),
        with the host time of a step less its drafter's part (`host_bare`).
        A remote drafter whose reply is on its way waits at most this long
        (`--drafter-wait-rule gain`, remote_patience.py). Negative when drafting does not
        pay even at once (then it is not waited for at all)."""
        (c0, t0), (ck, tk) = without, drafted
        return ck * (host + self._gpu(t0)) / max(c0, 1e-9) - (host + self._gpu(tk))

    def request_cap(self, req: Request, step_k: int) -> int:
        """The drafts `req` may propose this step: the step's k and its own limits, and none
        for a request whose drafts keep missing (`max_misses` drafting steps in a row with
        none accepted; re-tried every
        `explore_every` steps). A budget the drafter leaves unused costs nothing (rows are not
        padded), so how often a drafter has no draft at all never withdraws the budget."""
        cap = min(step_k, req.useful_drafts)
        est = self.acceptance.estimate(req)
        if (
            self.adaptive
            and est is not None
            and est.drafted_steps >= 4
            and est.steps % self.explore_every
            and est.misses >= self.max_misses
        ):
            return 0
        return cap
