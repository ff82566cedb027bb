"""Paged attention and KV-cache writes as Triton kernels: one launch per layer for a mixed step.

A step's flat token list holds rows of any query length together: prefill chunks, 1-token
decode rows, (1+K)-token verify rows, padding rows (length 0) and padding tokens at the end.
Both kernels are CUDA-graph capturable: the launch grid is a function of tensor *shapes* only,
every length is read on the device, and nothing syncs with the host.

`paged_attention` ("unified" varlen design):
- grid `(T // BLOCK_Q + B + 1, KVH)`: an upper bound on the number of query blocks. Row r's
  query blocks are numbered from `cu[r] // BLOCK_Q + r` on; a program binary-searches
  `cu_seqlens_q` for its row and exits when its block lies past the row's end. The extra
  "row" B stands for the padding tokens `>= cu[B]`, whose output is written as zeros.
- GQA packing: a program takes BLOCK_Q query positions × the query heads of one KV head
  (the group padded to a power of two, GROUP_P), so the tile fed to `tl.dot` has
  M = BLOCK_Q * GROUP_P = 32 rows (16 ≤ M ≤ 64 for every group size up to 64), and each
  key/value tile is read once for the whole group.
- It walks key tiles of KEY_TILE positions from position 0 up to the last position its queries
  need, looking the block table up per key, with an online softmax in fp32 (exp2 domain).

Numerics are a function of the row alone (the base of the bitwise "exact" mode): the launch
configuration is fixed per model shape (never chosen by T, B or query length), key tiles
always start at position 0 in the same order, and there is no split-KV. A key a query may not
see gets score -inf, so its weight is exactly 0; in a tile where a query sees nothing the
running max is unchanged, so the rescale factor is exp2(0) = 1 exactly and the tile adds
exact zeros. Keys past the row's context are loaded as zeros (never the cache's stale or
uninitialized contents, which could be NaN and would survive a 0 weight). So a query's output
does not depend on how many extra tiles its program walks for its neighbours, i.e. on whether
it is decoded alone, verified with K drafts or computed inside a prefill chunk, nor on the
other rows of the batch.

Precision: scores and the softmax are fp32. Both products run in the query's dtype with fp32
accumulation; K/V are converted to the query's dtype after loading (as the SDPA reference
does). For fp32 queries the products use `input_precision="ieee"` (true fp32, no TF32), so fp32
stays close enough to SDPA for exact greedy equality; for bf16/fp16 the softmax weights are
rounded to that dtype before the PV product, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_TILE = 32  # key positions per inner-loop step; fixed, since it shapes the numerics
TILE_ROWS = 32  # M of the packed query tile: BLOCK_Q query positions × GROUP_P heads
NUM_WARPS = 4
NUM_STAGES = 2
_LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, KVH, D] new keys (after RoPE)
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] flat slot block * BS + offset; -1 = skip (padding)
) -> None:
    """Write each token's K/V into its cache slot (cast to the cache dtype); slot -1 skips."""
    t, kvh, d = k.shape
    _check_cache(kv_cache, kvh, d)
    assert v.shape == k.shape and slot_mapping.shape == (t,), (k.shape, v.shape, slot_mapping.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "last dim of k and v must be contiguous"
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *kv_cache.stride()[:4],
        kv_cache.shape[2],
        kvh,
        d,
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
    )


# Lengths vary step to step: not specialized, so one compiled kernel serves every batch shape
# (no recompiles while capturing graphs of other sizes, and one binary for all numerics).
@triton.jit(do_not_specialize=["num_tokens", "num_rows"])
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    cu_ptr,
    seq_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    num_tokens,
    num_rows,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    head_dim,
    group,
    BLOCK_Q: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Row of this query block: the largest r in [0, B] with cu[r] // BLOCK_Q + r <= pid (strictly
    # increasing in r, so padding rows of length 0 are fine). r == B: the padding-token tail.
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        ok = first_block <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    row = lo
    is_tail = row == num_rows
    row_start = tl.load(cu_ptr + row)
    row_end = tl.where(is_tail, num_tokens, tl.load(cu_ptr + tl.minimum(row + 1, num_rows)))
    qlen = row_end - row_start
    # The tail has no context: its queries see no key and get zeros.
    ctx = tl.where(is_tail, 0, tl.load(seq_ptr + tl.minimum(row, num_rows - 1)))
    q_start = (pid - (row_start // BLOCK_Q + row)) * BLOCK_Q
    if q_start >= qlen:
        return

    # Packed tile row m = query (q_start + m // GROUP_P) × head (kvh * group + m % GROUP_P).
    offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q_start + offs_m // GROUP_P
    hg = offs_m % GROUP_P
    head = kvh * group + hg
    row_ok = (qi < qlen) & (hg < group)
    tok = (row_start + qi).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q_pos = ctx - qlen + qi  # query i of the row sits at ctx - qlen + i, sees keys 0..q_pos

    num_keys = tl.maximum(ctx - qlen + tl.minimum(q_start + BLOCK_Q, qlen), 0)
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, TILE)
    table = bt_ptr + row.to(tl.int64) * stride_bt
    for j in range(0, tl.cdiv(num_keys, TILE)):
        k_pos = j * TILE + offs_t
        k_ok = k_pos < num_keys
        blk = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = blk * stride_cb + (k_pos % block_size) * stride_cs + kvh * stride_ch
        kv_mask = k_ok[None, :] & d_ok[:, None]  # [BLOCK_D, TILE]
        k = tl.load(cache_ptr + slot[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query that has seen no key yet keeps m = -inf; subtract 0 then, not -inf (NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            cache_ptr + stride_ckv + slot[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] queries (after RoPE); T may include padding tokens
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], already holding this step's K/V
    block_tables: torch.Tensor,  # [B, M] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32: row r's queries are q[cu[r]:cu[r+1]]
    seq_lens: torch.Tensor,  # [B] int32: row r's context length including its new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:  # [T, H, D], q's dtype unless `out` says otherwise
    """Causal attention of every row's queries over its paged context, in one launch.

    Query i of row r (qlen = cu[r+1] - cu[r], ctx = seq_lens[r]) sits at position
    ctx - qlen + i and attends keys 0..that position; query head h reads KV head
    h // (H // KVH). Padding rows (qlen 0) cost one early-exiting program each; padding tokens
    (>= cu[B]) get zeros. Graph-safe: the grid depends only on T, B and the model shape.
    """
    t, h, d = q.shape
    kvh = kv_cache.shape[3]
    _check_cache(kv_cache, kvh, d)
    b = block_tables.shape[0]
    assert b >= 1 and h % kvh == 0, (b, h, kvh)
    assert cu_seqlens_q.shape == (b + 1,) and seq_lens.shape == (b,)
    assert q.stride(-1) == 1 and block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    group = h // kvh
    group_p = triton.next_power_of_2(group)
    block_q = max(1, TILE_ROWS // group_p)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    grid = (t // block_q + b + 1, kvh)
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * _LOG2E,
        t,
        b,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        kv_cache.shape[2],
        d,
        group,
        BLOCK_Q=block_q,
        GROUP_P=group_p,
        BLOCK_D=triton.next_power_of_2(d),
        TILE=KEY_TILE,
        DOT_PRECISION=precision,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def _check_cache(kv_cache: torch.Tensor, kvh: int, d: int) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == kvh and kv_cache.shape[4] == d, (kv_cache.shape, kvh, d)
    assert kv_cache.stride(-1) == 1, "last dim of the KV cache must be contiguous"
