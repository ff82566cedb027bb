"""The KV block pool: the allocation core of every paged KV cache in specwire.

The target's `KVCacheManager` (block tables per request, a reserved dummy block) and the model
drafter's sessions (block lists per session) both hand out blocks from a `BlockPool`; each keeps
its own bookkeeping and states its own invariant on top of the pool's.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of the KV block ids `reserved .. num_blocks - 1` (ids below `reserved` are
    never handed out: the target keeps block 0 for padding rows).

    Invariant: every id in that range is either free or held by a caller, never both, and no id
    is free twice. Blocks are handed out oldest-freed first.
    """

    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        if not 0 <= reserved < num_blocks:
            raise ValueError(f"need 0 <= reserved ({reserved}) < num_blocks ({num_blocks})")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self._free: deque[int] = deque(range(reserved, num_blocks))

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out at all."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def check_integrity(self, used: list[int]) -> None:
        """`used`: every block the callers hold, one entry per holding."""
        free = set(self._free)
        assert len(free) == len(self._free), "a KV block is free twice"
        assert len(set(used)) == len(used), "a KV block is owned twice"
        assert not free & set(used), "a KV block is both free and used"
        assert all(self.reserved <= b < self.num_blocks for b in (*free, *used)), (
            "a reserved or out-of-range KV block is in use"
        )
        assert len(free) + len(used) == self.capacity, (
            f"KV blocks leaked: free {len(free)} + used {len(used)} != {self.capacity}"
        )
