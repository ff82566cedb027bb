"""Continuous batching: which requests run this step, and with how many tokens.

Every step the scheduler walks the running requests (oldest first), then admits waiting ones,
within three budgets: `max_batch_size` rows, `max_num_tokens` tokens, and free KV blocks.
A row feeds the request's committed tokens that are not in the cache yet (one for a steady
decode, a chunk for a prefill); a row that reaches the last committed token is a *decode row*
and also carries up to K draft tokens, so it reserves 1+K slots. When blocks run out, the
youngest running request is preempted: its blocks are freed and it is recomputed later
(its committed tokens are kept, so the output is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specwire.target_service.draft_policy import DraftLengthPolicy
from specwire.target_service.request import Request, RequestState
from specwire.target_service.resources.kv_cache import KVCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    max_num_tokens: int = 2048
    max_draft_len: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_num_tokens < 1 + self.max_draft_len:
            raise ValueError("max_num_tokens must leave room for one decode row (1 + K)")


@dataclass(slots=True)
class Row:
    """One request's share of a step."""

    request: Request
    num_committed: int  # committed tokens fed this step, starting at request.num_computed
    decode: bool  # the row reaches the last committed token: draft, verify, emit
    # Overlapped steps: the row's last committed token is still being computed by the step in
    # flight; it is that step's logit row `feed_src` (the runner gathers it on the device).
    feed_src: int = -1
    # Pipelined drafting steps: this request's row in the step in flight, whose drafts are not
    # read yet. Its accepted count, found on the device, shifts this row's positions (the
    # host staged them for "none accepted"); `slack` is the most it can be.
    after: int = -1
    slack: int = 0
    # This step's drafts for a decode row, as the executor accepted them from the drafter
    # (real, unpadded), their distributions if any, and (SDPA backend only) how many padding
    # tokens follow them. Per-step values travel here, never on the Request.
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[tuple[list[int], list[float]]] | None = None
    pad: int = 0
    # `--draft-on-device`: `drafts` are placeholders the runner fills on the device; the real
    # ones replace them once the step is read (`StepLogits.device_drafts`).
    on_device: bool = False


@dataclass
class ScheduledBatch:
    rows: list[Row] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [r.request for r in self.rows]

    @property
    def may_draft(self) -> bool:
        """Whether any of its requests may speculate at all (a step where none may, each having
        turned speculation off, is no evidence about speculation to the draft-length policy)."""
        return any(r.request.max_draft_len > 0 for r in self.rows)

    @property
    def decode_requests(self) -> list[Request]:
        return [r.request for r in self.rows if r.decode]

    @property
    def decode_rows(self) -> list[Row]:
        return [r for r in self.rows if r.decode]

    def __bool__(self) -> bool:
        return bool(self.rows)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policy: DraftLengthPolicy | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        # The owner of K: the draft length of each step and each request's cap.
        self.policy = policy or DraftLengthPolicy(config.max_draft_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def draft_len(self) -> int:
        """The draft length the policy picks for the next step (before request caps)."""
        if self.policy.plain_step():
            return 0
        decode_next, prefill = [], 0
        for r in self.running:
            left = len(r.prompt_ids) + len(r.output_ids) - r.num_computed  # uncached tokens
            if left == 1:
                decode_next.append(r)
            else:
                prefill += left
        return self.policy.step_draft_len(decode_next, min(prefill, self.config.max_num_tokens))

    def wants_drafts(self, step_k: int) -> bool:
        """Whether any request that may run next step would get a draft budget at `step_k`."""
        if step_k <= 0:
            return False
        cap = self.policy.request_cap
        waiting = list(self.waiting)[: self.config.max_batch_size]
        return any(cap(r, step_k) > 0 for r in self.running) or any(
            cap(r, step_k) > 0 for r in waiting
        )

    def schedule(
        self,
        step_k: int | None = None,
        exclude: frozenset[str] | set[str] = frozenset(),
        max_rows: int | None = None,
        pinned: frozenset[str] | set[str] = frozenset(),
    ) -> ScheduledBatch:
        """Plan the next step. `step_k` overrides the policy's draft length (0: no drafts).
        Two-batch overlap: requests in `exclude` (the step in flight) are neither scheduled
        nor preempted (the device may still write their cache blocks), and the step takes at
        most `max_rows` rows. Requests in `pinned` (a pipelined step's, whose accepted
        counts are not read yet) may be scheduled but are never preempted."""
        batch = ScheduledBatch()
        tokens_left = self.config.max_num_tokens
        free_blocks = self.kv.num_free_blocks
        if exclude:
            queue = [r for r in self.running if r.request_id not in exclude]
        else:
            queue = list(self.running)
        row_limit = self.config.max_batch_size
        if max_rows is not None:
            row_limit = min(row_limit, max_rows)
        if step_k is None:
            step_k = self.draft_len()
        while queue and len(batch.rows) < row_limit and tokens_left > 0:
            req = queue.pop(0)
            row, cost, blocks = self._plan_row(req, tokens_left, step_k)
            while blocks > free_blocks and queue:
                victim = self._victim(queue, pinned)
                if victim is None:
                    break
                free_blocks += len(self.kv.block_table(victim))
                self._preempt(victim, batch)
            if blocks > free_blocks:
                if not exclude:
                    if not batch.rows and req.request_id not in pinned:
                        # Alone and still too big: wait for blocks (never crash, never leak).
                        self._preempt(req, batch)
                    break
                # A step in flight may give blocks back: wait for it, and admit nobody newer
                # meanwhile (they would take the blocks this request is waiting for).
                return batch
            self._commit(row, cost, blocks, batch)
            tokens_left -= cost
            free_blocks -= blocks
        while self.waiting and len(batch.rows) < row_limit and tokens_left > 0:
            req = self.waiting[0]
            row, cost, blocks = self._plan_row(req, tokens_left, step_k)
            if blocks > free_blocks:
                break
            self.waiting.popleft()
            req.state = RequestState.PREFILL
            self.running.append(req)
            self._commit(row, cost, blocks, batch)
            tokens_left -= cost
            free_blocks -= blocks
        return batch

    @staticmethod
    def _victim(queue: list[Request], pinned: frozenset[str] | set[str]) -> Request | None:
        """The youngest running request in `queue` that may give its blocks back."""
        for i in range(len(queue) - 1, -1, -1):
            if queue[i].request_id not in pinned:
                return queue.pop(i)
        return None

    def _plan_row(self, req: Request, tokens_left: int, step_k: int) -> tuple[Row, int, int]:
        remaining = req.num_tokens - req.num_computed
        k = self.policy.request_cap(req, step_k) if step_k > 0 else 0
        if remaining + k <= tokens_left:
            row, cost = Row(req, remaining, decode=True), remaining + k
        elif remaining <= tokens_left:
            # The whole rest fits but not its drafts: decode without speculation this step.
            row, cost = Row(req, remaining, decode=True), remaining
        else:
            row, cost = Row(req, tokens_left, decode=False), tokens_left
        slots = req.num_computed + req.unread_drafts + cost
        return row, cost, self.kv.blocks_needed(req, slots)

    def _commit(self, row: Row, cost: int, blocks: int, batch: ScheduledBatch) -> None:
        req = row.request
        self.kv.plan(req, req.num_computed + req.unread_drafts + cost)
        row.slack = req.unread_drafts
        # The scheduler's budget also caps the drafts the drafter may propose this step.
        req.step_draft_cap = cost - row.num_committed if row.decode else 0
        batch.rows.append(row)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.kv.free(req)
        req.num_computed = 0
        req.state = RequestState.WAITING
        if req in self.running:
            self.running.remove(req)
        self.waiting.appendleft(req)
        batch.preempted.append(req)
