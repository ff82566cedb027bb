"""Paged KV cache bookkeeping: the block pool and each request's block table.

Invariant: every block is either free or owned by exactly one request (or is the reserved dummy
block that padding rows write to); `free + used + 1 == total`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from common.model.paged import blocks_for
from target_service.request import Request
from target_service.resources.base import ResourceManager


class OutOfBlocks(Exception):
    """Not enough free KV blocks (the scheduler checks first, so this means a bug)."""


class KVCacheManager(ResourceManager):
    """Owns the KV block pool. Block 0 is the dummy block for padding rows; never allocated."""

    name = "kv_cache"
    DUMMY_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int, max_draft_len: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (one is the dummy block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_draft_len = max_draft_len
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tables: dict[str, list[int]] = {}
        # Slots each request needs this step; set by `reserve` via the scheduler's plan.
        self._planned: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def blocks_needed(self, request: Request, num_slots: int) -> int:
        """Extra blocks `request` needs so its table covers `num_slots` tokens."""
        have = len(self._tables.get(request.request_id, ()))
        return max(0, blocks_for(num_slots, self.block_size) - have)

    # -- the step lifecycle ----------------------------------------------------------------------
    def plan(self, request: Request, num_slots: int) -> None:
        """The scheduler decided `request` needs `num_slots` cache slots this step."""
        self._planned[request.request_id] = num_slots

    def prepare(self, batch: Sequence[Request]) -> None:
        for req in batch:
            slots = self._planned.pop(req.request_id, None)
            if slots is not None:
                self.reserve(req, slots)

    def reserve(self, request: Request, num_slots: int) -> None:
        """Grow the request's block table to cover `num_slots` tokens."""
        need = self.blocks_needed(request, num_slots)
        if need > len(self._free):
            raise OutOfBlocks(f"{request.request_id}: need {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request.request_id, [])
        table.extend(self._free.popleft() for _ in range(need))

    def update(self, batch: Sequence[Request], accepted: dict[str, int]) -> None:
        # Keep only the blocks that hold valid KV (rejected drafts' slots are dropped).
        for req in batch:
            if not req.finished:
                self.rewind(req, req.num_computed)

    def rewind(self, request: Request, num_tokens: int) -> None:
        """Shrink the request's table to the blocks that cover its first `num_tokens` tokens."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = blocks_for(num_tokens, self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, request: Request) -> None:
        self._planned.pop(request.request_id, None)
        table = self._tables.pop(request.request_id, None)
        if table:
            self._free.extend(table)

    def check_integrity(self) -> None:
        used = [b for t in self._tables.values() for b in t]
        assert len(used) == len(set(used)), "a KV block is owned twice"
        assert self.DUMMY_BLOCK not in used and self.DUMMY_BLOCK not in self._free
        assert not set(used) & set(self._free), "a KV block is both free and used"
        assert len(self._free) + len(used) + 1 == self.num_blocks, (
            f"KV blocks leaked: free {len(self._free)} + used {len(used)} + dummy 1 "
            f"!= total {self.num_blocks}"
        )
