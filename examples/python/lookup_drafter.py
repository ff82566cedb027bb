"""An example user drafter, written once for both places it can run (repository root on
PYTHONPATH, or any `module:Class` importable from your environment):

    specwire target --drafter examples.python.lookup_drafter:LastOccurrenceDrafter    # in-process

    specwire drafter --drafter examples.python.lookup_drafter:LastOccurrenceDrafter   # a service
    specwire target --drafter grpc://127.0.0.1:50152

Contract (specwire/common/drafting.py, `SessionDrafter`): built as `Class()`; one state per
sequence,
`extend(state, tokens)` appends committed tokens, `propose(state, budget)` returns up to
`budget` draft tokens (unpadded, maybe none) and optionally their distributions. Whoever runs
it keeps the sessions and releases them when a request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.common.drafting import Proposal, SessionDrafter


@dataclass
class LastSeen:
    """One sequence: its tokens, and token -> index of its last occurrence before the end."""

    tokens: list[int] = field(default_factory=list)
    last: dict[int, int] = field(default_factory=dict)


class LastOccurrenceDrafter(SessionDrafter):
    """Drafts what followed the last earlier occurrence of the current token."""

    name = "last-occurrence"  # token-agnostic: vocab_size 0, no tokenizer fingerprint

    def new_state(self) -> LastSeen:
        return LastSeen()

    def extend(self, state: LastSeen, tokens: list[int]) -> None:
        # The previous last token now has a successor: index it, then all new but the last.
        start = len(state.tokens) - 1
        state.tokens.extend(tokens)
        for i in range(max(start, 0), len(state.tokens) - 1):
            state.last[state.tokens[i]] = i

    def propose(self, state: LastSeen, budget: int, want_probs: bool = False) -> Proposal:
        if not state.tokens:
            return Proposal([])
        i = state.last.get(state.tokens[-1])
        if i is None:
            return Proposal([])
        return Proposal(state.tokens[i + 1 : i + 1 + budget])

    def check_integrity(self, live_states) -> None:
        for s in live_states:
            assert all(i < len(s.tokens) - 1 for i in s.last.values()), "index past the end"
