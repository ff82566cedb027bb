"""CUDA graphs for uniform decode/verify steps: capture, selection, replay.

The only owner of graph state. One graph per (batch bucket, q) where q = 1 + padded draft
length. Static input buffers are allocated once at the largest shape and each graph reads
`[:bucket]` views of them; graphs are captured largest first and share one memory pool.
Unused rows of a bucket are dummy rows: they read and write only the reserved dummy KV block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from common.model.attention import AttentionMetadata
from target_service.runner.inputs import PreparedInputs


@dataclass
class StaticBuffers:
    """Graph inputs at the largest shape; graphs read `[:bs * q]` / `[:bs]` views."""

    input_ids: torch.Tensor  # [max_bs * max_q]
    positions: torch.Tensor  # [max_bs * max_q]
    slot_mapping: torch.Tensor  # [max_bs * max_q]
    block_tables: torch.Tensor  # [max_bs, max_blocks]
    context_lens: torch.Tensor  # [max_bs]
    logits: torch.Tensor  # [max_bs * max_q, V] fp32

    @classmethod
    def allocate(cls, max_bs, max_q, max_blocks, vocab, device) -> StaticBuffers:
        n = max_bs * max_q
        z = dict(device=device)
        return cls(
            input_ids=torch.zeros(n, dtype=torch.long, **z),
            positions=torch.zeros(n, dtype=torch.long, **z),
            slot_mapping=torch.zeros(n, dtype=torch.long, **z),
            block_tables=torch.zeros(max_bs, max_blocks, dtype=torch.int32, **z),
            context_lens=torch.ones(max_bs, dtype=torch.int32, **z),
            logits=torch.zeros(n, vocab, dtype=torch.float32, **z),
        )


# forward(input_ids, positions, meta) -> logits [T, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class CudaGraphs:
    def __init__(
        self, forward: ForwardFn, buffers: StaticBuffers, block_size: int, dummy_block: int
    ) -> None:
        self.forward = forward
        self.buf = buffers
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def buckets(self, q: int) -> list[int]:
        return sorted(bs for bs, qq in self.graphs if qq == q)

    def select(self, inputs: PreparedInputs) -> tuple[int, int] | None:
        """The captured (bucket, q) for these inputs, or None (eager fallback)."""
        if not inputs.uniform_q:
            return None
        for bs in self.buckets(inputs.uniform_q):
            if bs >= inputs.num_rows:
                return bs, inputs.uniform_q
        return None

    def _static_meta(self, bs: int, q: int) -> AttentionMetadata:
        b = self.buf
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[: bs * q],
            block_tables=b.block_tables[:bs],
            context_lens=b.context_lens[:bs],
            uniform_q=q,
        )

    def _fill_dummy(self, start_row: int, bs: int, q: int) -> None:
        """Rows [start_row, bs) become dummy rows: positions 0..q-1 in the dummy block."""
        if start_row >= bs:
            return
        b = self.buf
        n0, n1 = start_row * q, bs * q
        offs = torch.arange(q, device=b.input_ids.device).repeat(bs - start_row)
        b.input_ids[n0:n1] = 0
        b.positions[n0:n1] = offs
        b.slot_mapping[n0:n1] = self.dummy_block * self.block_size + offs % self.block_size
        b.block_tables[start_row:bs] = self.dummy_block
        b.context_lens[start_row:bs] = q

    def capture(self, shapes: Iterable[tuple[int, int]], progress=None) -> None:
        """Capture graphs for (bs, q) shapes, largest first, sharing one memory pool."""
        for bs, q in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
            self._fill_dummy(0, bs, q)
            meta = self._static_meta(bs, q)
            out = self.buf.logits[: bs * q]
            ids, pos = self.buf.input_ids[: bs * q], self.buf.positions[: bs * q]
            out.copy_(self.forward(ids, pos, meta))  # warm-up run before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out.copy_(self.forward(ids, pos, self._static_meta(bs, q)))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(bs, q)] = graph
            torch.cuda.synchronize()
            if progress is not None:
                progress.update(1)

    def replay(self, key: tuple[int, int], inputs: PreparedInputs) -> torch.Tensor:
        """Copy inputs into the static buffers, replay, return logits [rows * q, V] (a view)."""
        bs, q = key
        n, rows = inputs.input_ids.shape[0], inputs.num_rows
        b = self.buf
        b.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        b.positions[:n].copy_(inputs.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(inputs.meta.slot_mapping, non_blocking=True)
        width = inputs.meta.block_tables.shape[1]
        b.block_tables[:rows, :width].copy_(inputs.meta.block_tables, non_blocking=True)
        b.block_tables[:rows, width:] = self.dummy_block
        b.context_lens[:rows].copy_(inputs.meta.context_lens, non_blocking=True)
        self._fill_dummy(rows, bs, q)
        self.graphs[key].replay()
        return b.logits[:n]
