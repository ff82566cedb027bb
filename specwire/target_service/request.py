"""The executor's view of one generation request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not imported at run time: the engine child's entry point imports this
    import torch  # module, and the CLI spawns it before anything imports torch)


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks yet (or preempted: will recompute)
    PREFILL = "prefill"  # prompt being written into the KV cache, chunk by chunk
    DECODE = "decode"  # generating; each step verifies 0..K drafts + 1 new token
    FINISHED = "finished"


MIN_TEMPERATURE = 1e-5  # below this a temperature means greedy decoding
MAX_TEMPERATURE = 100.0
PENDING = -1  # an output token whose overlapped step is in flight (`overlap.py`)


@dataclass(frozen=True)
class SamplingConfig:
    """Validated per-request sampling parameters (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # None: no logprobs; k >= 0: each token's logprob plus the k most likely alternatives.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each check is written to reject it.
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 0..20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / temperature overflows to inf (softmax gives NaN);
        # such a distribution is the argmax anyway, so it is decoded greedily.
        return self.temperature < MIN_TEMPERATURE


@dataclass
class SpecStats:
    """Speculation counters; only real drafts count (never executor padding)."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    truncated_draft_tokens: int = 0
    refused_draft_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.histogram) <= accepted:
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1

    def record_many(self, rows: list[tuple[int, int]]) -> None:
        """`record(drafted, accepted)` for each of a step's rows, at once."""
        if not rows:
            return
        accepted = [a for _, a in rows]
        self.steps += len(rows)
        self.draft_tokens += sum(d for d, _ in rows)
        self.accepted_tokens += sum(accepted)
        top = max(accepted)
        if len(self.histogram) <= top:
            self.histogram.extend([0] * (top + 1 - len(self.histogram)))
        hist = self.histogram
        for a in accepted:
            hist[a] += 1

    def record_plain(self, rows: int) -> None:
        """`record(0, 0)` for `rows` plain (draft-free) verifications at once."""
        if rows <= 0:
            return
        self.steps += rows
        if not self.histogram:
            self.histogram.append(0)
        self.histogram[0] += rows

    def merge(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.truncated_draft_tokens += other.truncated_draft_tokens
        self.refused_draft_tokens += other.refused_draft_tokens
        for i, n in enumerate(other.histogram):
            if len(self.histogram) <= i:
                self.histogram.append(0)
            self.histogram[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0


@dataclass(eq=False)
class Request:
    """One request as the executor, scheduler, resource managers and drafters see it.

    Drafters read `token_ids` (prompt + committed output) and `draft_budget`, and write
    `draft_tokens` (UNPADDED, 0..`draft_budget` tokens) and optionally `draft_probs`: the
    drafter contract's mailbox. The executor empties it every step into the step's `Row`
    (sanitised; padded there for the SDPA backend), where the step's drafts live from then on.
    """

    # The server-assigned key every internal table uses (KV blocks, streams, drafter sessions).
    # Unique per request by construction; never the client's id, which is only echoed.
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    max_draft_len: int = 0  # per-request cap (0 = no speculation)
    client_id: str = ""  # the id the client sent (echoed in responses and logs; may repeat)
    max_context_len: int = 0  # the engine's context; 0 = unbounded (unit tests)

    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    # Pipelined drafting steps (`--pipeline-drafts`): the drafts of this request's step in
    # flight, not read yet. Up to that many more of its tokens may already be computed, so
    # its KV reservation and its later positions allow for them (`overlap.py`).
    unread_drafts: int = 0
    # ... and the drafts its latest pipelined step fed (set at each launch; read only while its
    # last output token is that step's placeholder, `PENDING`): a remote drafter drafts the
    # step after on the hypothesis that the target continues its proposal through them. None
    # until a pipelined step ran.
    drafts_in_flight: list[int] | None = None
    # The drafter's output for this step (unpadded); the executor moves it to the Row.
    draft_tokens: list[int] = field(default_factory=list)
    # Optional per-draft-position sparse distributions: list of (ids, probs) pairs.
    draft_probs: list[tuple[list[int], list[float]]] | None = None
    # Set by the scheduler: drafts this step's token budget leaves room for.
    step_draft_cap: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt + committed output (the prefix drafts continue)."""
        return self.prompt_ids + self.output_ids

    def token_at(self, index: int) -> int:
        """`token_ids[index]` without building the list."""
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` without building the whole list (hot path: every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_settled_tokens(self) -> int:
        """`num_tokens` less an output token whose overlapped step is still in flight (its
        placeholder, `PENDING`, ends `output_ids` until the step is read)."""
        n = self.num_tokens
        return n - 1 if self.output_ids and self.output_ids[-1] == PENDING else n

    @property
    def useful_drafts(self) -> int:
        """Drafts that could be used at all (never past max_new_tokens)."""
        if not self.max_draft_len:  # speculation off for this request
            return 0
        out = len(self.output_ids) + self.unread_drafts  # (the worst case in flight)
        remaining = self.max_new_tokens - out - 1
        if self.max_context_len:
            # Verify positions never pass the end of the context: the last committed token
            # sits at num_tokens - 1, its drafts after it, and the bonus token must fit too.
            remaining = min(remaining, self.max_context_len - len(self.prompt_ids) - out - 1)
        return max(0, min(self.max_draft_len, remaining))

    @property
    def draft_budget(self) -> int:
        """Draft tokens a drafter may propose for this request this step. The scheduler sets
        `step_draft_cap` from the draft-length policy, which already caps it by
        `useful_drafts` (hot path: read several times per row per step)."""
        return self.step_draft_cap

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED
