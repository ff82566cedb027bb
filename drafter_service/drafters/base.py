"""The drafter-side interface: one `SessionDrafter` serves every session of the service.

The service owns sessions (what each target request has committed); a drafter owns only the
per-session *state* it needs to propose (an n-gram pool, a KV cache position, ...). The service
calls, for each session:

    state = drafter.new_state()            # when a session starts or is reset (base_len 0)
    drafter.extend(state, tokens)          # newly committed tokens, in order, never rewritten
    drafter.propose_batch(states, budgets, want_probs)   # once per step, all sessions together
    drafter.release(state)                 # finished, expired or reset: free what it holds

Calls are serialised by the service (a drafter needs no locking of its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

# A sparse distribution over the vocabulary: (ids, probs), probs summing to 1.
SparseDist = tuple[list[int], list[float]]
# One sequence's proposal: draft tokens, and optionally one distribution per draft token.
Proposal = tuple[list[int], list[SparseDist] | None]


class SessionDrafter(ABC):
    """Proposes draft tokens continuing each session's committed tokens.

    Attributes advertised in the handshake (GetInfo):
      name                   e.g. "ngram", "model:tiny-random"
      vocab_size             the vocabulary ids live in; 0 = token-agnostic
      tokenizer_fingerprint  "" = token-agnostic
      capabilities           e.g. ("draft_probs",) when `propose` can return distributions
    """

    name: str = "drafter"
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    capabilities: tuple[str, ...] = ()

    @abstractmethod
    def new_state(self) -> Any:
        """A fresh per-session state holding no tokens."""

    @abstractmethod
    def extend(self, state: Any, tokens: list[int]) -> None:
        """Append committed tokens. Raise ValueError for tokens this drafter cannot hold."""

    @abstractmethod
    def propose(self, state: Any, budget: int, want_probs: bool = False) -> Proposal:
        """Up to `budget` draft tokens continuing the state's tokens (maybe none), unpadded.

        The second element is None, or one sparse distribution per draft token: the exact
        distribution each token was sampled from (a greedy drafter has none to give).
        """

    def propose_batch(
        self, states: Sequence[Any], budgets: Sequence[int], want_probs: bool = False
    ) -> list[Proposal]:
        """One proposal per state; override to batch the work (the model drafter does)."""
        return [self.propose(s, b, want_probs) for s, b in zip(states, budgets, strict=True)]

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook
        """The session ended (finished, expired, reset): free what the state holds."""

    def check_integrity(self, live_states: Sequence[Any]) -> None:  # noqa: B027 - optional hook
        """Raise AssertionError if the drafter's own resources are inconsistent."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Service shutdown."""
