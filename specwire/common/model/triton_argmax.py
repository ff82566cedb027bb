"""The greedy token of every logit row, in two small launches, inside the step's CUDA graph.

The graph copies the LM head's output into its static logits buffer and takes each row's
argmax. PyTorch does that as a copy and a reduction of ~one block a row: on the H200 the
argmax alone took 13 us a step at SmolLM2-135M's 49,152-entry vocabulary and 27 us at
Llama-3-8B's 128,256 (bench/RESULTS.md, round 28), against a whole step of 0.75 and 4.5 ms.

`copy_argmax` does both in two launches:
- `_chunk_kernel`, one program per (row, CHUNK entries): copies its entries to the logits
  buffer and writes the chunk's largest value and the first index holding it;
- `_rows_kernel`, one program per row: the first index of the largest of those.

The result is torch.argmax's: the first index of the row's maximum (an all -inf row gives 0).
Only NaN differs in a corner: a NaN ranks as +inf here, so a +inf before the first NaN wins,
where torch would return the NaN's index. No arithmetic, so no rounding: the index is the
same whatever the batch, on any GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import _grid_sync, launch_opts

CHUNK = 2048  # entries per first-pass program: SmolLM2 24 programs a row, Llama-3-8B 63
_NO_INDEX = 2**31 - 1


@triton.jit
def _chunk_kernel(
    src_ptr, dst_ptr, best_ptr, where_ptr, n_cols, stride_src, stride_dst, n_chunks,
    CHUNK: tl.constexpr, NO_INDEX: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < n_cols
    x = tl.load(src_ptr + row.to(tl.int64) * stride_src + offs, mask=ok, other=float("-inf"))
    tl.store(dst_ptr + row.to(tl.int64) * stride_dst + offs, x, mask=ok)
    key = tl.where(x != x, float("inf"), x.to(tl.float32))  # NaN ranks first
    best = tl.max(key, 0)
    where = tl.min(tl.where(ok & (key == best), offs, NO_INDEX), 0)
    tl.store(best_ptr + row * n_chunks + chunk, best)
    tl.store(where_ptr + row * n_chunks + chunk, where)


@triton.jit
def _rows_kernel(
    best_ptr, where_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr
):
    _grid_sync()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_chunks
    best = tl.load(best_ptr + row * n_chunks + offs, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * n_chunks + offs, mask=ok, other=NO_INDEX)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (best == top), where, NO_INDEX), 0).to(tl.int64))


def copy_argmax(src: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """dst[:] = src (cast to dst's dtype) and out[r] = the first index of row r's maximum.

    src [L, V] (last dim contiguous), dst [L, V] fp32, out [L] int64. Graph-capturable: the
    grids and the workspace depend on shapes only."""
    rows, n_cols = src.shape
    assert dst.shape == src.shape and out.shape == (rows,), (src.shape, dst.shape, out.shape)
    assert src.stride(-1) == 1 and dst.stride(-1) == 1 and out.dtype == torch.long
    assert 0 < n_cols < _NO_INDEX, n_cols
    if rows == 0:
        return
    n_chunks = triton.cdiv(n_cols, CHUNK)
    best = torch.empty(rows * n_chunks, dtype=torch.float32, device=src.device)
    where = torch.empty(rows * n_chunks, dtype=torch.int32, device=src.device)
    _chunk_kernel[(rows, n_chunks)](
        src, dst, best, where, n_cols, src.stride(0), dst.stride(0), n_chunks,
        CHUNK=CHUNK, NO_INDEX=_NO_INDEX, **launch_opts(),
    )  # fmt: skip
    _rows_kernel[(rows,)](
        best, where, out, n_chunks, BLOCK=triton.next_power_of_2(n_chunks), NO_INDEX=_NO_INDEX,
        **launch_opts(),
    )  # fmt: skip
