"""CUDA graphs for every step: capture by padded token count, selection, replay.

The only owner of graph state. With a varlen attention backend (one kernel launch for rows of
any lengths, grid fixed by tensor shapes) a step is fully described by tensors, so one graph
per token-count bucket serves every kind of step: decode rows, verify rows of any draft length
and prefill chunks, mixed. A step of T tokens replays the smallest bucket >= T; its unused
tokens are padding (slot -1: never stored; outside every row: never attended), and its unused
rows are empty (no queries, context 0).

Static device buffers are allocated once at the largest shape and each graph reads views of
them; host inputs are staged in pinned buffers and copied without blocking. Graphs are captured
largest first with one warm-up each and share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from common.model.attention import AttentionMetadata
from target_service.runner.inputs import VarlenStep

# forward(input_ids [T], positions [T], meta, logits_index [L]) -> logits [L, V] fp32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Captured step sizes: dense where decode/verify batches land, sparser for prefill."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072, 4096]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class _Staged:
    """One input: a device buffer at the largest shape plus its pinned host twin."""

    def __init__(self, shape, dtype, device, fill=0) -> None:
        self.dev = torch.full(shape, fill, dtype=dtype, device=device)
        self.host = torch.full(shape, fill, dtype=dtype, pin_memory=True)
        self.np = self.host.numpy()

    def upload(self, n: int) -> None:
        self.dev[:n].copy_(self.host[:n], non_blocking=True)


class TokenGraphs:
    def __init__(
        self,
        forward: ForwardFn,
        *,
        max_tokens: int,
        max_rows: int,
        max_blocks: int,
        max_logit_rows: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.max_rows = max_rows
        self.max_logit_rows = max_logit_rows
        self.buckets = token_buckets(max_tokens)
        d = device
        self.ids = _Staged((max_tokens,), torch.long, d)
        self.pos = _Staged((max_tokens,), torch.long, d)
        self.slots = _Staged((max_tokens,), torch.long, d, fill=-1)
        self.cu = _Staged((max_rows + 1,), torch.int32, d)
        self.seq_lens = _Staged((max_rows,), torch.int32, d)
        self.tables = _Staged((max_rows, max_blocks), torch.int32, d)
        self.logit_rows = _Staged((max_logit_rows,), torch.long, d)
        self.logits = torch.zeros(max_logit_rows, vocab_size, dtype=torch.float32, device=d)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _logit_rows_for(self, bucket: int) -> int:
        return min(bucket, self.max_logit_rows)

    def select(self, step: VarlenStep) -> int | None:
        """The captured bucket for this step, or None (eager fallback)."""
        if step.num_rows > self.max_rows or len(step.logit_rows) > self.max_logit_rows:
            return None
        for t in self.buckets:
            if t >= step.num_tokens and t in self.graphs:
                return t if len(step.logit_rows) <= self._logit_rows_for(t) else None
        return None

    def _run(self, bucket: int) -> torch.Tensor:
        n_logits = self._logit_rows_for(bucket)
        meta = AttentionMetadata(
            slot_mapping=self.slots.dev[:bucket],
            block_tables=self.tables.dev,
            context_lens=self.seq_lens.dev,
            cu_seqlens_q=self.cu.dev,
        )
        out = self.forward(
            self.ids.dev[:bucket], self.pos.dev[:bucket], meta, self.logit_rows.dev[:n_logits]
        )
        self.logits[:n_logits].copy_(out)
        return self.logits[:n_logits]

    def capture(self, buckets: Iterable[int] | None = None, progress=None) -> None:
        """Capture every bucket, largest first, in one memory pool. Inputs are all padding
        (empty rows), so capture touches no request's cache."""
        self._stage_empty()
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self._run(bucket)  # warm-up (compiles the kernels for this shape)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._run(bucket)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
            if progress is not None:
                progress.update(1)
        torch.cuda.synchronize()

    def measure(self, replays: int = 5) -> dict[int, float]:
        """Seconds per replay of each captured bucket (empty rows: the weights' share of a
        step; the draft policy refines these from real steps)."""
        self._stage_empty()
        out: dict[int, float] = {}
        for bucket, graph in sorted(self.graphs.items()):
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            out[bucket] = start.elapsed_time(end) / replays / 1e3
        return out

    def _stage_empty(self) -> None:
        for buf in (self.ids, self.pos, self.cu, self.seq_lens, self.tables, self.logit_rows):
            buf.dev.zero_()
        self.slots.dev.fill_(-1)

    def replay(self, bucket: int, step: VarlenStep) -> torch.Tensor:
        """Stage the step's inputs (padded to `bucket`), replay; logits [L, V] (a view: its
        first len(step.logit_rows) rows are the step's)."""
        t, b, n_logits = step.num_tokens, step.num_rows, len(step.logit_rows)
        self.ids.np[:t] = step.ids
        self.ids.np[t:bucket] = 0
        self.pos.np[:t] = step.positions
        self.pos.np[t:bucket] = 0
        self.slots.np[:t] = step.slots
        self.slots.np[t:bucket] = -1
        self.cu.np[: b + 1] = step.cu_seqlens
        self.cu.np[b + 1 :] = t  # empty rows after the real ones
        self.seq_lens.np[:b] = step.seq_lens
        self.seq_lens.np[b:] = 0
        for i, table in enumerate(step.tables):
            self.tables.np[i, : len(table)] = table
        self.logit_rows.np[:n_logits] = step.logit_rows
        self.logit_rows.np[n_logits : self._logit_rows_for(bucket)] = 0
        for buf, n in (
            (self.ids, bucket),
            (self.pos, bucket),
            (self.slots, bucket),
            (self.cu, self.max_rows + 1),
            (self.seq_lens, self.max_rows),
            (self.tables, b),
            (self.logit_rows, self._logit_rows_for(bucket)),
        ):
            buf.upload(n)
        self.graphs[bucket].replay()
        return self.logits[: self._logit_rows_for(bucket)]
