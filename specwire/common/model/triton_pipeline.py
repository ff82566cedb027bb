"""Pipelined drafting steps' two small jobs inside the step's CUDA graph, one launch each.

`runner/pipeline.py` says what they compute and holds the PyTorch reference (the eager path and
the CPU use it): `shift_rows` moves a step's rows by the step before's accepted drafts,
`accepted_counts` counts this step's. As PyTorch ops they are ~20 small kernels a step, which
every step of a pipelined server pays, plain ones too: on an H100 a one-stream plain step took
0.799 ms of device time with them against 0.714 on a server without drafting on the device,
and 0.753 with these two launches (0.738 with drafting on the device alone; bench/RESULTS.md,
round 51). Here each is one program: a step has at most a few thousand tokens and a few
hundred rows.

No arithmetic beyond integer adds, so the results are the reference's exactly (test:
tests/test_triton_pipeline.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import _grid_sync, _index, launch_opts

_BLOCK = 256


@triton.jit
def _shift_kernel(
    acc_ptr, src_ptr, tok_row_ptr, feed_row_ptr, pos_ptr, slots_ptr, seq_lens_ptr, feed_src_ptr,
    tables_ptr, lookup_ptr, n_tokens, n_rows, n_feed, table_stride, max_col,
    BS: tl.constexpr, HAS_LOOKUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    offs = tl.arange(0, BLOCK)
    for r0 in range(0, _index(n_rows), BLOCK):
        r = r0 + offs
        ok = r < n_rows
        shift = tl.load(acc_ptr + tl.load(src_ptr + r, mask=ok, other=0), mask=ok, other=0)
        seq = tl.load(seq_lens_ptr + r, mask=ok, other=0)
        tl.store(seq_lens_ptr + r, seq + shift.to(seq.dtype), mask=ok)
        if HAS_LOOKUP:
            n = tl.load(lookup_ptr + r, mask=ok, other=0)
            tl.store(lookup_ptr + r, n + shift, mask=ok)
    for f0 in range(0, _index(n_feed), BLOCK):
        f = f0 + offs
        ok = f < n_feed
        row = tl.load(feed_row_ptr + f, mask=ok, other=0)
        shift = tl.load(acc_ptr + tl.load(src_ptr + row, mask=ok, other=0), mask=ok, other=0)
        src = tl.load(feed_src_ptr + f, mask=ok, other=0)
        tl.store(feed_src_ptr + f, src + shift, mask=ok)
    for t0 in range(0, _index(n_tokens), BLOCK):
        t = t0 + offs
        ok = t < n_tokens
        row = tl.load(tok_row_ptr + t, mask=ok, other=0)
        shift = tl.load(acc_ptr + tl.load(src_ptr + row, mask=ok, other=0), mask=ok, other=0)
        p = tl.load(pos_ptr + t, mask=ok, other=0) + shift
        tl.store(pos_ptr + t, p, mask=ok)
        moved = ok & (shift > 0)
        at = tl.minimum(row, n_rows - 1).to(tl.int64) * table_stride + tl.minimum(p // BS, max_col)
        block = tl.load(tables_ptr + at, mask=moved, other=0).to(tl.int64)
        tl.store(slots_ptr + t, block * BS + p % BS, mask=moved)


def shift_rows_triton(
    acc, shift_src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, lookup_lens,
    block_size: int,
) -> None:  # fmt: skip
    """`runner.pipeline.shift_rows` in one launch (same arguments, same results)."""
    assert tables.stride(1) == 1 and tables.dtype == torch.int32
    dummy = lookup_lens if lookup_lens is not None else seq_lens
    _shift_kernel[(1,)](
        acc, shift_src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, dummy,
        tok_row.numel(), tables.shape[0], feed_row.numel(), tables.stride(0),
        tables.shape[1] - 1, BS=block_size, HAS_LOOKUP=lookup_lens is not None, BLOCK=_BLOCK,
        **launch_opts(),
    )  # fmt: skip


@triton.jit
def _accept_kernel(
    ids_ptr, argmax_ptr, first_ptr, logit_ptr, drafts_ptr, cap_ptr, found_ptr, out_ptr,
    n_rows, n_ids, n_argmax,
    HAS_FOUND: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    j = tl.arange(0, K)[None, :]
    for r0 in range(0, _index(n_rows), ROWS):
        r = r0 + tl.arange(0, ROWS)
        ok = r < n_rows
        k = tl.load(drafts_ptr + r, mask=ok, other=0)
        if HAS_FOUND:  # a row drafted on the device without a match has no drafts
            cap = tl.load(cap_ptr + r, mask=ok, other=0)
            found = tl.load(found_ptr + r, mask=ok, other=0)
            k = tl.where((cap > 0) & (found.to(tl.int32) == 0), 0, k)
        first = tl.load(first_ptr + r, mask=ok, other=0)[:, None]
        logit = tl.load(logit_ptr + r, mask=ok, other=0)[:, None]
        live = ok[:, None] & (j < k[:, None])
        a = tl.load(ids_ptr + tl.minimum(first + j, n_ids - 1), mask=live, other=0)
        b = tl.load(argmax_ptr + tl.minimum(logit + j, n_argmax - 1), mask=live, other=0)
        miss = tl.where(live & (a == b), K, j)  # the first draft not accepted (or K)
        tl.store(out_ptr + r, tl.minimum(tl.min(miss, 1), k).to(tl.int64), mask=ok)


def accepted_counts_triton(
    ids, argmax, first_draft, first_logit, drafts, max_drafts: int, out, cap=None, found=None
) -> None:
    """`runner.pipeline.accepted_counts` into `out` in one launch; with `cap` and `found`
    (drafting on the device), a row that drafted there (cap > 0) without a match has none."""
    rows = first_draft.numel()
    has_found = found is not None
    _accept_kernel[(1,)](
        ids, argmax, first_draft, first_logit, drafts,
        cap if has_found else drafts, found if has_found else drafts, out,
        rows, ids.numel(), argmax.numel(),
        HAS_FOUND=has_found, ROWS=64, K=triton.next_power_of_2(max(1, max_drafts)),
        **launch_opts(),
    )  # fmt: skip
