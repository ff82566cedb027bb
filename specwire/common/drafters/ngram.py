"""The n-gram (prompt-lookup) drafter: specwire.common.ngram.NGramIndex per session,
token-agnostic."""

from __future__ import annotations

from specwire.common.drafting import Branch, Proposal, SessionDrafter
from specwire.common.ngram import DEFAULT_MAX_NGRAM, VOTE, NGramIndex


class NGramDrafter(SessionDrafter):
    """Proposes the continuation of the longest earlier match of the sequence's suffix."""

    name = "ngram"
    cheap = True  # a few memory scans per proposal
    capabilities = ("branches",)

    def __init__(
        self, max_ngram: int = DEFAULT_MAX_NGRAM, prefer: str = "latest", vote: int = VOTE
    ) -> None:
        NGramIndex(max_ngram, prefer, vote)  # validate the settings once, at start-up
        self.max_ngram = max_ngram
        self.prefer = prefer
        self.vote = vote

    def new_state(self) -> NGramIndex:
        return NGramIndex(self.max_ngram, self.prefer, self.vote)

    def extend(self, state: NGramIndex, tokens: list[int]) -> None:
        state.extend(tokens)

    def propose(self, state: NGramIndex, budget: int, want_probs: bool = False) -> Proposal:
        # A lookup is deterministic: no distribution to report (the target uses point masses).
        return Proposal(state.propose(budget))

    def alternatives(
        self,
        state: NGramIndex,
        proposal: list[int],
        positions: int,
        per_position: int,
        horizon: int,
    ) -> list[Branch]:
        return [Branch(*b) for b in state.alternatives(proposal, positions, per_position, horizon)]
