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

Two steps may be in flight (overlapped execution: step n+1 is launched before step n's tokens
are read), so every host-side buffer has two twins used alternately: a step never stages its
inputs over a copy the GPU has not made yet, nor copies its tokens over ones the executor has
not read. Each bucket is captured once per twin, with the upload from that twin's pinned
inputs and the copy of the argmax back to its pinned outputs inside the graph: a step costs the
host two CUDA calls (the replay, an event after it), which matters on a virtualised driver
where each call is dear; one replay in `TIMING_EVERY` adds a timed event before it, so a sample
of the steps' device time is known. A token
that step n+1 feeds but step n computes (a placeholder on the host) is gathered on the device,
inside the graph, from step n's argmax (`feed`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from specwire.common.model.attention import AttentionMetadata
from specwire.target_service.runner.inputs import VarlenStep
from specwire.target_service.runner.pipeline import accepted_counts, shift_rows

# One graph replay in this many is timed (its device time feeds `specwire_step_gpu_seconds`).
TIMING_EVERY = 8

# forward(input_ids [T], positions [T], meta, logits_index [L]) -> logits [L, V] fp32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Captured step sizes: dense where decode/verify batches land, sparser for prefill."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072, 4096]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class _Packed:
    """Graph inputs of one dtype packed in one device buffer with two pinned host twins: a step
    stages them on the host and uploads them in ONE copy (each CUDA call costs host time, and a
    virtualised driver makes it dear). `field(name)` is (device view, [host view per twin])."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype, device) -> None:
        sizes = {name: math.prod(shape) for name, shape in shapes.items()}
        total = sum(sizes.values())
        self.dev = torch.zeros(total, dtype=dtype, device=device)
        self.host = [torch.zeros(total, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.views: dict[str, tuple[torch.Tensor, list]] = {}
        offset = 0
        host_np = [h.numpy() for h in self.host]
        for name, shape in shapes.items():
            n = sizes[name]
            self.views[name] = (
                self.dev[offset : offset + n].view(shape),
                [h[offset : offset + n].reshape(shape) for h in host_np],
            )
            offset += n

    def field(self, name: str):
        return self.views[name]

    def upload(self, twin: int) -> None:
        self.dev.copy_(self.host[twin], non_blocking=True)


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
        device_drafts=None,  # runner.device_drafts.DeviceDrafts: draft inside the graph
        block_size: int = 16,
        pipelined: bool = False,  # shift rows by the step before's accepted drafts (pipeline.py)
        max_draft_len: int = 0,
    ) -> None:
        self.forward = forward
        self.dd = device_drafts
        self.block_size = block_size
        self.pipelined = pipelined
        self.max_rows = max_rows
        self.max_logit_rows = max_logit_rows
        self.buckets = token_buckets(max_tokens)
        d = device
        t = max_tokens
        # ids has one extra scratch slot: unused feed entries write there.
        self.scratch = t
        self.longs = _Packed(
            {
                "ids": (t + 1,),
                "pos": (t,),
                "slots": (t,),
                "logit_rows": (max_logit_rows,),
                "feed_dst": (max_rows,),
                "feed_src": (max_rows,),
                # drafting on the device, per row: committed length, drafts wanted, where
                "dd_len": (max_rows,),
                "dd_cap": (max_rows,),
                "dd_off": (max_rows,),
                # pipelined: each row's row in the step before (max_rows: none; one more entry,
                # the sentinel's), each token's and each fed entry's row, what verifying needs
                "shift_src": (max_rows + 1,),
                "tok_row": (t,),
                "feed_row": (max_rows,),
                "v_first": (max_rows,),
                "v_logit": (max_rows,),
                "v_drafts": (max_rows,),
            },
            torch.long,
            d,
        )
        self.ints = _Packed(
            {"cu": (max_rows + 1,), "seq_lens": (max_rows,), "tables": (max_rows, max_blocks)},
            torch.int32,
            d,
        )
        self.ids_ext, self.h_ids = self.longs.field("ids")
        self.ids = self.ids_ext[:t]
        self.feed_dst, self.h_feed_dst = self.longs.field("feed_dst")
        self.feed_src, self.h_feed_src = self.longs.field("feed_src")
        self.pos, self.h_pos = self.longs.field("pos")
        self.slots, self.h_slots = self.longs.field("slots")
        self.logit_rows, self.h_logit_rows = self.longs.field("logit_rows")
        self.dd_len, self.h_dd_len = self.longs.field("dd_len")
        self.dd_cap, self.h_dd_cap = self.longs.field("dd_cap")
        self.dd_off, self.h_dd_off = self.longs.field("dd_off")
        self.shift_src, self.h_shift_src = self.longs.field("shift_src")
        self.tok_row, self.h_tok_row = self.longs.field("tok_row")
        self.feed_row, self.h_feed_row = self.longs.field("feed_row")
        self.v_first, self.h_v_first = self.longs.field("v_first")
        self.v_logit, self.h_v_logit = self.longs.field("v_logit")
        self.v_drafts, self.h_v_drafts = self.longs.field("v_drafts")
        # Pipelined: each row's accepted drafts, counted inside the graph; the next step's
        # shifts read it before this one overwrites it. acc[max_rows] stays 0 (no shift).
        self.acc = torch.zeros(max_rows + 1, dtype=torch.long, device=d)
        self.kidx = torch.arange(max(1, max_draft_len), device=d)
        if device_drafts is not None:  # the drafts and which rows have any, for the host
            kmax = device_drafts.kmax
            self.dd_drafts = torch.zeros(max_rows, kmax, dtype=torch.long, device=d)
            self.dd_found = torch.zeros(max_rows, dtype=torch.bool, device=d)
            self.h_dd_drafts = [
                torch.zeros(max_rows, kmax, dtype=torch.long, pin_memory=True) for _ in range(2)
            ]
            self.h_dd_found = [
                torch.zeros(max_rows, dtype=torch.bool, pin_memory=True) for _ in range(2)
            ]
        self.cu, self.h_cu = self.ints.field("cu")
        self.seq_lens, self.h_seq_lens = self.ints.field("seq_lens")
        self.tables, self.h_tables = self.ints.field("tables")
        self.logits = torch.zeros(max_logit_rows, vocab_size, dtype=torch.float32, device=d)
        # The greedy token of every logit row, computed inside the graph (no separate argmax
        # launch); the next step's feed reads it there, and the host reads a pinned twin.
        self.argmax = torch.zeros(max_logit_rows, dtype=torch.long, device=d)
        self.h_argmax = [
            torch.zeros(max_logit_rows, dtype=torch.long, pin_memory=True) for _ in range(2)
        ]
        # Per twin: events around the replay. Timed, so a served step's device time (start
        # on the stream to end) is measured for one event record: `StepLogits.gpu_seconds`.
        # `began` is recorded on one replay in `TIMING_EVERY` only: every CUDA call gives the
        # GIL up, and under load getting it back costs the executor up to a switch interval.
        self.began = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self.replays = 0
        self.done = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self.twin = 0  # the host twin the next replay stages into
        # bucket -> graph, one dict per host twin; `graphs` is twin 0's
        self.twins: list[dict[int, torch.cuda.CUDAGraph]] = [{}, {}]
        self.graphs = self.twins[0]
        self.pool = None
        try:  # Triton comes with PyTorch's CUDA builds; without it, PyTorch's argmax
            from specwire.common.model.triton_argmax import copy_argmax
        except ImportError:
            copy_argmax = None
            self.triton_argmax = False
        self._copy_argmax = copy_argmax
        # Pipelined: the shifts and the counts as one Triton launch each (PyTorch's ops are
        # ~20 small kernels a step, which plain steps pay too), else `runner/pipeline.py`'s.
        self._shift_rows, self._accept_triton = shift_rows, None
        if pipelined and copy_argmax is not None:
            from specwire.common.model.triton_pipeline import (
                accepted_counts_triton,
                shift_rows_triton,
            )

            self._shift_rows, self._accept_triton = shift_rows_triton, accepted_counts_triton

    def _logit_rows_for(self, bucket: int) -> int:
        return min(bucket, self.max_logit_rows)

    def select(self, step: VarlenStep) -> int | None:
        """The captured bucket for this step, or None (eager fallback)."""
        if step.num_rows > self.max_rows or len(step.logit_rows) > self.max_logit_rows:
            return None
        for t in self.buckets:
            if t >= step.num_tokens and t in self.graphs and step.num_rows <= self._rows_for(t):
                return t if len(step.logit_rows) <= self._logit_rows_for(t) else None
        return None

    # The logits copy and the argmax as our two Triton launches (`triton_argmax`) where Triton
    # is installed (True), or PyTorch's copy and argmax (False: before round 28;
    # `bench/verify_step.py --argmax` compares the two). The same index either way.
    triton_argmax = True

    # Rows per bucket: min(bucket, max_rows) (True), or max_rows for every bucket (False: what
    # the graphs did before round 17; `bench/verify_step.py --graph-rows` compares the two).
    trim_rows = True

    def _rows_for(self, bucket: int) -> int:
        """Rows a bucket's graph attends over: a row has at least one token, so a step of at
        most `bucket` tokens has at most that many (rows of none take a larger bucket). The
        attention grid grows with its rows (`paged_attention`: one query block per row at
        least), so a small step's graph keeps no idle programs for the largest batch."""
        return min(bucket, self.max_rows) if self.trim_rows else self.max_rows

    def _run(self, bucket: int, twin: int) -> torch.Tensor:
        n_logits = self._logit_rows_for(bucket)
        self.longs.upload(twin)
        self.ints.upload(twin)
        rows = self._rows_for(bucket)  # rows past the step's own: empty, cu = its tokens
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            block_tables=self.tables[:rows],
            context_lens=self.seq_lens[:rows],
            cu_seqlens_q=self.cu[: rows + 1],
        )
        if self.pipelined:  # rows move by the step before's accepted drafts, first
            self._shift_rows(
                self.acc, self.shift_src, self.tok_row[:bucket], self.feed_row, self.pos[:bucket],
                self.slots[:bucket], self.seq_lens[:rows], self.feed_src, self.tables[:rows],
                self.dd_len[:rows] if self.dd is not None else None, self.block_size,
            )  # fmt: skip
        # Tokens the previous step computed and this one feeds: gathered from its argmax
        # (still in `self.argmax`) before this step overwrites it; unused entries hit scratch.
        self.ids_ext.index_copy_(0, self.feed_dst, self.argmax.index_select(0, self.feed_src))
        if self.dd is not None:  # the fed ids into the token cache, then the drafts
            self.dd.store(self.ids[:bucket], self.slots[:bucket])
            self.dd.draft(
                self.ids[:bucket], self.slots[:bucket], self.tables[:rows], self.dd_len[:rows],
                self.dd_cap[:rows], self.dd_off[:rows], self.dd_drafts[:rows],
                self.dd_found[:rows],
            )  # fmt: skip
            self.h_dd_drafts[twin][:rows].copy_(self.dd_drafts[:rows], non_blocking=True)
            self.h_dd_found[twin][:rows].copy_(self.dd_found[:rows], non_blocking=True)
        out = self.forward(self.ids[:bucket], self.pos[:bucket], meta, self.logit_rows[:n_logits])
        if self.triton_argmax:
            self._copy_argmax(out, self.logits[:n_logits], self.argmax[:n_logits])
        else:
            self.logits[:n_logits].copy_(out)
            torch.argmax(self.logits[:n_logits], dim=-1, out=self.argmax[:n_logits])
        self.h_argmax[twin][:n_logits].copy_(self.argmax[:n_logits], non_blocking=True)
        if self.pipelined:  # each row's accepted drafts, for the next step's shifts
            self._count_accepted(rows)
        return self.logits[:n_logits]

    def capture(self, buckets: Iterable[int] | None = None, progress=None) -> None:
        """Capture every bucket for both twins, largest first, in one memory pool. Inputs are
        all padding (empty rows), so capture touches no request's cache."""
        self._stage_empty()
        for bucket in sorted(buckets or self.buckets, reverse=True):
            for twin in range(2):
                self._run(bucket, twin)  # warm-up (compiles the kernels for this shape)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA call (a stopping server's executor, the
                # collector freeing a tensor) must not invalidate this capture. The suspected
                # cause, not proven, of one H200 test run (round 11) where a Triton launch
                # "failed due to a previous error during capture", and every later test with it.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    self._run(bucket, twin)
                if self.pool is None:
                    self.pool = graph.pool()
                self.twins[twin][bucket] = graph
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
        for twin in range(2):
            self.longs.host[twin].zero_()
            self.h_slots[twin][:] = -1
            self.h_feed_dst[twin][:] = self.scratch
            self.h_shift_src[twin][:] = self.max_rows
            self.h_tok_row[twin][:] = self.max_rows
            self.h_feed_row[twin][:] = self.max_rows
            self.ints.host[twin].zero_()
        torch.cuda.synchronize()

    def _count_accepted(self, rows: int) -> None:
        """Each row's accepted drafts into `acc` (inside the graph, after the argmax); a row
        drafted on the device without a match has none."""
        first, logit, drafts = self.v_first[:rows], self.v_logit[:rows], self.v_drafts[:rows]
        cap = found = None
        if self.dd is not None:
            cap, found = self.dd_cap[:rows], self.dd_found[:rows]
        if self._accept_triton is not None:
            k = self.kidx.numel()
            self._accept_triton(
                self.ids_ext, self.argmax, first, logit, drafts, k, self.acc, cap, found
            )
            return
        if cap is not None:
            drafts = torch.where((cap > 0) & ~found, torch.zeros_like(drafts), drafts)
        self.acc[:rows] = accepted_counts(
            self.ids_ext, self.argmax, first, logit, drafts, self.kidx
        )

    def _stage_pipeline(self, w: int, step: VarlenStep, bucket: int) -> None:
        """Stage a pipelined step's shift sources, token rows and verification inputs."""
        t, b, none = step.num_tokens, step.num_rows, self.max_rows
        src = self.h_shift_src[w]
        if step.shifted:
            src[:b] = step.after
            src[:b][src[:b] < 0] = none
            src[b:] = none
            tok_row = self.h_tok_row[w]
            tok_row[:t] = np.repeat(np.arange(b), np.diff(step.cu_seqlens))
            tok_row[t:bucket] = none
            f = len(step.feed)
            feed_row = self.h_feed_row[w]
            if f:
                feed_row[:f] = tok_row[[dst for dst, _ in step.feed]]
            feed_row[f:] = none
        else:
            # No row moves (the step before drafted nothing, or none of these rows was in it):
            # every shift source is `none`, whose accepted count is always 0, so the token and
            # feed rows, left as an earlier step staged them (row indices or `none`: in
            # bounds), index only zeros. Most plain steps under load: this staging was a
            # pipelined server's extra host work on them.
            src[:] = none
        if step.verify is None:
            # No row has drafts: each accepts none. The first-draft and logit indices stay
            # stale: the kernel masks its loads where a row has no drafts, and the torch
            # fallback clamps them into bounds.
            self.h_v_drafts[w][:] = 0
            return
        first, logit, drafts = step.verify
        self.h_v_first[w][:b] = first
        self.h_v_logit[w][:b] = logit
        self.h_v_drafts[w][:b] = drafts
        self.h_v_drafts[w][b:] = 0

    def replay(self, bucket: int, step: VarlenStep):
        """Stage the step's inputs (padded to `bucket`) in the next host twin and replay that
        twin's graph (which uploads them and copies the argmax back). Returns (logits [L, V],
        greedy tokens [L] in pinned host memory, the event after which those tokens are
        valid, the event recorded just before the replay — one replay in TIMING_EVERY, else
        None —, and with drafting on the device (drafts, found) per row in pinned memory, else
        None); the first len(step.logit_rows) rows are the step's. Nothing here waits."""
        w = self.twin
        self.twin ^= 1
        t, b, n_logits = step.num_tokens, step.num_rows, len(step.logit_rows)
        h_ids, h_pos, h_slots = self.h_ids[w], self.h_pos[w], self.h_slots[w]
        h_ids[:t] = step.ids
        h_ids[t:bucket] = 0
        h_pos[:t] = step.positions
        h_pos[t:bucket] = 0
        h_slots[:t] = step.slots
        h_slots[t:bucket] = -1
        h_logit_rows = self.h_logit_rows[w]
        h_logit_rows[:n_logits] = step.logit_rows
        h_logit_rows[n_logits : self._logit_rows_for(bucket)] = 0
        f = len(step.feed)
        h_dst, h_src = self.h_feed_dst[w], self.h_feed_src[w]
        if f:
            h_dst[:f], h_src[:f] = zip(*step.feed, strict=True)
        h_dst[f:] = self.scratch
        h_src[f:] = 0
        h_cu, h_seq_lens, h_tables = self.h_cu[w], self.h_seq_lens[w], self.h_tables[w]
        h_cu[: b + 1] = step.cu_seqlens
        h_cu[b + 1 :] = t  # empty rows after the real ones
        h_seq_lens[:b] = step.seq_lens
        h_seq_lens[b:] = 0
        for i, table in enumerate(step.tables):
            h_tables[i, : len(table)] = table
        if self.pipelined:
            self._stage_pipeline(w, step, bucket)
        drafted = None
        if self.dd is not None and step.drafting is None:
            self.h_dd_cap[w][:] = 0  # no row drafts (a plain step): lengths, offsets unread
        elif self.dd is not None:  # (step.drafting is set only where the runner drafts)
            lengths, caps, offsets = step.drafting
            self.h_dd_len[w][:b] = lengths
            self.h_dd_cap[w][:b] = caps
            self.h_dd_off[w][:b] = offsets
            self.h_dd_cap[w][b:] = 0
            if any(caps):
                drafted = (self.h_dd_drafts[w][:b], self.h_dd_found[w][:b])
        timed = self.replays % TIMING_EVERY == 0
        self.replays += 1
        if timed:
            self.began[w].record()
        self.twins[w][bucket].replay()
        n = self._logit_rows_for(bucket)
        self.done[w].record()
        began = self.began[w] if timed else None
        return self.logits[:n], self.h_argmax[w][:n], self.done[w], began, drafted
