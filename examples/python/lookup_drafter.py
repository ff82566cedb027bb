"""An example user-provided drafter. Run it with (repository root on PYTHONPATH)

    specwire target --drafter examples.python.lookup_drafter:LastOccurrenceDrafter

or use any `module:Class` importable from your environment.

Contract: constructed as `Class(max_draft_len=K)`; `prepare_draft_tokens(requests, resources)`
sets `request.draft_tokens` to 0..`request.draft_budget` tokens (UNPADDED) for each request.
It may bring its own resource manager as `spec_resource_manager`: the executor registers it
before warm-up and calls its prepare/update/free hooks for every request.
"""

from __future__ import annotations

from target_service.drafters.base import Drafter
from target_service.resources.base import ResourceManager


class _LastSeen(ResourceManager):
    """Per request: token -> index of its last occurrence (built incrementally)."""

    name = "last_occurrence"

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, dict[int, int]]] = {}

    def prepare(self, batch) -> None:
        for req in batch:
            seen, table = self.tables.get(req.request_id, (0, {}))
            toks = req.token_ids
            for i in range(seen, len(toks) - 1):
                table[toks[i]] = i
            self.tables[req.request_id] = (max(seen, len(toks) - 1), table)

    def free(self, request) -> None:
        self.tables.pop(request.request_id, None)

    def check_integrity(self) -> None:
        for rid, (seen, table) in self.tables.items():
            assert all(i < seen for i in table.values()), rid


class LastOccurrenceDrafter(Drafter):
    """Drafts what followed the last earlier occurrence of the current token."""

    name = "last-occurrence"

    def __init__(self, max_draft_len: int) -> None:
        super().__init__(max_draft_len)
        self.spec_resource_manager = _LastSeen()

    def prepare_draft_tokens(self, requests, resources) -> None:
        tables = self.spec_resource_manager.tables
        for req in requests:
            toks = req.token_ids
            _, table = tables.get(req.request_id, (0, {}))
            i = table.get(toks[-1])
            req.draft_tokens = toks[i + 1 : i + 1 + req.draft_budget] if i is not None else []
