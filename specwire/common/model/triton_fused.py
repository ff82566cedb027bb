"""Fused Triton kernels for small steps.

At the token counts of decode and verify steps (a few rows of 1 + K tokens) a layer's time is
launch latency, not work: SmolLM2-135M's ~11 kernels of 1-8 µs each. Two kinds of fusions cut
them. Bit-exact ones, which the default `TritonOps` use (8 launches a layer):

- `rope_store_kv`: RoPE on q and k in place and the store of k and v into the paged cache (what
  `triton_ops.rope` then `triton_attention.store_kv` do), in one launch, for any step.
- `qkv_rope_store`: the qkv GEMM with `rope_store_kv`'s work in its epilogue, where the GEMM is
  `triton_ops.linear` without a K split (steps of at most 16 tokens): one launch for three.

And, for `--fused` only (7 launches a layer, not bitwise):

- `add_norm_linear`: `linear(rms_norm(x + residual) * w_norm, W)` and the new residual
  `x + residual` in one kernel (the qkv and gate_up projections). Every program recomputes its
  rows' mean square over all of K (pass 1) before its dot loop re-reads the rows (pass 2): K is
  the hidden size (576 to 4096), so the second read hits L2. The program at (N tile 0, split 0)
  of each row tile writes the new residual.
- `silu_linear`: `linear(silu(gate) * up, W)` reading gate_up [M, 2I] directly (down_proj),
  with `rope_store_kv` beside them.

Rounding mirrors the unfused path: fp32 opmath, and every activation rounded to the tensor dtype
where the eager op would round it (the normalised row, `w_norm * normed`, silu, silu * up), so
the dot consumes the same operand bits as `add_rms_norm` + `linear` does. The products are
accumulated in fp32 in this kernel's K order, not cuBLAS's, so outputs agree with the unfused
path to an ulp or so, not bitwise (the mean square's fp32 sum order differs from the norm
kernel's too). RoPE + store is elementwise and calls the rope kernel's own `_rotate`: bitwise
the same as the two kernels it replaces (the compiler contracts x * cos + r * sin into FMAs,
in bf16 and fp32, and for sm_90 it contracts the same products in all three kernels: their
PTX has the same float instructions in the same order). `qkv_rope_store`'s GEMM is `linear`'s
own loop on a tile of the same shape (only which weight rows feed a tile column differs).

The GEMM kernels do not specialise on M: every M runs one binary per weight shape. The
`--fused` ones use `triton_tiles.linear_config`'s tiles (BLOCK_M 16, N tiles of 32 or 64, a K
split for long K with few N tiles, whose fp32 partials `triton_ops`' split-sum kernel adds in
order). `TritonOps(fused=True)` routes steps of at most `MAX_TOKENS` tokens to them; wider
steps, and the exact mode, keep the unfused path (cuBLAS, or the batch-invariant GEMM).
Graph-capturable: grids and buffers from shapes only, no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_attention import _check_cache
from specwire.common.model.triton_base import (
    _cast,
    _exp,
    _f32,
    _grid_sync,
    _grid_wait,
    _index,
    _rsqrt,
    launch_opts,
)
from specwire.common.model.triton_ops import (
    _dot,
    _norm_gemm_tile,
    _norm_operands,
    _rotate,
    _split_sum,
    even_k,
)
from specwire.common.model.triton_tiles import BLOCK_M, LinearConfig, linear_config

# Steps of up to this many tokens take the fused GEMMs: one row tile (BLOCK_M), where a GEMM is
# weight-streaming and launch-bound. Wider steps re-read the weight per row tile and recompute
# the prologue per N tile; there cuBLAS wins and the launches matter less.
MAX_TOKENS = BLOCK_M
# Columns per pass-1 chunk. Pass 1's loop is software-pipelined (`tl.range(num_stages=3)`:
# cp.async, the next chunks in flight), not unrolled: unrolled, K = 4096 spilled on sm_90.
_NORM_BLOCK = 256


@triton.jit
def _row_sum(x_ptr, res_ptr, rm, cols, mask, x_stride, res_stride, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) at [rm, cols], rounded to x's dtype like the eager `x + residual`."""
    x = tl.load(x_ptr + rm[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rm[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = _cast(_f32(x) + _f32(r), x.dtype)
    return x


@triton.jit
def _store_tile(
    acc, out_ptr, b_ptr, rm, rn, pid_k, M, N, out_stride, out_split_stride, HAS_BIAS: tl.constexpr
):
    """Write an fp32 tile (+ bias) to out (its dtype), at split `pid_k`'s slice of a workspace."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_k * out_split_stride + rm[:, None] * out_stride + rn[None, :]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptrs, _cast(acc, out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _weight_tile(w_ptr, rn, cols, kmask, N, w_stride):
    """The [BLOCK_K, BLOCK_N] tile of W [N, K] for output columns `rn` and inputs `cols`."""
    return tl.load(
        w_ptr + rn[None, :] * w_stride + cols[:, None],
        mask=(rn[None, :] < N) & kmask[:, None],
        other=0.0,
    )


@triton.jit(do_not_specialize=["M"])
def _add_norm_linear_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, new_res_ptr,
    M, N, eps,
    x_stride, res_stride, new_res_stride, w_stride, out_stride, out_split_stride,
    K_PER_SPLIT,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    # Pass 1: each row's mean square over all of K (F.rms_norm's statistic, in fp32). The
    # program at N tile 0, split 0 writes the row tile's new residual (the others none: M 0).
    res_rows = rm < tl.where((pid_n == 0) & (pid_k == 0), M, 0)
    rc = tl.arange(0, NORM_BLOCK)
    sq = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
    # (Its names differ from pass 2's: a name may not change shape across loops.)
    for k0 in tl.range(0, K, NORM_BLOCK, num_stages=3):
        ncols = k0 + rc
        ncol_ok = (ncols < K)[None, :]
        nmask = row_ok[:, None] & ncol_ok
        row = _row_sum(x_ptr, res_ptr, rm, ncols, nmask, x_stride, res_stride, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            new_res = new_res_ptr + rm[:, None] * new_res_stride + ncols[None, :]
            tl.store(new_res, row, mask=res_rows[:, None] & ncol_ok)
        rowf = _f32(row)
        sq += rowf * rowf
    mean_sq = tl.div_rn(tl.sum(sq, axis=1), tl.full((BLOCK_M,), K, tl.float32))
    inv_rms = _rsqrt(mean_sq + eps)
    # Pass 2: the dot over this split's K range, the operand normalised on the fly.
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(_index(k_start), _index(k_end), BLOCK_K):
        cols = k + rk
        kmask = cols < k_end
        s = _row_sum(
            x_ptr, res_ptr, rm, cols, row_ok[:, None] & kmask[None, :], x_stride, res_stride,
            HAS_RESIDUAL,
        )  # fmt: skip
        dt = s.dtype
        # `add_rms_norm`'s roundings: `.to(x.dtype)` of the normalised row, then `weight * ...`
        normed = _cast(_f32(s) * inv_rms[:, None], dt)
        nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0)
        a = _cast(_f32(nw)[None, :] * _f32(normed), dt)
        b = _weight_tile(w_ptr, rn, cols, kmask, N, w_stride)
        acc = _dot(a, b, acc, FP32_IEEE)
    _store_tile(acc, out_ptr, b_ptr, rm, rn, pid_k, M, N, out_stride, out_split_stride, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _silu_linear_kernel(
    gu_ptr, w_ptr, out_ptr,
    M, N, K,
    gu_stride, w_stride, out_stride, out_split_stride,
    K_PER_SPLIT,
    FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(_index(k_start), _index(k_end), BLOCK_K):
        cols = k + rk
        kmask = cols < k_end
        mask = (rm[:, None] < M) & kmask[None, :]
        rows = gu_ptr + rm[:, None] * gu_stride + cols[None, :]
        gate = tl.load(rows, mask=mask, other=0.0)
        up = tl.load(rows + K, mask=mask, other=0.0)
        g = _f32(gate)
        # `silu_mul`'s roundings: silu = x / (1 + expf(-x)) to the dtype, then `silu * up`.
        silu = _cast(tl.div_rn(g, 1.0 + _exp(-g)), gate.dtype)
        a = _cast(_f32(silu) * _f32(up), gate.dtype)
        b = _weight_tile(w_ptr, rn, cols, kmask, N, w_stride)
        acc = _dot(a, b, acc, FP32_IEEE)
    _store_tile(acc, out_ptr, w_ptr, rm, rn, pid_k, M, N, out_stride, out_split_stride, False)


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, k: int, name: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"{name} wants 2-D x and weight [N, K] with unit last strides")
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")


def _split_target(m: int, n: int, split: int, out: torch.Tensor) -> torch.Tensor:
    """Where the GEMM kernel writes: `out` itself, or an fp32 [split, M, N] workspace."""
    if split == 1:
        return out
    return torch.empty((split, m, n), dtype=torch.float32, device=out.device)


def _split_stride(target: torch.Tensor) -> int:
    """Elements between split partials; 0 without a split, so that no launch argument derived
    from M (M * N) selects another specialisation of the kernel."""
    return target.stride(0) if target.dim() == 3 else 0


def _sum_splits(target: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = sum of the split partials in split order (+ bias): `triton_ops.linear`'s second
    kernel. Nothing to do without a split (the GEMM wrote `out` and its bias)."""
    if target is not out:
        _split_sum(target, bias, out)


def add_norm_linear(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K], or None: no residual add (the first layer)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: LinearConfig | None = None,  # default linear_config(N, K)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, N], the new residual [M, K])
    """`linear(rms_norm(x + residual) * norm_weight, weight, bias)` and `x + residual` (x itself
    when `residual` is None), as `triton_ops.add_rms_norm` then `linear` would give them."""
    _check_gemm(x, weight, x.shape[-1], "add_norm_linear")
    m, k = x.shape
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError("add_norm_linear wants norm_weight [K] of x.dtype, contiguous")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        raise ValueError("residual must match x in shape and dtype, with unit last stride")
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, new_res
    cfg = config or linear_config(n, k)
    target = _split_target(m, n, cfg.split_k, out)
    res = residual if residual is not None else x
    _add_norm_linear_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, res, norm_weight, weight, bias if bias is not None else x, target, new_res,
        m, n, eps,
        x.stride(0), res.stride(0), new_res.stride(0), weight.stride(0), n, _split_stride(target),
        cfg.k_per_split,
        K=k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None and target is out,
        FP32_IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, NORM_BLOCK=min(_NORM_BLOCK, triton.next_power_of_2(k)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(),
    )  # fmt: skip
    _sum_splits(target, out, bias)
    return out, new_res


def silu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None
) -> torch.Tensor:
    """`linear(silu(gate) * up, weight)` for gate, up = gate_up.chunk(2, -1):
    gate_up [M, 2I], weight [N, I] -> [M, N], as `triton_ops.silu_mul` then `linear` would."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError("silu_linear wants gate_up [M, 2I]")
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    _check_gemm(gate_up, weight, k, "silu_linear")
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    if m == 0:
        return out
    cfg = config or linear_config(n, k)
    target = _split_target(m, n, cfg.split_k, out)
    _silu_linear_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n), cfg.split_k)](
        gate_up, weight, target,
        m, n, k,
        gate_up.stride(0), weight.stride(0), n, _split_stride(target),
        cfg.k_per_split,
        FP32_IEEE=gate_up.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(),
    )  # fmt: skip
    _sum_splits(target, out, None)
    return out


# ---------------------------------------------------------------------------------------------
# RoPE on q and k, and the KV-cache store
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rope_store_kv_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
    qk_stride_t, qk_stride_h, v_stride_t, v_stride_h, cos_stride, sin_stride,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    block_size, num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _grid_sync()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Slot -1: a padding token, rotated but not stored (no KV head of it is).
    stored_heads = tl.where(slot >= 0, num_kv_heads, 0)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    cache_dt = cache_ptr.dtype.element_ty
    # v first: it does not depend on the rotation.
    hv = tl.arange(0, BLOCK_KVH)[:, None]
    dv = tl.arange(0, BLOCK_D)[None, :]
    vmask = (hv < stored_heads) & (dv < 2 * HALF)
    v = tl.load(v_ptr + t * v_stride_t + hv * v_stride_h + dv, mask=vmask)
    tl.store(dst + stride_ckv + hv * stride_ch + dv, v.to(cache_dt), mask=vmask)
    # `triton_ops._rope_kernel` over the q heads then the k heads, in place.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    mask = (h < num_heads + num_kv_heads) & dmask
    row = qk_ptr + t * qk_stride_t + h * qk_stride_h
    x1 = tl.load(row + d, mask=mask, other=0.0)
    x2 = tl.load(row + HALF + d, mask=mask, other=0.0)
    o1, o2 = _rotate(x1, x2, cos_ptr + t * cos_stride, sin_ptr + t * sin_stride, d, HALF)
    # Each thread stores the same pairs it loaded: in place is safe.
    tl.store(row + d, o1, mask=mask)
    tl.store(row + HALF + d, o2, mask=mask)
    # The k heads (rows num_heads..) into the cache; q rows are masked off.
    kmask = (h >= num_heads) & (h < num_heads + stored_heads) & dmask
    kdst = dst + (h - num_heads) * stride_ch + d
    tl.store(kdst, o1.to(cache_dt), mask=kmask)
    tl.store(kdst + HALF, o2.to(cache_dt), mask=kmask)


def rope_store_kv(
    qk: torch.Tensor,  # [T, H + KVH, D]: q heads then k heads (any row/head strides)
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, D] or [T, 1, D], qk.dtype
    sin: torch.Tensor,  # [T, D] or [T, 1, D], qk.dtype
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] flat slot block * BS + offset; -1 = skip (padding)
    num_heads: int,
) -> None:
    """Rotate q and k in place (`triton_ops.rope(qk, cos, sin, inplace=True)`), then write the
    rotated k and v into their cache slots (`triton_attention.store_kv`), in one launch."""
    t, heads, d = qk.shape
    kvh = heads - num_heads
    _check_cache(kv_cache, kvh, d)
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if d % 2 or qk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_store_kv wants an even head_dim and unit last strides")
    if cos.shape != (t, d) or sin.shape != (t, d) or cos.dtype != qk.dtype or sin.dtype != qk.dtype:
        raise ValueError("cos/sin must be [T, D] in qk.dtype")
    if v.shape != (t, kvh, d) or v.stride(-1) != 1 or slot_mapping.shape != (t,):
        raise ValueError("v must be [T, KVH, D] with unit last stride, slot_mapping [T]")
    if t == 0:
        return
    _rope_store_kv_kernel[(t,)](
        qk, v, cos, sin, kv_cache, slot_mapping,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        *kv_cache.stride()[:4],
        kv_cache.shape[2], num_heads, kvh,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_D=triton.next_power_of_2(d),
        **launch_opts(),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The qkv GEMM with RoPE and the KV-cache store in its epilogue
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_store_kernel(
    x_ptr, res_ptr, nw_ptr, new_res_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, cache_ptr,
    slot_ptr,
    M, N, K, eps,
    x_stride, res_stride, new_res_stride, w_stride, out_stride, cos_stride, sin_stride,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    block_size, num_heads, num_kv_heads,
    HALF: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    _grid_wait()  # the GEMM tile (`_norm_gemm_tile`) releases after its K loop
    # `triton_ops._linear_kernel` without a K split over the weight rows of RoPE pairs: tile
    # column 2i + h is the h-th half (column j or HALF + j of its head) of the program's i-th
    # (head, j) pair. The same K loop and chained dots on a tile of the same shape give each
    # accumulator element `linear`'s products in `linear`'s order, and its warp layout.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = tl.arange(0, BLOCK_N)
    pair = pid_n.to(tl.int64) * (BLOCK_N // 2) + cn // 2
    col = (pair // HALF) * (2 * HALF) + pair % HALF + (cn % 2) * HALF  # its qkv column
    acc = _norm_gemm_tile(
        x_ptr, res_ptr, nw_ptr, new_res_ptr, w_ptr, rm, col, col < N, M, K, K,
        x_stride, res_stride, new_res_stride, w_stride, eps, pid_n == 0,
        NORM, HAS_RESIDUAL, FP32_IEEE, BLOCK_M, BLOCK_N, BLOCK_K, NORM_BLOCK, EVEN_K,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=col < N, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    # What `linear` stores, then `rope_store_kv`'s arithmetic on it (its `_rotate`).
    x1, x2 = tl.split(tl.reshape(_cast(acc, dt), (BLOCK_M, BLOCK_N // 2, 2)))
    p = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head = (p // HALF)[None, :]
    d = (p % HALF)[None, :]
    row = tl.minimum(rm, M - 1)[:, None]  # rows past M: some row's cos/sin, never stored
    o1, o2 = _rotate(x1, x2, cos_ptr + row * cos_stride, sin_ptr + row * sin_stride, d, HALF)
    rotated = head < num_heads + num_kv_heads  # q and k heads; v heads pass as they are
    o1 = tl.where(rotated, o1, x1)
    o2 = tl.where(rotated, o2, x2)
    row_ok = (rm < M)[:, None]
    out = out_ptr + rm[:, None] * out_stride + head * (2 * HALF) + d
    omask = row_ok & (head < num_heads + 2 * num_kv_heads)
    tl.store(out, o1, mask=omask)
    tl.store(out + HALF, o2, mask=omask)
    # k heads (num_heads..) into cache[0], v heads into cache[1]; slot -1 (padding): nowhere.
    slot = tl.load(slot_ptr + rm, mask=rm < M, other=-1).to(tl.int64)[:, None]
    kv = head - num_heads
    is_v = kv >= num_kv_heads
    dst = (
        cache_ptr + is_v * stride_ckv + (slot // block_size) * stride_cb
        + (slot % block_size) * stride_cs + tl.where(is_v, kv - num_kv_heads, kv) * stride_ch + d
    )  # fmt: skip
    smask = omask & (slot >= 0) & (kv >= 0)
    cache_dt = cache_ptr.dtype.element_ty
    tl.store(dst, o1.to(cache_dt), mask=smask)
    tl.store(dst + HALF, o2.to(cache_dt), mask=smask)


def qkv_rope_store(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [(H + 2 KVH) * D, K]: the q, k and v rows
    bias: torch.Tensor | None,  # [(H + 2 KVH) * D]
    cos: torch.Tensor,  # [T, D] or [T, 1, D], x.dtype
    sin: torch.Tensor,  # [T, D] or [T, 1, D], x.dtype
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] flat slot block * BS + offset; -1 = skip (padding)
    num_heads: int,
    config: LinearConfig | None = None,  # default linear_config(N, K)
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> torch.Tensor:  # [T, (H + 2 KVH) * D]: q and k rotated, v
    """`triton_ops.linear(x, weight, bias)` then `rope_store_kv` on its q/k and v, in one launch
    and bit for bit, for configs without a K split: each program is a plain GEMM program of the
    config's tile over the weight rows of `block_n / 2` RoPE pairs (columns j and D/2 + j of a
    head), so it holds both halves of each pair and rotates and stores them itself.

    `norm` = (residual or None, norm weight, eps): the GEMM's input is first
    `add_rms_norm(x, residual, ...)` (`rms_norm(x)` without a residual), folded into its
    prologue bit for bit where `triton_ops.norm_fuses`; use `add_norm_qkv_rope_store`, which
    also returns the new residual."""
    return _qkv_rope_store_launch(
        x, weight, bias, cos, sin, kv_cache, slot_mapping, num_heads, config, norm
    )[0]


def add_norm_qkv_rope_store(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    config: LinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv_rope_store(h, ...), x + residual) for h, _ = add_rms_norm(x, residual, ...): the
    layer's norm, qkv GEMM, RoPE and KV store in one launch (x for the first layer's residual).
    Programs of N tile 0 store the new residual."""
    return _qkv_rope_store_launch(
        x, weight, bias, cos, sin, kv_cache, slot_mapping, num_heads, config,
        (residual, norm_weight, eps),
    )  # fmt: skip


def _qkv_rope_store_launch(
    x, weight, bias, cos, sin, kv_cache, slot_mapping, num_heads, config, norm
):
    t, k = x.shape
    n = weight.shape[0]
    kvh, d = kv_cache.shape[3], kv_cache.shape[4]
    _check_gemm(x, weight, k, "qkv_rope_store")
    _check_cache(kv_cache, kvh, d)
    if d % 2 or n != (num_heads + 2 * kvh) * d:
        raise ValueError(f"qkv_rope_store: weight {tuple(weight.shape)} is not q, k, v heads")
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos.shape != (t, d) or sin.shape != (t, d) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("cos/sin must be [T, D] in x.dtype")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or slot_mapping.shape != (t,):
        raise ValueError("cos/sin want a unit last stride, slot_mapping [T]")
    cfg = config or linear_config(n, k)
    if cfg.split_k != 1:
        raise ValueError("qkv_rope_store: no K split (the split sum would round elsewhere)")
    res, new_res, nw, eps = x, x, x, 0.0
    if norm is not None:
        residual, nw, eps = norm
        res, new_res = _norm_operands(x, residual, nw, cfg, "add_norm_qkv_rope_store")
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out, new_res
    _qkv_rope_store_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(n, cfg.block_n))](
        x, res, nw, new_res, weight, bias if bias is not None else x, out, cos, sin, kv_cache,
        slot_mapping,
        t, n, k, eps,
        x.stride(0), res.stride(0), new_res.stride(0), weight.stride(0), out.stride(0),
        cos.stride(0), sin.stride(0),
        *kv_cache.stride()[:4],
        kv_cache.shape[2], num_heads, kvh,
        HALF=d // 2, HAS_BIAS=bias is not None, NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm[0] is not None,
        FP32_IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_BLOCK=triton.next_power_of_2(k), EVEN_K=even_k(k, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(),
    )  # fmt: skip
    return out, new_res
