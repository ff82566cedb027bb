"""The n-gram drafter's lookup on the device, one program a row, inside the step's CUDA graph.

It proposes exactly what `specwire.common.ngram.NGramIndex.propose` does (prefer="latest"), from
a row's committed tokens read through its block table out of the token cache (one token id per
KV slot: `runner.device_drafts.TokenCache`):

- the longest suffix of the sequence (up to `MAX_NGRAM` tokens, fewer than the sequence) that
  occurred earlier with a token after it;
- of its latest `VOTE` occurrences, the first whose next token most of them share;
- what followed that occurrence, continued periodically (copy with overlap) to the budget.

Pass 1 finds the longest match over the row's real length, BLOCK positions at a time (the match
ending before a position is `MAX_NGRAM` comparisons of the sequence with itself shifted); pass 2
walks back from the end, block by block, until it holds the latest VOTE occurrences; then the
vote and the copy. The drafts go where the step feeds them: into the step's token ids at the
row's draft offset and into the token cache at those tokens' slots (an accepted draft is then
committed context for the next lookup), and into `drafts_out` for the host's verification.
`bench/device_ngram.py` checks it against the index and times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import _index


@triton.jit
def _tok(cache_ptr, table_ptr, pos, mask, BS: tl.constexpr):
    """Token `pos` of a row through its block table (`paged.slot_of`'s layout)."""
    block = tl.load(table_ptr + pos // BS, mask=mask, other=0)
    return tl.load(cache_ptr + block.to(tl.int64) * BS + pos % BS, mask=mask, other=-1)


@triton.jit
def _match(cache_ptr, table_ptr, e, length, longest, MAX_NGRAM: tl.constexpr, BS: tl.constexpr):
    """Per position e: how many of the row's last tokens end right before it (0 where e is not
    an occurrence's follower), up to `longest`. The loads are masked by position only, not by
    the match so far, so that the MAX_NGRAM of them do not wait for each other."""
    valid = (e >= 1) & (e <= length - 1)
    run = valid
    m = tl.zeros(e.shape, dtype=tl.int32)
    for t in tl.static_range(MAX_NGRAM):
        last = _tok(cache_ptr, table_ptr, tl.maximum(length - 1 - t, 0), length > 0, BS)
        src = e - 1 - t
        ok = valid & (src >= 0) & (t < longest)
        run = run & ok & (_tok(cache_ptr, table_ptr, src, ok, BS) == last)
        m += run.to(tl.int32)
    return m


@triton.jit
def _ngram_kernel(
    cache_ptr, table_ptr, table_stride, len_ptr, cap_ptr, off_ptr, ids_ptr, slots_ptr,
    drafts_ptr, found_ptr,
    BS: tl.constexpr, KMAX: tl.constexpr, KMAX_P2: tl.constexpr,
    MAX_NGRAM: tl.constexpr, VOTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    table = table_ptr + row * table_stride
    cap = tl.load(cap_ptr + row).to(tl.int32)
    length = tl.where(cap > 0, tl.load(len_ptr + row).to(tl.int32), 0)  # 0: nothing to do
    longest = tl.minimum(length - 1, MAX_NGRAM)
    offs = tl.arange(0, BLOCK)
    best = 0
    for start in range(0, _index(length), BLOCK):
        m = _match(cache_ptr, table, start + offs, length, longest, MAX_NGRAM, BS)
        best = tl.maximum(best, tl.max(m, axis=0))
    slots = tl.arange(0, VOTE)
    tops = tl.full([VOTE], -1, dtype=tl.int32)
    count = 0
    start = (tl.maximum(length - 1, 0) // BLOCK) * BLOCK
    while (start >= 0) & (count < VOTE) & (best > 0):
        e = start + offs
        m = _match(cache_ptr, table, e, length, longest, MAX_NGRAM, BS)
        cand = tl.where(m == best, e, -1)
        for _ in tl.static_range(VOTE):  # this block's latest candidates, latest first
            top = tl.max(cand, axis=0)
            take = (top >= 0) & (count < VOTE)
            tops = tl.where((slots == count) & take, top, tops)
            count += take.to(tl.int32)
            cand = tl.where(cand == top, -1, cand)
        start -= BLOCK
    seen = tops >= 0
    nexts = _tok(cache_ptr, table, tl.maximum(tops, 0), seen, BS)
    same = (nexts[:, None] == nexts[None, :]) & seen[None, :]
    votes = tl.sum(same.to(tl.int32), axis=1)
    score = tl.where(seen, votes * VOTE - slots, -1)  # ties: the latest occurrence
    pick = tl.argmax(score, axis=0)
    first = tl.maximum(tl.sum(tl.where(slots == pick, tops, 0), axis=0), 0)
    period = tl.maximum(length - first, 1)
    steps = tl.arange(0, KMAX_P2)
    want = (steps < cap) & (best > 0)
    drafts = _tok(cache_ptr, table, first + steps % period, want, BS)
    tl.store(drafts_ptr + row * KMAX + steps, drafts, mask=want)
    at = tl.load(off_ptr + row).to(tl.int64) + steps
    tl.store(ids_ptr + at, drafts, mask=want)
    slot = tl.load(slots_ptr + at, mask=want, other=-1)
    tl.store(cache_ptr + slot, drafts, mask=want & (slot >= 0))
    tl.store(found_ptr + row, (best > 0) & (cap > 0))


def ngram_drafts(
    cache: torch.Tensor,  # [S] int64 token ids by KV slot
    tables: torch.Tensor,  # [B, M] int32 block tables (row order)
    lengths: torch.Tensor,  # [B] committed tokens of each row (in the cache)
    caps: torch.Tensor,  # [B] drafts wanted (0: the row does not draft on the device)
    offsets: torch.Tensor,  # [B] flat index of each row's first draft in `ids`
    ids: torch.Tensor,  # [T] the step's token ids (drafts are written here)
    slots: torch.Tensor,  # [T] the step's KV slots (-1: none)
    drafts_out: torch.Tensor,  # [B, kmax] the drafts, for the host
    found_out: torch.Tensor,  # [B] bool: the row has drafts
    *,
    block_size: int,
    max_ngram: int,
    vote: int,
    block: int = 1024,
) -> None:
    """One launch for `tables.shape[0]` rows (a row with cap 0 only clears its `found`). At
    1,024 positions a block, 8 warps: 93 registers a thread and no spills on sm_90, where 4
    warps need 128 and spill (Triton 3.6's ptxas)."""
    rows, kmax = drafts_out.shape
    _ngram_kernel[(rows,)](
        cache, tables, tables.stride(0), lengths, caps, offsets, ids, slots, drafts_out,
        found_out, BS=block_size, KMAX=kmax, KMAX_P2=triton.next_power_of_2(kmax),
        MAX_NGRAM=max_ngram, VOTE=vote, BLOCK=block, num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip
