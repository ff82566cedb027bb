"""The drafter contract: one `SessionDrafter` interface, used in-process by the target and behind
the drafter service.

Whoever runs the drafter owns the *sessions* (what each target request has committed): the
target's `SessionDrafterAdapter` (specwire/target_service/drafters/session.py) keeps one per
request, the
drafter service's `SessionStore` one per (caller, request). A drafter owns only the per-session
*state* it needs to propose (an n-gram index, KV blocks and what they cache, ...). Per session:

    state = drafter.new_state()            # a session starts (or restarts from token 0)
    drafter.extend(state, tokens)          # newly committed tokens, in order, never rewritten
    drafter.propose_batch(states, budgets, want_probs)   # once per step, all sessions together
    drafter.release(state)                 # finished, expired or reset: free what it holds

Calls are serialised by the runner (a drafter needs no locking of its own). The same class runs
in either place: `specwire target --drafter mod:Class` or `specwire drafter --drafter mod:Class`
behind `specwire target --drafter grpc://...`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from specwire.common.errors import UserError

# The drafter protocol version (drafter.proto): the target refuses a drafter speaking another.
PROTOCOL_VERSION = 1

# The most alternatives per draft position a target may ask for (SequenceUpdate.max_branches).
MAX_BRANCHES = 16

# A sparse distribution over the vocabulary: (ids, probs), probs summing to 1.
SparseDist = tuple[list[int], list[float]]


class Proposal(NamedTuple):
    """One sequence's proposal: draft tokens (unpadded, maybe none), and optionally one
    distribution per draft token. A plain `(tokens, probs)` tuple is accepted too."""

    tokens: list[int]
    probs: list[SparseDist] | None = None


class Branch(NamedTuple):
    """Another way a sequence may go: should the target commit the proposal's first `position`
    tokens and then `token` (not the proposal's own token there), `tokens` continue from
    there. A remote target keeps these next to the proposal, so a step that rejects a draft
    has the next step's drafts at once instead of a round trip later."""

    position: int
    token: int
    tokens: list[int]


class SessionDrafter(ABC):
    """Proposes draft tokens continuing each session's committed tokens.

    Attributes (advertised in the drafter service's handshake, checked by the target in-process):
      name                   e.g. "ngram", "model:tiny-random"
      vocab_size             the vocabulary ids live in; 0 = token-agnostic
      tokenizer_fingerprint  "" = token-agnostic
      capabilities           e.g. ("draft_probs",) when `propose` can return distributions,
                             "branches" when `alternatives` gives any
      cheap                  True when extend/propose take microseconds (a lookup): the
                             drafter service then runs them on its event loop, not a worker
                             thread — one thread hop less per message
    """

    name: str = "drafter"
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    capabilities: tuple[str, ...] = ()
    cheap: bool = False

    @abstractmethod
    def new_state(self) -> Any:
        """A fresh per-session state holding no tokens."""

    @abstractmethod
    def extend(self, state: Any, tokens: list[int]) -> None:
        """Append committed tokens. Raise ValueError for tokens this drafter cannot hold."""

    @abstractmethod
    def propose(self, state: Any, budget: int, want_probs: bool = False) -> Proposal:
        """Up to `budget` draft tokens continuing the state's tokens (maybe none), unpadded.

        `probs` is None, or one sparse distribution per draft token: the exact distribution
        each token was sampled from (a greedy drafter has none to give).
        """

    def propose_batch(
        self, states: Sequence[Any], budgets: Sequence[int], want_probs: bool = False
    ) -> list[Proposal]:
        """One proposal per state; override to batch the work (the model drafter does)."""
        return [self.propose(s, b, want_probs) for s, b in zip(states, budgets, strict=True)]

    def alternatives(
        self, state: Any, proposal: list[int], positions: int, per_position: int, horizon: int
    ) -> list[Branch]:
        """Optional ("branches" capability): at each of the first `positions` positions of
        `proposal` (which continues the state's tokens), up to `per_position` other tokens
        the sequence may take there, each with up to `horizon - position - 1` tokens that
        would follow it. Called right after `propose`, only by the drafter service (an
        in-process drafter always drafts from what was committed)."""
        return []

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook
        """The session ended (finished, expired, reset): free what the state holds."""

    def check_integrity(self, live_states: Sequence[Any]) -> None:  # noqa: B027 - optional hook
        """Raise AssertionError if the drafter's own resources are inconsistent."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Shutdown: release devices, files, threads."""


def check_compatible(
    where: str,
    drafter_name: str,
    vocab_size: int,
    tokenizer_fingerprint: str,
    target_vocab_size: int,
    target_fingerprint: str,
) -> None:
    """Raise UserError (one line) when a drafter's ids cannot be the target's: another
    vocabulary size or another tokenizer. 0 / "" on the drafter's side mean token-agnostic."""
    if vocab_size and vocab_size != target_vocab_size:
        raise UserError(
            f"{where} ({drafter_name}) has vocabulary size {vocab_size}, "
            f"the target model has {target_vocab_size}"
        )
    fp = tokenizer_fingerprint
    if fp and target_fingerprint and fp != target_fingerprint:
        raise UserError(
            f"{where} ({drafter_name}) uses another tokenizer "
            f"(fingerprint {fp[:12]}, the target's is {target_fingerprint[:12]})"
        )
