"""Triton kernels for the decoder layer: batch-invariant GEMM, RMSNorm (+ residual), SiLU·up, RoPE.

Inference only (no autograd) and graph-capturable: no host syncs, grids from shapes only.

`gate_up_silu` is the GEMM with `silu_mul` in its epilogue: bitwise `silu_mul(linear(...))`
(the same accumulators, rounded as `linear` stores them, then the same arithmetic) in one
launch instead of two, where `linear` has no K split.

**Exact mode.** Every kernel here computes each output row with the same instructions in the
same order whatever the number of rows `M`/`T` and wherever the row sits in the batch, so a row's
bits never depend on its batch:
- norms: one row per program; the reduction's block and warp count depend on `N` only;
- elementwise ops (silu_mul, rope, and gate_up_silu's epilogue) are per element;
- `linear`: one fixed tile config per weight shape `(N, K)` (never per `M`): BLOCK_M = 16, the
  whole K range of a split in one program, accumulated in a fixed order into fp32 with chained
  `tl.dot(a, b, acc)`; the K split count depends on `(N, K)` only, and the split partials are
  summed in split order by a second kernel. `M` is not specialised on (`do_not_specialize`), so
  every `M` runs the same binary.

The elementwise kernels mirror PyTorch's rounding (fp32 opmath, round to the tensor dtype after
every eager op) so they are bitwise equal to the eager formulas they replace. What all our
kernel modules share (PDL launches, the rounding helpers) is in `triton_base`; the GEMM's tile
configs per weight shape in `triton_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import (
    _INTERPRET,
    _cast,
    _exp,
    _f32,
    _grid_release,
    _grid_sync,
    _grid_wait,
    _index,
    _rsqrt,
    early_loads,
    launch_opts,
)
from specwire.common.model.triton_tiles import BLOCK_M, LinearConfig, WideConfig, linear_config

# ---------------------------------------------------------------------------------------------
# RMSNorm, with and without the residual add
# ---------------------------------------------------------------------------------------------


@triton.jit
def _add_row(x_ptr, res_ptr, row, cols, mask, x_stride, res_stride, HAS_RESIDUAL: tl.constexpr):
    """Row `row` of x (+ residual, rounded to x's dtype like the eager `x + residual`)."""
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = _cast(_f32(x) + _f32(r), x.dtype)
    return x


@triton.jit
def _inv_rms(x, N, eps):
    """rsqrt(mean(x^2) + eps) of one row in fp32, as F.rms_norm (CUDA's rsqrtf is libdevice's).
    The sum's order is set by the row's layout: its block and the kernel's warp count. Every
    kernel that normalises calls this on a row loaded by `_add_row` with `norm_warps(N)` warps,
    so a row's scale has the same bits wherever it is computed."""
    xf = x.to(tl.float32)
    return _rsqrt(tl.div_rn(tl.sum(xf * xf, axis=0), N.to(tl.float32)) + eps)


def norm_warps(n: int) -> int:
    """The RMSNorm's warps for rows of `n`: from N only (a fixed reduction tree per N)."""
    return min(16, max(1, triton.next_power_of_2(n) // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    x_stride, x_split_stride, res_stride, out_stride, new_res_stride,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, EARLY: tl.constexpr, X_SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if EARLY:  # the weight is constant: loaded while the previous kernel runs
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    _grid_sync()
    if X_SPLITS > 0:  # x is a K-split GEMM's fp32 partials (`SplitPartials`): summed here in
        # split order and rounded to the dtype, `_split_sum_kernel`'s arithmetic
        part = x_ptr + row * x_stride + cols
        acc = tl.load(part, mask=mask, other=0.0)
        for s in tl.static_range(1, X_SPLITS):
            acc += tl.load(part + s * x_split_stride, mask=mask, other=0.0)
        x = _cast(acc, w_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = _cast(_f32(x) + _f32(r), x.dtype)
    else:
        x = _add_row(x_ptr, res_ptr, row, cols, mask, x_stride, res_stride, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(new_res_ptr + row * new_res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = _cast(xf * _inv_rms(x, N, eps), x.dtype)  # `.to(x.dtype)`
    if not EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _cast(_f32(w) * _f32(normed), x.dtype)  # `weight * ...` in x.dtype
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def _norm_launch(x, residual, weight, eps):
    # x, residual: [T, N] (x may be a K-split GEMM's `SplitPartials`); weight: [N]
    parts = x.parts if isinstance(x, SplitPartials) else None
    xt = parts[0] if parts is not None else x
    if xt.dim() != 2 or xt.stride(-1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("rms_norm wants x [T, N] with unit last stride and weight [N] of x.dtype")
    t, n = xt.shape
    out = torch.empty((t, n), dtype=x.dtype, device=xt.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if t == 0:
        return out, new_res
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else xt
    _rms_norm_kernel[(t,)](
        xt, res, weight, out, new_res,
        xt.stride(0), parts.stride(0) if parts is not None else 0,
        res.stride(0), out.stride(0), new_res.stride(0),
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, EARLY=early_loads(),
        X_SPLITS=parts.shape[0] if parts is not None else 0,
        num_warps=norm_warps(n),
        **launch_opts(),
    )  # fmt: skip
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * F.rms_norm(x.float(), (N,), eps=eps).to(x.dtype)` for x [T, N] -> [T, N]."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, N]: the residual add fused.
    x may be a K-split GEMM's `SplitPartials`: their split sum rides in the norm's launch, bit
    for bit (one launch less)."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError("residual must match x in shape and dtype, with unit last stride")
    return _norm_launch(x, residual, weight, eps)


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, inter, BLOCK: tl.constexpr):
    _grid_sync()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0)
    up = tl.load(in_ptr + row * in_stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # PyTorch's CUDA silu: x / (1 + expf(-x)) in fp32 (IEEE division), rounded to the dtype;
    # then `silu * up` is one more fp32 multiply rounded to the dtype.
    silu = _cast(tl.div_rn(g, 1.0 + _exp(-g)), gate.dtype)
    y = _cast(_f32(silu) * _f32(up), gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` where gate, up = gate_up.chunk(2, -1): [T, 2I] -> [T, I]."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError("silu_mul wants gate_up [T, 2I] with unit last stride")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (t, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, **launch_opts()
    )
    return out


# ---------------------------------------------------------------------------------------------
# RoPE (rotate-half convention), q and k heads side by side
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate(x1, x2, cos_row, sin_row, d, HALF: tl.constexpr):
    """RoPE on (first half, second half) pairs of one position, with its cos/sin rows:
    eager `x * cos + rotate_half(x) * sin`, each product and the sum rounded to x's dtype."""
    dmask = d < HALF
    c1 = tl.load(cos_row + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    o1 = _cast(_f32(_cast(f1 * c1, dt)) + _f32(_cast(-f2 * s1, dt)), dt)
    o2 = _cast(_f32(_cast(f2 * c2, dt)) + _f32(_cast(f1 * s2, dt)), dt)
    return o1, o2


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    x_stride_t, x_stride_h, cos_stride, sin_stride, out_stride_t, out_stride_h,
    heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    x_row = x_ptr + t * x_stride_t + h * x_stride_h
    # Each thread loads and stores the same (first half, second half) pairs: in place is safe.
    x1 = tl.load(x_row + d, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
    o1, o2 = _rotate(x1, x2, cos_ptr + t * cos_stride, sin_ptr + t * sin_stride, d, HALF)
    o_row = out_ptr + t * out_stride_t + h * out_stride_h
    tl.store(o_row + d, o1, mask=mask)
    tl.store(o_row + HALF + d, o2, mask=mask)


def rope(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """`Rotary.apply`: qk [T, H, D] (any row/head strides), cos, sin [T, D] or [T, 1, D] of
    qk.dtype -> rotated [T, H, D] (written into qk when `inplace`, else a new tensor)."""
    t, heads, d = qk.shape
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if d % 2 or qk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope wants an even head_dim and unit last strides")
    if cos.shape != (t, d) or sin.shape != (t, d) or cos.dtype != qk.dtype or sin.dtype != qk.dtype:
        raise ValueError("cos/sin must be [T, D] in qk.dtype")
    out = qk if inplace else torch.empty((t, heads, d), dtype=qk.dtype, device=qk.device)
    if t == 0:
        return out
    _rope_kernel[(t,)](
        qk, cos, sin, out,
        qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        heads,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        **launch_opts(),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Batch-invariant linear: out = x @ weight.T (+ bias)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, FP32_IEEE: tl.constexpr):
    """`acc + a @ b`, chained: `_linear_kernel`'s product, for the kernels that must give its
    bits."""
    if _INTERPRET:
        # Its dot multiplies bf16's raw bits, and is numpy's fp32 matmul, whose summation order
        # follows the operands' shapes (one element in thousands differed between tile shapes).
        # In fp64 (exact products; sums rounded once to fp32, where their order all but never
        # shows) the tile's shape does not change a bit. The GPU path is untouched.
        prod = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")
        return (acc.to(tl.float64) + prod).to(tl.float32)
    elif FP32_IEEE:  # fp32 like cuBLAS without TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gemm_tile(
    x_ptr, w_ptr, rm, rw, w_ok, M, K, K_PER_SPLIT, x_stride, w_stride,
    FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """The fp32 tile x[rm, ks] @ W[rw, ks].T over the K range ks of this program's split (grid
    axis 2; K_PER_SPLIT = K: no split): tile column j reads weight row rw[j] (masked by
    w_ok[j]), so a kernel may gather the rows its epilogue wants side by side. Every GEMM here
    runs this loop: BLOCK_K steps in order, chained `_dot`s into one fp32 accumulator, so a
    tile element's bits depend only on (K, BLOCK_K, the split), never on M or on which weight
    row feeds its column."""
    return _norm_gemm_tile(
        x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, rm, rw, w_ok, M, K, K_PER_SPLIT,
        x_stride, 0, 0, w_stride, 0.0, False,
        False, False, FP32_IEEE, BLOCK_M, BLOCK_N, BLOCK_K, 16, EVEN_K,
    )  # fmt: skip


@triton.jit
def _norm_gemm_tile(
    x_ptr, res_ptr, nw_ptr, new_res_ptr, w_ptr, rm, rw, w_ok, M, K, K_PER_SPLIT,
    x_stride, res_stride, new_res_stride, w_stride, eps, write_res,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """`_gemm_tile`; with NORM, of rms_norm(x + residual) * nw instead of x (no K split): the
    RMSNorm kernel's arithmetic, bit for bit, folded into the GEMM. Each row's scale comes from
    `_inv_rms` on the whole row (loaded as the norm kernel loads it, NORM_BLOCK wide; the
    kernel must run `norm_warps(K)` warps), then each A tile is normalised elementwise as the
    norm kernel does it. Where `write_res`, the rows of x + residual are stored too.

    EVEN_K (`even_k`: BLOCK_K divides K, hence every split's range): the loads carry no K mask,
    only their row masks, so the compiler may move whole 16-byte vectors along K. Nothing
    loaded changes (no K element was ever masked then), so neither does a bit."""
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rm[:, None] * x_stride + (k_start + rk)[None, :]
    b_ptrs = w_ptr + rw[None, :] * w_stride + (k_start + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM:
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, NORM_BLOCK)
        inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
        m0 = tl.min(rm, axis=0)
        for i in range(0, _index(tl.minimum(M - m0, BLOCK_M))):
            x = _add_row(x_ptr, res_ptr, m0 + i, cols, cols < K, x_stride, res_stride, HAS_RESIDUAL)
            if HAS_RESIDUAL:  # as the norm kernel stores it; no store in the K loop below,
                # which would keep the compiler from pipelining its loads
                new_res_row = new_res_ptr + (m0 + i) * new_res_stride + cols
                tl.store(new_res_row, x, mask=(cols < K) & write_res)
            inv = tl.where(rows == i, _inv_rms(x, K, eps), inv)
        r_ptrs = res_ptr + rm[:, None] * res_stride + (k_start + rk)[None, :]
        nw_ptrs = nw_ptr + k_start + rk
    for k in range(_index(k_start), _index(k_end), BLOCK_K):
        if EVEN_K:
            kmask = rk >= 0  # all true, constant along K
        else:
            kmask = (k + rk) < k_end
        amask = (rm[:, None] < M) & kmask[None, :]
        a = tl.load(a_ptrs, mask=amask, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(r_ptrs, mask=amask, other=0.0)
                a = _cast(_f32(a) + _f32(r), a.dtype)
                r_ptrs += BLOCK_K
            normed = _cast(_f32(a) * inv[:, None], a.dtype)
            nw = tl.load(nw_ptrs, mask=kmask, other=0.0)
            a = _cast(_f32(nw)[None, :] * _f32(normed), a.dtype)
            nw_ptrs += BLOCK_K
        b = tl.load(b_ptrs, mask=w_ok[None, :] & kmask[:, None], other=0.0)
        acc = _dot(a, b, acc, FP32_IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _grid_release()
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K,
    x_stride, w_stride, out_stride, out_split_stride,
    K_PER_SPLIT,
    HAS_BIAS: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    _grid_wait()  # the GEMM tile (`_norm_gemm_tile`) releases after its K loop
    # Grid: (M tiles, N tiles, K splits). M tiles vary fastest, so the programs that read one
    # weight tile run together and share it through L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _gemm_tile(
        x_ptr, w_ptr, rm, rn, rn < N, M, K, K_PER_SPLIT, x_stride, w_stride,
        FP32_IEEE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
    )  # fmt: skip
    out_ptrs = out_ptr + pid_k * out_split_stride + rm[:, None] * out_stride + rn[None, :]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, _cast(acc, out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _split_sum_kernel(
    part_ptr, b_ptr, out_ptr, total, N, split_stride,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    # part: [SPLIT, M, N] fp32 (contiguous); out: [M, N] contiguous. Fixed order: split 0, 1, ...
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * split_stride + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _cast(acc, out_ptr.dtype.element_ty), mask=mask)


class SplitPartials:
    """A K-split GEMM's output before its split sum: the fp32 partials [S, M, N], one per K
    range, and the dtype their sum rounds to. `linear(..., defer=True)` returns it where the
    GEMM splits K and has no bias, for a consumer that sums the partials itself, in split
    order and with `_split_sum_kernel`'s arithmetic: `add_rms_norm` does (the o_proj and down
    outputs only ever reach the residual stream through the next norm), which saves the sum's
    launch. `dense()` is the sum as `linear` would have returned it, for any other consumer."""

    def __init__(self, parts: torch.Tensor, dtype: torch.dtype) -> None:
        self.parts = parts
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def dense(self) -> torch.Tensor:
        split, m, n = self.parts.shape
        out = torch.empty((m, n), dtype=self.dtype, device=self.parts.device)
        _split_sum(self.parts, None, out)
        return out


def dense(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    """x, with a `SplitPartials` summed."""
    return x.dense() if isinstance(x, SplitPartials) else x


def _split_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    split, m, n = parts.shape
    total, block = m * n, 1024
    _split_sum_kernel[(triton.cdiv(total, block),)](
        parts, bias if bias is not None else parts, out, total, n, m * n,
        SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block,
        **launch_opts(),
    )  # fmt: skip


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_m: int = BLOCK_M,
    config: LinearConfig | None = None,
    defer: bool = False,
) -> torch.Tensor | SplitPartials:
    """Batch-invariant `x @ weight.T + bias`: x [M, K], weight [N, K], bias [N] -> [M, N].

    fp32 accumulation; output in `out_dtype` (default x.dtype; torch.float32 for logits, which
    then skip the rounding to x.dtype). Each output row is bitwise independent of M and of the
    row's position in the batch (see `linear_config`). fp32 inputs use IEEE fp32 products (no
    TF32).

    `block_m` (experimental): 16, 32 or 64. Triton uses Hopper's wgmma only for tiles of a
    multiple of 64 rows with a multiple of 4 warps; 16 and 32 rows with 4 warps, and 64 rows
    with 2 warps, all stay on the same m16n8k16 mma.sync chain per row, so the bits should not
    change, while a larger tile re-reads the weight from L2 fewer times at large M. Pick it by
    M only once the GPU test `test_gpu_block_m_keeps_bits` has passed on the target GPU.

    `config` overrides `linear_config(N, K)` (`bench/gemm_sweep.py` times candidates).

    `defer`: where the GEMM splits K and has no bias, return its `SplitPartials` instead of
    summing them (for `add_rms_norm`, which sums them in its own launch)."""
    _check_linear(x, weight)
    if block_m not in (16, 32, 64):
        raise ValueError("block_m must be 16, 32 or 64 (mma.sync tiles)")
    cfg = config or linear_config(*weight.shape)
    warps = 2 if block_m == 64 else cfg.num_warps
    return _launch_linear(x, weight, bias, out_dtype, block_m, cfg, warps, defer)


def linear_wide(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    config: WideConfig,
    defer: bool = False,
) -> torch.Tensor | SplitPartials:
    """`x @ weight.T + bias` for non-exact steps wider than BLOCK_M rows, on `config`'s tiles
    (`triton_tiles.wide_config`: measured per weight shape and row range). `linear`'s kernel,
    but its row tile and warps are free, so Hopper's wgmma may run it: a row's bits may depend
    on the row count, as they do under cuBLAS, which it replaces there. `defer`: as `linear`'s."""
    _check_linear(x, weight)
    return _launch_linear(
        x, weight, bias, out_dtype, config.block_m, config, config.num_warps, defer
    )


UNMASKED_K = True  # False: every GEMM masks its K loads as before (bench/gemm_sweep.py --masked-k)


def even_k(k: int, block_k: int) -> bool:
    """Whether a GEMM of K = `k` on `block_k` tiles loads without K masks (`EVEN_K`)."""
    return UNMASKED_K and k % block_k == 0


def _check_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    k = x.shape[1]
    if weight.shape[1] != k or weight.dtype != x.dtype or x.stride(-1) != 1:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    if weight.stride(-1) != 1:
        raise ValueError("linear wants weight [N, K] with unit last stride")


def _launch_linear(x, weight, bias, out_dtype, block_m: int, cfg, num_warps: int, defer=False):
    """`_linear_kernel` on `block_m`-row tiles and cfg's N/K tiles and split, then the split
    sum in split order (with `defer` and no bias: the partials, `SplitPartials`)."""
    (m, k), n = x.shape, weight.shape[0]
    dtype = out_dtype or x.dtype
    has_bias = bias is not None
    if cfg.split_k == 1 or m == 0:
        out = target = torch.empty((m, n), dtype=dtype, device=x.device)
        if m == 0:
            return out
    else:
        target = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _linear_kernel[grid](
        x, weight, bias if has_bias else x, target,
        m, n, k,
        x.stride(0), weight.stride(0), n, m * n,
        cfg.k_per_split,
        HAS_BIAS=has_bias and cfg.split_k == 1, FP32_IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=even_k(k, cfg.block_k),
        num_warps=num_warps, num_stages=cfg.num_stages,
        **launch_opts(),
    )  # fmt: skip
    if cfg.split_k == 1:
        return out
    if defer and not has_bias:
        return SplitPartials(target, dtype)
    out = torch.empty((m, n), dtype=dtype, device=x.device)
    _split_sum(target, bias, out)
    return out


# ---------------------------------------------------------------------------------------------
# The gate_up GEMM with SiLU·up in its epilogue
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    x_ptr, res_ptr, nw_ptr, new_res_ptr, w_ptr, out_ptr,
    M, INTER, K, eps,
    x_stride, res_stride, new_res_stride, w_stride, out_stride,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    _grid_wait()  # the GEMM tile (`_norm_gemm_tile`) releases after its K loop
    # `_linear_kernel` without a K split over the weight rows gate 0, up 0, gate 1, up 1, ...:
    # tile column 2j + h is weight row h * INTER + (the program's first output column + j).
    # The same K loop and chained dots on a tile of the same shape give each accumulator
    # element the products in the same order as the plain GEMM (which weight row feeds a tile
    # column does not change the order along K), and the same warp layout.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = tl.arange(0, BLOCK_N)
    col = pid_n.to(tl.int64) * (BLOCK_N // 2) + cn // 2  # output column of each tile column
    rw = col + (cn % 2) * INTER  # its weight row
    acc = _norm_gemm_tile(
        x_ptr, res_ptr, nw_ptr, new_res_ptr, w_ptr, rm, rw, col < INTER, M, K, K,
        x_stride, res_stride, new_res_stride, w_stride, eps, pid_n == 0,
        NORM, HAS_RESIDUAL, FP32_IEEE, BLOCK_M, BLOCK_N, BLOCK_K, NORM_BLOCK, EVEN_K,
    )  # fmt: skip
    dt = out_ptr.dtype.element_ty
    # `linear` stores gate_up rounded to the dtype; then `_silu_mul_kernel`'s arithmetic on it.
    gate, up = tl.split(tl.reshape(_cast(acc, dt), (BLOCK_M, BLOCK_N // 2, 2)))
    g = _f32(gate)
    silu = _cast(tl.div_rn(g, 1.0 + _exp(-g)), dt)
    y = _cast(_f32(silu) * _f32(up), dt)
    rn = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    omask = (rm[:, None] < M) & (rn[None, :] < INTER)
    tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], y, mask=omask)


def norm_fuses(k: int, config: LinearConfig) -> bool:
    """Whether a GEMM of K = `k` with these tiles may take the RMSNorm in its prologue bit for
    bit (`add_norm_gate_up_silu`, `triton_fused.add_norm_qkv_rope_store`): no K split, and the
    norm kernel's warp count, so each row's mean square is summed in the same order."""
    return config.split_k == 1 and config.num_warps == norm_warps(k)


def _norm_operands(x, residual, norm_weight, config, name):
    """The norm prologue's tensors and the new residual (x + residual; x for the first layer)."""
    m, k = x.shape
    if not norm_fuses(k, config):
        raise ValueError(f"{name}: these tiles cannot take the norm (K split or warp count)")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(-1) != 1:
        raise ValueError(f"{name}: norm weight must be [{k}] of x's dtype")
    if residual is None:
        return x, x
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"{name}: residual must match x in shape and dtype, unit last stride")
    return residual, torch.empty((m, k), dtype=x.dtype, device=x.device)


def _gate_up_silu_launch(x, weight, config, norm):
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype or x.stride(-1) != 1 or n % 2:
        raise ValueError(f"gate_up_silu: x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("gate_up_silu wants weight [2I, K] with unit last stride")
    cfg = config or linear_config(n, k)
    if cfg.split_k != 1:
        raise ValueError("gate_up_silu: no K split (the split sum would round elsewhere)")
    res, new_res, nw, eps = x, x, x, 0.0
    if norm is not None:
        residual, nw, eps = norm
        res, new_res = _norm_operands(x, residual, nw, cfg, "add_norm_gate_up_silu")
    inter = n // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, new_res
    _gate_up_silu_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(inter, cfg.block_n // 2))](
        x, res, nw, new_res, weight, out,
        m, inter, k, eps,
        x.stride(0), res.stride(0), new_res.stride(0), weight.stride(0), out.stride(0),
        NORM=norm is not None, HAS_RESIDUAL=norm is not None and norm[0] is not None,
        FP32_IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_BLOCK=triton.next_power_of_2(k), EVEN_K=even_k(k, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(),
    )  # fmt: skip
    return out, new_res


def gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None
) -> torch.Tensor:
    """`silu_mul(linear(x, weight))` in one launch, bit for bit: x [M, K], weight [2I, K] (the
    gate rows, then the up rows) -> [M, I]. Saves the [M, 2I] round trip and the `silu_mul`
    launch: a kernel a layer in launch-bound decode and verify steps.

    Bitwise equal to `linear(x, weight, config=config)` (BLOCK_M rows a tile) then `silu_mul`
    for configs without a K split (which would sum fp32 partials in a second kernel): each
    program is a plain GEMM program of the config's tile (`block_n` weight rows: `block_n / 2`
    output columns' gate and up rows), so the accumulators, the program count and the warp
    layout are `_linear_kernel`'s; they are rounded as it stores them."""
    return _gate_up_silu_launch(x, weight, config, None)[0]


def add_norm_gate_up_silu(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: LinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_silu(h, weight), x + residual) where h, _ = add_rms_norm(x, residual, ...)
    (rms_norm(x) and x without a residual), in one launch and bit for bit, where `norm_fuses`:
    the norm kernel's launch saved. Programs of N tile 0 store the new residual."""
    return _gate_up_silu_launch(x, weight, config, (residual, norm_weight, eps))
