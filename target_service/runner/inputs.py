"""Input preparation: scheduled rows -> flat token tensors + attention metadata.

Everything is built on the host as Python lists and copied to the device once per tensor.
Padding draft positions beyond a request's reserved slots, and whole dummy rows, write into
the reserved dummy KV block, so they can never corrupt a real sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.attention import AttentionMetadata
from target_service.scheduler import Row


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


class InputPreparer:
    def __init__(self, block_size: int, max_blocks_per_seq: int, dummy_block: int, device):
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.dummy_block = dummy_block
        self.device = device

    def row_tokens(self, row: Row) -> tuple[list[int], int]:
        """Tokens a row feeds (uncached committed tokens, then padded drafts) and its start."""
        req = row.request
        start = req.num_computed
        toks = req.token_ids[start : start + row.num_committed]
        if row.decode:
            toks = toks + req.draft_tokens
        return toks, start

    def prepare(self, rows: list[Row], tables: list[list[int]]) -> PreparedInputs:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        token_spans: list[tuple[int, int]] = []  # (first flat token index, count) per decode row
        logit_rows: list[int] = []
        bs = self.block_size
        for row, table in zip(rows, tables, strict=False):
            toks, start = self.row_tokens(row)
            ids.extend(toks)
            for p in range(start, start + len(toks)):
                blk = table[p // bs] if p // bs < len(table) else self.dummy_block
                slots.append(blk * bs + p % bs)
            pos.extend(range(start, start + len(toks)))
            if row.decode:
                n = 1 + len(row.request.draft_tokens)
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
