"""Drafts into the step: asked from the drafter, checked as untrusted input, padded where the
backend needs uniform rows — the executor's component for its side of the drafter contract.

Drafters write `Request.draft_tokens` / `draft_probs` (the contract's mailbox, UNPADDED,
0..`draft_budget` tokens); `DraftIntake.prepare` empties that mailbox into each decode row
(`Row.drafts`, `Row.draft_probs`, `Row.pad`): over-long drafts are truncated to the budget
(counted), a draft with an id outside the vocabulary or malformed distributions is refused
whole (counted), incomplete distributions are dropped (the drafts become point masses). A
drafter that raises costs that step its drafts, never the output (fail open).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence

from specwire.target_service.drafters.base import Drafter
from specwire.target_service.request import Request, SpecStats
from specwire.target_service.resources.base import ResourceRegistry
from specwire.target_service.scheduler import Row

log = logging.getLogger(__name__)


class DraftIntake:
    def __init__(
        self,
        drafter: Drafter | None,
        resources: ResourceRegistry,
        *,
        vocab_size: int,
        max_draft_len: int,
        pads: bool,  # the backend needs every decode row padded to one length (SDPA)
        stats: SpecStats,  # the executor's totals (truncated / refused drafts)
    ) -> None:
        self.drafter = drafter
        self.resources = resources
        self.vocab_size = vocab_size
        self.max_draft_len = max_draft_len
        self.pads = pads
        self.stats = stats
        self.errors = 0  # drafter calls that raised (each cost its step's drafts)
        # A drafter that drafts off the critical path (`submit`: the remote one).
        self._submit = getattr(drafter, "submit", None)
        # One that hears requests as they arrive (`Drafter.arrived` overridden: the remote one).
        self._arrived = _overridden(drafter, "arrived")
        # A drafter that takes replies while the device runs (`Drafter.device_running`
        # overridden: the remote one); else the device waits skip the hook altogether.
        self._device_running = _overridden(drafter, "device_running")
        # A drafter whose drafts the runner makes on the device (`--draft-on-device`).
        self._on_device = bool(getattr(drafter, "on_device", False))

    @property
    def hears_steps(self) -> bool:
        """Whether `submit` tells the drafter anything (else the caller may skip it)."""
        return self._submit is not None

    @property
    def hears_arrivals(self) -> bool:
        """Whether `arrived` tells the drafter anything (else the caller may skip it)."""
        return self._arrived is not None

    def arrived(self, requests: Sequence[Request], step_no: int) -> None:
        """Requests the executor just admitted during a speculative step (`Drafter.arrived`).
        Fails open."""
        if self._arrived is None:
            return
        try:
            self._arrived(requests)
        except Exception:
            log.exception("drafter arrival hook failed at step %d", step_no)
            self.errors += 1

    def prepare(
        self,
        rows: Sequence[Row],
        ask_drafter: bool,
        step_no: int,
        device_busy: bool = False,
        wait_worth_s: float | None = None,
        device_done: Callable[[], bool] | None = None,
    ) -> bool:
        """Ask the drafter (unpadded), check its drafts into the rows, then (SDPA) pad every
        row to one length for the whole step. Whether the drafter was asked. `device_busy`:
        another step runs on the device meanwhile (the two-batch overlap), so waiting for the
        drafter costs little, and the drafter is told (`Drafter.device_busy`); so is what a
        wait for drafts is worth this step (`Drafter.wait_worth_s`). `device_done`: a pipelined
        step's, whether the step in flight is done (`Drafter.device_step_done`)."""
        if self.drafter is not None:
            self.drafter.device_busy = device_busy
            self.drafter.wait_worth_s = wait_worth_s
            self.drafter.device_step_done = device_done
        requests = [row.request for row in rows]
        for req in requests:
            req.draft_tokens, req.draft_probs = [], None
        drafting = [r for r in requests if r.draft_budget > 0]
        asked = self.drafter is not None and bool(drafting) and ask_drafter
        if asked:
            try:
                self.drafter.prepare_draft_tokens(drafting, self.resources)
            except Exception:  # fail open: a drafter bug costs speed, never output
                log.exception("drafter failed at step %d; verifying without drafts", step_no)
                self.errors += 1
                for req in drafting:
                    req.draft_tokens, req.draft_probs = [], None
        for row in rows:
            self._check_into(row)
        if self._on_device:  # placeholders, filled on the device (a retry asks for none)
            for row in rows:
                row.on_device = asked and bool(row.drafts)
        # The SDPA backend needs uniform rows: pad to max_draft_len when anyone drafted, else
        # verify 1 token/row. A varlen backend takes each row as it is; the runner pads the
        # step's token count to a captured graph instead.
        pad_to = self.max_draft_len if any(r.drafts for r in rows) else 0
        for row in rows:
            row.pad = pad_to - len(row.drafts) if self.pads else 0
        return asked

    def submit(self, decode: Sequence[Request], step_no: int, device_busy: bool = False) -> None:
        """Drafting off the critical path: a drafter with `submit` (the remote one) hears what
        a step committed right away and drafts while the executor finishes the step; the
        next step's `prepare_draft_tokens` collects. `device_busy`: a step is in flight
        already (an overlapped plain step's submit, a two-batch half's), so the drafter
        should not hold its question back for the next launch. Fails open like drafting
        itself."""
        if self._submit is None:
            return
        self.drafter.device_busy = device_busy
        try:
            self._submit([r for r in decode if not r.finished])
        except Exception:
            log.exception("drafter submit failed at step %d", step_no)
            self.errors += 1

    def launched(self, step_no: int) -> None:
        """A step was just launched on the device: the drafter may send what it held back
        (`Drafter.launched`). Fails open."""
        if self.drafter is None:
            return
        try:
            self.drafter.launched()
        except Exception:
            log.exception("drafter launch hook failed at step %d", step_no)
            self.errors += 1

    def device_running(self, runner, logits, step_no: int) -> None:
        """The executor is about to wait for the launched step `logits` on `runner`: the
        drafter may take replies meanwhile (`Drafter.device_running`, asking
        `runner.ready(logits)`). Fails open."""
        if self._device_running is None:
            return
        try:
            self._device_running(lambda: runner.ready(logits))
        except Exception:
            log.exception("drafter device hook failed at step %d", step_no)
            self.errors += 1

    def _check_into(self, row: Row) -> None:
        """Move the drafter's output from the request's mailbox into the row, checked."""
        req = row.request
        if not req.draft_tokens:  # most rows under load: nothing proposed
            row.drafts, row.draft_probs = [], None
            req.draft_tokens, req.draft_probs = [], None
            return
        drafts = list(req.draft_tokens)
        probs = req.draft_probs
        budget = req.draft_budget
        if len(drafts) > budget:
            req.stats.truncated_draft_tokens += len(drafts) - budget
            self.stats.truncated_draft_tokens += len(drafts) - budget
            drafts = drafts[:budget]
        if probs is not None:
            probs = list(probs)[: len(drafts)]
            if len(probs) != len(drafts):
                probs = None  # incomplete distributions: treat drafts as point masses
        tokens = self._as_tokens(drafts)
        if tokens is None or not self._dists_ok(probs):
            req.stats.refused_draft_tokens += len(drafts)
            self.stats.refused_draft_tokens += len(drafts)
            tokens, probs = [], None
        row.drafts, row.draft_probs = tokens, probs
        req.draft_tokens, req.draft_probs = [], None

    def _as_tokens(self, drafts: list) -> list[int] | None:
        """The drafts as plain int token ids, or None if any is not a real token id (hot path:
        plain ints in range are checked at C speed and kept as they are)."""
        if not drafts:
            return drafts
        if all(type(t) is int for t in drafts):
            return drafts if 0 <= min(drafts) and max(drafts) < self.vocab_size else None
        if not all(self._token_ok(t) for t in drafts):
            return None
        return [int(t) for t in drafts]

    def _token_ok(self, t: object) -> bool:
        """A real token id: an integer (not a bool) inside the vocabulary."""
        return (
            isinstance(t, numbers.Integral)
            and not isinstance(t, bool)
            and 0 <= int(t) < self.vocab_size
        )

    def _dists_ok(self, probs: list | None) -> bool:
        """Draft distributions: per position, (ids, probs) of equal length, ids in the
        vocabulary, probabilities finite and >= 0 with a positive sum."""
        if probs is None:
            return True
        try:
            for ids, ps in probs:
                ids, ps = list(ids), [float(p) for p in ps]
                if len(ids) != len(ps) or not all(self._token_ok(t) for t in ids):
                    return False
                if not all(math.isfinite(p) and p >= 0 for p in ps) or not sum(ps) > 0:
                    return False
        except (TypeError, ValueError):
            return False
        return True


def _overridden(drafter: Drafter | None, hook: str):
    """`drafter`'s bound `hook` when its class overrides `Drafter`'s no-op, else None (the
    executor then skips the call altogether)."""
    if getattr(type(drafter), hook, None) in (None, getattr(Drafter, hook)):
        return None
    return getattr(drafter, hook)
