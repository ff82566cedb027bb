"""Drive `LlamaModel` through its public seam with hand-built attention metadata.

A toy block allocator hands out KV blocks in a shuffled order (so block tables are not
contiguous), and `step` builds slot mappings, block tables and lengths the way the runner must:
token t of a sequence lives at slot `table[t // bs] * bs + t % bs`.
"""

from __future__ import annotations

import random

import torch

from specwire.common.model.attention import AttentionMetadata
from specwire.common.model.llama import LlamaModel
from specwire.common.model.paged import slots_of

Row = tuple[int, list[int]]  # (sequence id, the tokens this step adds to it)


class PagedRunner:
    def __init__(self, model: LlamaModel, num_blocks: int = 64, shuffle_seed: int | None = 0):
        self.model = model
        self.bs = model.block_size
        self.kv = model.allocate_kv_cache(num_blocks)  # [L, 2, NB, BS, KVH, D]
        # Block 0 is the dummy block padding rows write to; sequences never get it.
        self.free = list(range(1, num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _place(self, seq: int, n: int) -> tuple[list[int], list[int]]:
        """Reserve room for `n` more tokens of `seq`; their (positions, slots)."""
        start = self.lens.get(seq, 0)
        table = self.tables.setdefault(seq, [])
        while len(table) * self.bs < start + n:
            table.append(self.free.pop())
        positions = list(range(start, start + n))
        slots = slots_of(table, start, n, self.bs)
        self.lens[seq] = start + n
        return positions, slots

    def _block_tables(self, seqs: list[int]) -> torch.Tensor:  # [B, M] int32
        width = max(len(self.tables[s]) for s in seqs)
        # Unused entries point at a valid block (the dummy), as the metadata contract allows.
        return torch.tensor(
            [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs], dtype=torch.int32
        )

    def step(self, rows: list[Row]) -> list[torch.Tensor]:
        """One ragged forward over `rows`; the logits [q, V] of each row's new tokens."""
        ids, positions, slots = [], [], []
        for seq, tokens in rows:
            pos, slot = self._place(seq, len(tokens))
            ids += tokens
            positions += pos
            slots += slot
        seqs = [seq for seq, _ in rows]
        ctx = [self.lens[s] for s in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=self._block_tables(seqs),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_lens=[len(t) for _, t in rows],
            context_lens_host=ctx,
        )
        return self._forward(ids, positions, meta).split(meta.query_lens)

    def step_uniform(self, rows: list[Row], pad_rows: int = 0) -> list[torch.Tensor]:
        """One forward in the uniform layout (every row adds q tokens), plus `pad_rows` padding
        rows that write to the dummy block. The logits [q, V] of each real row."""
        q = len(rows[0][1])
        assert all(len(t) == q for _, t in rows)
        ids, positions, slots = [], [], []
        for seq, tokens in rows:
            pos, slot = self._place(seq, q)
            ids += tokens
            positions += pos
            slots += slot
        seqs = [seq for seq, _ in rows]
        tables = self._block_tables(seqs)
        ctx = [self.lens[s] for s in seqs]
        if pad_rows:
            ids += [0] * (q * pad_rows)
            positions += list(range(q)) * pad_rows
            slots += list(range(q)) * pad_rows  # dummy block 0
            tables = torch.cat([tables, torch.zeros(pad_rows, tables.shape[1], dtype=torch.int32)])
            ctx += [q] * pad_rows
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=tables,
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_lens=None,
            uniform_q=q,
        )
        return list(self._forward(ids, positions, meta).split(q))[: len(rows)]

    def _forward(self, ids: list[int], positions: list[int], meta: AttentionMetadata):
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv, meta)  # [T, H]
        return self.model.compute_logits(hidden)  # [T, V]


def prompt_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, run as one prefill."""
    return PagedRunner(model).step([(0, ids)])[0]
