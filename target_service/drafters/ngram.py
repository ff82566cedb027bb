"""In-process n-gram (prompt-lookup) drafter over `common.ngram.NGramIndex`."""

from __future__ import annotations

from collections.abc import Sequence

from common.ngram import NGramIndex
from target_service.drafters.base import Drafter
from target_service.request import Request
from target_service.resources.base import ResourceManager, ResourceRegistry


class NGramPool(ResourceManager):
    """Per-request n-gram pools (the spec resource manager of the n-gram drafter)."""

    name = "ngram_pool"

    def __init__(self, max_ngram: int, prefer: str) -> None:
        self.max_ngram = max_ngram
        self.prefer = prefer
        self.pools: dict[str, NGramIndex] = {}

    def index(self, request: Request) -> NGramIndex:
        """The request's pool, brought up to date with its committed tokens."""
        idx = self.pools.get(request.request_id)
        if idx is None:
            idx = self.pools[request.request_id] = NGramIndex(self.max_ngram, self.prefer)
        if len(idx) < request.num_tokens:
            idx.extend(request.tokens_between(len(idx), request.num_tokens))
        return idx

    def free(self, request: Request) -> None:
        self.pools.pop(request.request_id, None)

    def check_integrity(self) -> None:
        for rid, idx in self.pools.items():
            assert len(idx.tokens) >= 0, rid


class NGramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_draft_len: int, max_ngram: int = 3, prefer: str = "latest") -> None:
        super().__init__(max_draft_len)
        self.spec_resource_manager = NGramPool(max_ngram, prefer)

    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        pool = self.spec_resource_manager
        assert isinstance(pool, NGramPool)
        for req in requests:
            req.draft_tokens = pool.index(req).propose(req.draft_budget)
            req.draft_probs = None
