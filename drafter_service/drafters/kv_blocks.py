"""The model drafter's own KV block allocator (the drafter service has no target KV manager)."""

from __future__ import annotations


class BlockAllocator:
    """A free list of KV block ids. Invariant: free + used == total, no id in both."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def check_integrity(self, used: list[int]) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert len(set(used)) == len(used), "a block is owned twice"
        assert not free & set(used), "a block is both free and used"
        assert len(free) + len(used) == self.num_blocks, (
            f"free {len(free)} + used {len(used)} != total {self.num_blocks}"
        )
