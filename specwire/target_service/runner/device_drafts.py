"""Drafting on the device: the n-gram drafter's lookup where the step runs, no host in between.

`--draft-on-device` (with `--drafter ngram`). The executor gives each drafting decode row
placeholder drafts (as many as its budget); the runner fills them on the device before the
model runs, from the row's committed tokens, and the host learns them with the step's argmax.
The host's n-gram lookups (~10 µs a row) leave the step's critical path; nothing else changes:
the drafts are exactly those `NGramIndex.propose` gives (the device lookup is checked against
it), so the steps, acceptance and output are those of the in-process n-gram drafter.

The committed tokens live in a **token cache** beside the KV cache: one token id per KV slot,
written by every step for the tokens it feeds, as the attention writes their K/V (and so
rewritten on preemption's re-feed, and garbage past a row's length exactly where the KV is). A
row's lookup reads its first `num_computed + fed committed` tokens through its block table.
A drafted token is written into the step's ids and into the cache at its slot, so an accepted
one is committed context for the next lookup.

On CUDA the lookup is one Triton launch (`triton_ngram`), inside the step's graph; elsewhere
(the CPU's SDPA path, which tests the plumbing) `NGramIndex` itself runs on the cache's tokens.
"""

from __future__ import annotations

import torch

from specwire.common.ngram import NGramIndex


class DeviceDrafts:
    def __init__(
        self,
        num_slots: int,
        block_size: int,
        max_draft_len: int,
        max_ngram: int,
        vote: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.vote = vote
        # One id per KV slot, and a scratch entry where padding (slot -1) writes.
        self.cache = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.scratch = num_slots
        self.kmax = max(1, max_draft_len)
        self._kernel = None
        if device.type == "cuda":
            from specwire.common.model.triton_ngram import ngram_drafts

            self._kernel = ngram_drafts

    def store(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """The step's fed token ids into the cache at their slots (graph-capturable)."""
        where = torch.where(slots >= 0, slots, torch.full_like(slots, self.scratch))
        self.cache.index_copy_(0, where, ids)

    def draft(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        caps: torch.Tensor,
        offsets: torch.Tensor,
        drafts_out: torch.Tensor,
        found_out: torch.Tensor,
    ) -> None:
        """Each row's drafts (rows with cap 0 do not draft) into `ids`, the cache and
        `drafts_out` [B, kmax]; `found_out` [B] says which rows have any."""
        if self._kernel is not None:
            self._kernel(
                self.cache, tables, lengths, caps, offsets, ids, slots, drafts_out, found_out,
                block_size=self.block_size, max_ngram=self.max_ngram, vote=self.vote,
            )  # fmt: skip
            return
        found_out.zero_()
        bs = self.block_size
        for r, (n, cap, off) in enumerate(
            zip(lengths.tolist(), caps.tolist(), offsets.tolist(), strict=True)
        ):
            if cap <= 0:
                continue
            pos = torch.arange(n, device=tables.device)
            seq = self.cache[tables[r, pos // bs].long() * bs + pos % bs].tolist()
            index = NGramIndex(self.max_ngram, vote=self.vote)
            index.extend(seq)
            got = index.propose(cap)
            if not got:
                continue
            toks = torch.tensor(got, dtype=ids.dtype, device=ids.device)
            drafts_out[r, :cap] = toks
            found_out[r] = True
            ids[off : off + cap] = toks
            at = slots[off : off + cap]
            keep = at >= 0
            self.cache[at[keep]] = toks[keep]
