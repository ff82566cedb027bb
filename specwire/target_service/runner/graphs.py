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

import math
from collections.abc import Callable, Iterable

import torch

from specwire.common.model.attention import AttentionMetadata
from specwire.target_service.runner.inputs import VarlenStep

# forward(input_ids [T], positions [T], meta, logits_index [L]) -> logits [L, V] fp32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Captured step sizes: dense where decode/verify batches land, sparser for prefill."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072, 4096]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class _Packed:
    """Graph inputs of one dtype packed in one device buffer with a pinned host twin: a step
    stages them on the host and uploads them in ONE copy (each CUDA call costs host time,
    and a virtualised driver makes it dear). `field(name)` is a (device view, host view)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype, device) -> None:
        sizes = {name: math.prod(shape) for name, shape in shapes.items()}
        self.dev = torch.zeros(sum(sizes.values()), dtype=dtype, device=device)
        self.host = torch.zeros(sum(sizes.values()), dtype=dtype, pin_memory=True)
        self.views: dict[str, tuple[torch.Tensor, object]] = {}
        offset = 0
        host_np = self.host.numpy()
        for name, shape in shapes.items():
            n = sizes[name]
            self.views[name] = (
                self.dev[offset : offset + n].view(shape),
                host_np[offset : offset + n].reshape(shape),
            )
            offset += n

    def field(self, name: str):
        return self.views[name]

    def upload(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)


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
        t = max_tokens
        self.longs = _Packed(
            {"ids": (t,), "pos": (t,), "slots": (t,), "logit_rows": (max_logit_rows,)},
            torch.long,
            d,
        )
        self.ints = _Packed(
            {"cu": (max_rows + 1,), "seq_lens": (max_rows,), "tables": (max_rows, max_blocks)},
            torch.int32,
            d,
        )
        self.ids, self.h_ids = self.longs.field("ids")
        self.pos, self.h_pos = self.longs.field("pos")
        self.slots, self.h_slots = self.longs.field("slots")
        self.logit_rows, self.h_logit_rows = self.longs.field("logit_rows")
        self.cu, self.h_cu = self.ints.field("cu")
        self.seq_lens, self.h_seq_lens = self.ints.field("seq_lens")
        self.tables, self.h_tables = self.ints.field("tables")
        self.logits = torch.zeros(max_logit_rows, vocab_size, dtype=torch.float32, device=d)
        # The greedy token of every logit row, computed inside the graph, and its pinned host
        # twin: one small copy back per step instead of an argmax launch plus a copy.
        self.argmax = torch.zeros(max_logit_rows, dtype=torch.long, device=d)
        self.h_argmax = torch.zeros(max_logit_rows, dtype=torch.long, pin_memory=True)
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
            slot_mapping=self.slots[:bucket],
            block_tables=self.tables,
            context_lens=self.seq_lens,
            cu_seqlens_q=self.cu,
        )
        out = self.forward(self.ids[:bucket], self.pos[:bucket], meta, self.logit_rows[:n_logits])
        self.logits[:n_logits].copy_(out)
        torch.argmax(self.logits[:n_logits], dim=-1, out=self.argmax[:n_logits])
        self.h_argmax[:n_logits].copy_(self.argmax[:n_logits], non_blocking=True)
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
        self.longs.host.zero_()
        self.h_slots[:] = -1
        self.ints.host.zero_()
        self.longs.upload()
        self.ints.upload()
        torch.cuda.synchronize()

    def replay(self, bucket: int, step: VarlenStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the step's inputs (padded to `bucket`), upload them in two copies, replay.
        Returns (logits [L, V], greedy tokens [L] in pinned host memory), views whose first
        len(step.logit_rows) rows are the step's; the host tokens are valid after a sync."""
        t, b, n_logits = step.num_tokens, step.num_rows, len(step.logit_rows)
        self.h_ids[:t] = step.ids
        self.h_ids[t:bucket] = 0
        self.h_pos[:t] = step.positions
        self.h_pos[t:bucket] = 0
        self.h_slots[:t] = step.slots
        self.h_slots[t:bucket] = -1
        self.h_logit_rows[:n_logits] = step.logit_rows
        self.h_logit_rows[n_logits : self._logit_rows_for(bucket)] = 0
        self.h_cu[: b + 1] = step.cu_seqlens
        self.h_cu[b + 1 :] = t  # empty rows after the real ones
        self.h_seq_lens[:b] = step.seq_lens
        self.h_seq_lens[b:] = 0
        for i, table in enumerate(step.tables):
            self.h_tables[i, : len(table)] = table
        self.longs.upload()
        self.ints.upload()
        self.graphs[bucket].replay()
        n = self._logit_rows_for(bucket)
        return self.logits[:n], self.h_argmax[:n]
