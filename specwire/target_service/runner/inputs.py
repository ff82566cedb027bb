"""Input preparation: scheduled rows -> flat token tensors + attention metadata.

Everything is built on the host as Python lists and copied to the device once per tensor.
Padding draft positions beyond a request's reserved slots, and whole dummy rows, write into
the reserved dummy KV block, so they can never corrupt a real sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwire.common.model.attention import AttentionMetadata
from specwire.common.model.paged import blocks_for, slot_of, slots_of
from specwire.target_service.scheduler import Row


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits are needed, in decode-row order: [N]
    logits_index: torch.Tensor | None
    # For each decode row (in `rows` order): (offset into logits, positions = 1 + padded drafts)
    logit_spans: list[tuple[int, int]]
    num_rows: int  # real rows
    uniform_q: int  # > 0 when every row feeds exactly q tokens (graph-capturable shape)
    # (flat token index, previous step's logit row): tokens the step in flight computes
    feed: list[tuple[int, int]]


@dataclass
class VarlenStep:
    """A step in the varlen layout, on the host: rows of any lengths, no padding anywhere.

    Row r's tokens are ids[cu[r]:cu[r+1]]; its context after this step is seq_lens[r];
    logits are taken at flat token indices `logit_rows`, and `spans` index into those."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]  # [B+1]
    seq_lens: list[int]  # [B]
    tables: list[list[int]]  # [B][<= M] block ids covering each row's context
    logit_rows: list[int]
    spans: list[tuple[int, int]]  # per decode row: (offset into logits, 1 + real drafts)
    # (flat token index, previous step's logit row) for tokens the step in flight computes:
    # their ids here are placeholders, gathered on the device from that step's argmax.
    feed: list[tuple[int, int]]
    # Drafting on the device: per row (committed length, drafts to make, first draft's flat
    # index); set by the runner when a row of the step drafts on the device
    # (`ModelRunner._drafting`); None for a step where none does.
    drafting: tuple[list[int], list[int], list[int]] | None = None
    # Pipelined drafting steps (`RunnerConfig.pipelined`): per row, its row in the step
    # before whose accepted count shifts it (-1: none), and what verifying it needs on the
    # device (flat index of its first draft, its first logit row, its drafts).
    after: list[int] | None = None
    verify: tuple[list[int], list[int], list[int]] | None = None
    shifted: bool = False  # some row has a row in the step before (`after` >= 0)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)


class InputPreparer:
    def __init__(self, block_size: int, max_blocks_per_seq: int, dummy_block: int, device):
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.dummy_block = dummy_block
        self.device = device
        self.max_position = max_blocks_per_seq * block_size - 1

    def row_tokens(self, row: Row) -> tuple[list[int], int]:
        """Tokens a row feeds (uncached committed tokens, then padded drafts) and its start."""
        req = row.request
        start = req.num_computed
        toks = req.tokens_between(start, start + row.num_committed)
        if row.decode:
            toks = toks + row.drafts + [0] * row.pad
        return toks, start

    def prepare(
        self, rows: list[Row], tables: list[list[int]], shifts: list[int] | None = None
    ) -> PreparedInputs:
        """Rows -> the SDPA layout. `shifts`: per row, positions to move its tokens by (a
        pipelined step's rows, for the accepted counts of the step before: their ids stay,
        their positions, slots and context move; see `ModelRunner.forward`)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        token_spans: list[tuple[int, int]] = []  # (first flat token index, count) per decode row
        logit_rows: list[int] = []
        feed: list[tuple[int, int]] = []
        bs = self.block_size
        for r, (row, table) in enumerate(zip(rows, tables, strict=False)):
            toks, start = self.row_tokens(row)
            shift = shifts[r] if shifts else 0
            start += shift
            if row.feed_src >= 0:
                feed.append((len(ids) + row.num_committed - 1, row.feed_src + shift))
            ids.extend(toks)
            for p in range(start, start + len(toks)):
                blk = table[p // bs] if p // bs < len(table) else self.dummy_block
                slots.append(blk * bs + p % bs)
            # Padding drafts of a row at the end of the context may sit past the last position
            # (real drafts never do: budgets are capped by the context). Their outputs are never
            # read and their slots are the dummy block's, so any valid position will do.
            pos.extend(min(p, self.max_position) for p in range(start, start + len(toks)))
            if row.decode:
                n = 1 + len(row.drafts) + row.pad
                token_spans.append((len(ids) - n, n))
                logit_rows.extend(range(len(ids) - n, len(ids)))
            qlens.append(len(toks))
            ctxs.append(start + len(toks))
        # Uniform (graph-capturable) only for steady decode/verify rows: one committed token
        # plus the same number of drafts. A whole-prompt row stays ragged so that logits are
        # computed for its verify span only, not for every prompt token.
        same_q = all(
            r.decode and r.num_committed == 1 and q == qlens[0]
            for r, q in zip(rows, qlens, strict=True)
        )
        uniform_q = qlens[0] if same_q else 0
        if uniform_q:  # logits for every token: spans index tokens directly
            spans = token_spans
        else:  # logits only for `logit_rows`, packed in decode-row order
            spans, off = [], 0
            for _, n in token_spans:
                spans.append((off, n))
                off += n
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=self.block_table_tensor(tables, ctxs),
            context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev),
            query_lens=None if uniform_q else qlens,
            context_lens_host=None if uniform_q else ctxs,
            uniform_q=uniform_q,
        )
        return PreparedInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            meta=meta,
            logits_index=None
            if uniform_q
            else torch.tensor(logit_rows, dtype=torch.long, device=dev),
            logit_spans=spans,
            num_rows=len(rows),
            uniform_q=uniform_q,
            feed=feed,
        )

    def prepare_varlen(
        self, rows: list[Row], tables: list[list[int]], shifts: list[int] | None = None
    ) -> VarlenStep:
        """Rows -> the varlen layout (for backends that take rows of any lengths).

        Each decode row feeds its uncached committed tokens and its REAL drafts only: nothing
        is padded per row (the runner pads the step's token count to a captured graph).
        `shifts` as in `prepare`; without them a row's table still covers its `slack` (the
        device may shift it that far)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        row_tables: list[list[int]] = []
        logit_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        feed: list[tuple[int, int]] = []
        bs = self.block_size
        for r, (row, table) in enumerate(zip(rows, tables, strict=True)):
            shift = shifts[r] if shifts else 0
            if row.decode and row.num_committed == 1 and not row.pad:
                # A steady decode row (most rows of a loaded step): its last committed token,
                # then its drafts; logits at every one of them.
                req, i = row.request, len(ids)
                if row.feed_src >= 0:
                    feed.append((i, row.feed_src + shift))
                ids.append(req.token_at(req.num_computed))
                p = req.num_computed + shift
                drafts = row.drafts
                if drafts:
                    n = 1 + len(drafts)
                    ids.extend(drafts)
                    pos.extend(range(p, p + n))
                    slots.extend(slots_of(table, p, n, bs))
                    logit_rows.extend(range(i, i + n))
                else:
                    n = 1
                    pos.append(p)
                    slots.append(slot_of(table, p, bs))
                    logit_rows.append(i)
                cu.append(i + n)
                seq_lens.append(p + n)
                row_tables.append(table[: (p + n - 1 + row.slack - shift) // bs + 1])
                spans.append((len(logit_rows) - n, n))
                continue
            toks, start = self.row_tokens(row)
            start += shift
            n = len(toks)
            if row.feed_src >= 0:
                feed.append((len(ids) + row.num_committed - 1, row.feed_src + shift))
            ids.extend(toks)
            pos.extend(range(start, start + n))
            slots.extend(slots_of(table, start, n, bs))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            row_tables.append(table[: blocks_for(start + n + row.slack - shift, bs)])
            if row.decode:
                m = 1 + len(row.drafts)
                spans.append((len(logit_rows), m))
                logit_rows.extend(range(len(ids) - m, len(ids)))
        return VarlenStep(ids, pos, slots, cu, seq_lens, row_tables, logit_rows, spans, feed)

    def varlen_tensors(self, step: VarlenStep):
        """The step as device tensors, unpadded (the eager path): ids, positions, meta, index."""
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.long, device=dev),
            block_tables=self.block_table_tensor(step.tables, step.seq_lens),
            context_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(step.cu_seqlens, dtype=torch.int32, device=dev),
        )
        return (
            torch.tensor(step.ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(step.logit_rows, dtype=torch.long, device=dev),
        )

    def block_table_tensor(self, tables: list[list[int]], ctxs: list[int]) -> torch.Tensor:
        # Only as wide as this step needs: eager attention gathers no more than that, and
        # graph replay fills the rest of its static table with the dummy block.
        width = max(1, min(self.max_blocks, max(-(-c // self.block_size) for c in ctxs)))
        out = torch.full((len(tables), width), self.dummy_block, dtype=torch.int32)
        for i, t in enumerate(tables):
            t = t[:width]
            if t:
                out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(self.device)
