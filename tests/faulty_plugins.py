"""Plugins that fail on purpose, for the isolation tests (loaded as `faulty_plugins:Class`)."""

from __future__ import annotations

from specwire.target_service.drafters.base import Drafter
from specwire.target_service.resources.base import ResourceManager

# A request whose prompt starts with these token ids makes `PoisonManager.prepare` raise.
POISON_IDS = [7, 7, 7, 7, 7, 7]


class PoisonManager(ResourceManager):
    """Raises in `prepare` whenever a poisoned request is in the batch, and in `free` always."""

    name = "poison"

    def prepare(self, batch) -> None:
        if any(r.prompt_ids[: len(POISON_IDS)] == POISON_IDS for r in batch):
            raise RuntimeError("poisoned request in the batch")

    def free(self, request) -> None:
        raise RuntimeError("free() is broken in this plugin")


class PoisonDrafter(Drafter):
    """An n-gram-free drafter whose resource manager fails steps that hold a poisoned request.

    Drafts are the last token repeated (often rejected): the point is the failing manager."""

    def __init__(self, max_draft_len: int) -> None:
        super().__init__(max_draft_len)
        self.spec_resource_manager = PoisonManager()

    def prepare_draft_tokens(self, requests, resources) -> None:
        for req in requests:
            req.draft_tokens = [req.token_ids[-1]] * req.draft_budget


class BoolDrafter(Drafter):
    """Drafts `True` (an int subclass) and distributions with out-of-vocabulary ids."""

    def prepare_draft_tokens(self, requests, resources) -> None:
        for i, req in enumerate(requests):
            n = req.draft_budget
            if i % 2:
                req.draft_tokens = [True] * n
            else:
                req.draft_tokens = [req.token_ids[-1]] * n
                req.draft_probs = [([10**9], [1.0])] * n


class ExitingDrafter(Drafter):
    """Calls sys.exit() inside a step: the executor thread dies; the supervisor must notice."""

    def prepare_draft_tokens(self, requests, resources) -> None:
        raise SystemExit(3)
