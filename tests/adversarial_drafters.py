"""Drafters that misbehave on purpose; speculation must stay lossless with each of them."""

from __future__ import annotations

import random

from specwire.target_service.drafters.base import Drafter


class RandomDrafter(Drafter):
    """Random in-vocabulary ids, the full budget every step."""

    def __init__(self, max_draft_len: int, vocab_size: int = 512, seed: int = 0) -> None:
        super().__init__(max_draft_len)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def prepare_draft_tokens(self, requests, resources) -> None:
        for req in requests:
            req.draft_tokens = [
                self.rng.randrange(self.vocab_size) for _ in range(req.draft_budget)
            ]


class EmptyDrafter(Drafter):
    def prepare_draft_tokens(self, requests, resources) -> None:
        for req in requests:
            req.draft_tokens = []


class OverlongDrafter(Drafter):
    """Returns far more than the budget: the executor truncates and counts."""

    def prepare_draft_tokens(self, requests, resources) -> None:
        for req in requests:
            toks = req.token_ids
            req.draft_tokens = (toks[-3:] * 20)[: 3 * self.max_draft_len + 5]


class OutOfVocabDrafter(Drafter):
    """Every other step a draft with an id past the vocabulary (and a negative one)."""

    def __init__(self, max_draft_len: int) -> None:
        super().__init__(max_draft_len)
        self.calls = 0

    def prepare_draft_tokens(self, requests, resources) -> None:
        self.calls += 1
        for req in requests:
            bad = [10**9, -1][self.calls % 2]
            req.draft_tokens = [req.token_ids[-1], bad][: req.draft_budget]


class ExplodingDrafter(Drafter):
    """Raises: a drafter bug must fail only that step's requests, never the service."""

    def prepare_draft_tokens(self, requests, resources) -> None:
        raise RuntimeError("drafter exploded")
