"""Paged KV cache bookkeeping: each request's block table over a `BlockPool`
(specwire/common/kv_blocks.py).

Invariant: every block is either free or owned by exactly one request (or is the reserved dummy
block that padding rows write to); `free + used + 1 == total`.
"""

from __future__ import annotations

from collections.abc import Sequence

from specwire.common.kv_blocks import BlockPool
from specwire.common.model.paged import blocks_for
from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager


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
        self._pool = BlockPool(num_blocks, reserved=self.DUMMY_BLOCK + 1)
        self._tables: dict[str, list[int]] = {}
        # Slots each request needs this step; set by `reserve` via the scheduler's plan.
        self._planned: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

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
        planned, tables, bs = self._planned, self._tables, self.block_size
        for req in batch:
            slots = planned.pop(req.request_id, None)
            if slots is None:
                continue
            table = tables.get(req.request_id)
            if table is not None and len(table) * bs >= slots:
                continue  # covered already (most decode steps)
            self.reserve(req, slots)

    def reserve(self, request: Request, num_slots: int) -> None:
        """Grow the request's block table to cover `num_slots` tokens."""
        need = self.blocks_needed(request, num_slots)
        if need == 0 and request.request_id in self._tables:  # most decode steps
            return
        got = self._pool.allocate(need)
        if got is None:
            raise OutOfBlocks(
                f"{request.request_id}: need {need} blocks, {self.num_free_blocks} free"
            )
        self._tables.setdefault(request.request_id, []).extend(got)

    def update(self, batch: Sequence[Request], accepted: dict[str, int]) -> None:
        # Keep only the blocks that hold valid KV (rejected drafts' slots are dropped), and
        # those a pipelined step in flight may still fill (its drafts, not read yet).
        for req in batch:
            if not req.finished:
                self.rewind(req, req.num_computed + req.unread_drafts)

    def rewind(self, request: Request, num_tokens: int) -> None:
        """Shrink the request's table to the blocks that cover its first `num_tokens` tokens."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = blocks_for(num_tokens, self.block_size)
        if len(table) > keep:
            self._pool.free(table[keep:][::-1])  # last block first, as before
            del table[keep:]

    def free(self, request: Request) -> None:
        self._planned.pop(request.request_id, None)
        table = self._tables.pop(request.request_id, None)
        if table:
            self._pool.free(table)

    def check_integrity(self) -> None:
        """The pool's invariant over all block tables; the dummy block is never in one."""
        used = [b for t in self._tables.values() for b in t]
        assert self.DUMMY_BLOCK not in used, "the dummy block is in a block table"
        self._pool.check_integrity(used)
