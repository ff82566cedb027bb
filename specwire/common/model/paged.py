"""The paged KV layout, in one place: which cache slot holds token t of a sequence.

A sequence's K/V live in fixed-size blocks listed by its block table; token t sits at slot
`table[t // block_size] * block_size + t % block_size` of the flat cache. Everything that maps
tokens to slots or counts blocks (the KV cache manager, input preparation, the drafter's model,
the tests' reference runner) uses these functions.
"""

from __future__ import annotations

from collections.abc import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def slot_of(table: Sequence[int], t: int, block_size: int, dummy_block: int = -1) -> int:
    """Flat slot of token t; past the table's end, a slot of `dummy_block` (or -1 for none)."""
    i = t // block_size
    if i < len(table):
        return table[i] * block_size + t % block_size
    return dummy_block * block_size + t % block_size if dummy_block >= 0 else -1


def slots_of(
    table: Sequence[int], start: int, count: int, block_size: int, dummy_block: int = -1
) -> list[int]:
    """Slots of tokens start .. start+count-1 (see `slot_of`; block ids are >= 0), a block's
    run at a time: a prompt chunk costs a few list extends, not a Python call per token."""
    if count == 1:
        return [slot_of(table, start, block_size, dummy_block)]
    out: list[int] = []
    t, end, n = start, start + count, len(table)
    while t < end:
        i, off = divmod(t, block_size)
        take = min(block_size - off, end - t)
        block = table[i] if i < n else dummy_block
        if block < 0:
            out.extend([-1] * take)
        else:
            first = block * block_size + off
            out.extend(range(first, first + take))
        t += take
    return out
