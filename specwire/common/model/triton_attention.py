"""Paged attention and KV-cache writes as Triton kernels: one step's layer in three launches.

A step's flat token list holds rows of any query length together: prefill chunks, 1-token
decode rows, (1+K)-token verify rows, padding rows (length 0) and padding tokens at the end.
All kernels are CUDA-graph capturable: launch grids and the workspace are functions of tensor
*shapes* only, every length is read on the device, and nothing syncs with the host.

`paged_attention` (varlen, split-KV at fixed absolute key positions):
- The keys of every row are cut into segments of SEGMENT positions, [0, SEGMENT),
  [SEGMENT, 2 SEGMENT), ... One program takes (query block, segment, KV head); the segment axis
  of the grid is `ceil(table width * block size / SEGMENT)`, an upper bound from the block
  table's static width, and a program whose segment starts past its queries' last key exits.
  So a 1-token decode at 1024 keys runs 8 segments × KVH programs side by side instead of
  walking 1024 keys in KVH programs. A large step (`GROUP_ROW_HEADS` row × KV-head pairs) has
  fewer programs on the segment axis, P, each walking segments s, s + P, s + 2P, ...
  (`segment_group`) as one software-pipelined loop, the next segment's K/V loads in flight
  during this one's math; it still writes one partial per segment, computed exactly as alone.
- Query blocks: grid axis 0 is `T // BLOCK_Q + B + 1`, an upper bound on their number. Row r's
  blocks are numbered from `cu[r] // BLOCK_Q + r` on; a program finds its row by a FANOUT-ary
  search of `cu_seqlens_q` (one dependent load for up to 127 rows) and exits when its block
  lies past the row's end. The extra "row" B stands for the padding tokens `>= cu[B]`.
- GQA packing: a program takes BLOCK_Q query positions × the query heads of one KV head (the
  group padded to a power of two, GROUP_P), so the tile fed to `tl.dot` has
  M = BLOCK_Q * GROUP_P = 32 rows, and each key/value tile is read once for the whole group.
- Within its segment a program walks key tiles of KEY_TILE positions (the next tile's block
  ids are loaded before the current tile's math), with an online softmax in fp32 (exp2 domain),
  and writes its unnormalised partial (acc, running max m, sum l) to an fp32 workspace.
- `_combine_kernel` then merges, per query and head, segments 0, 1, 2, ... in that order up to
  the query's own last segment, and normalises. Segment-0 programs record that count per token.

Numerics are a function of the row alone (the base of the bitwise "exact" mode). A query at
position p gets segments 0..p // SEGMENT, each computed over the same absolute key range with
the same tiles, and merged in the same order, whatever the query length, batch or token count:
the launch configuration is fixed per model shape (never chosen by T, B, query length or
context length), and there is no path without the split. Inside a segment, a key a query may
not see gets score -inf, so its weight is exactly 0; in a tile where a query sees nothing the
running max is unchanged, so the rescale factor is exp2(0) = 1 exactly and the tile adds exact
zeros. Keys past the row's context are loaded as zeros (never the cache's stale or
uninitialized contents, which could be NaN and would survive a 0 weight). So a query's output
depends neither on how many extra tiles its program walks for its neighbours, nor on how many
segments other queries need: it is the same decoded alone, verified with K drafts or computed
inside a prefill chunk, next to any other rows.

Precision: scores, the softmax, the partials and their merge are fp32. Both products run in
the query's dtype with fp32 accumulation; K/V are converted to the query's dtype after loading
(as the SDPA reference does). For fp32 queries the products use `input_precision="ieee"` (true
fp32, no TF32), so fp32 stays close enough to SDPA for exact greedy equality; for bf16/fp16 the
softmax weights are rounded to that dtype before the PV product, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import (
    _INTERPRET,
    _exp2,
    _grid_sync,
    _index,
    early_loads,
    launch_opts,
)

# One fixed launch configuration: these shape the numerics (tile and segment edges, merge
# order), so they are constants, never tuned per batch shape.
# SEGMENT: keys per split. Small enough that a lone decode row spreads over many SMs (1024 keys
# of SmolLM2's 3 KV heads: 8 x 3 = 24 programs), large enough that the fp32 partials (D + 2
# floats per query, head and segment, written and read back once) stay a small fraction of the
# K/V bytes at large batch (~1/8 of them for a 5-token verify row at GQA group 4, D = 128).
SEGMENT = 128
# KEY_TILE: keys per inner-loop step. One tile per segment: a program's critical path is then
# one block-table load and one K/V load (issued together), with no second round trip for a
# second tile. Compiled for sm_90 (bf16, 4 warps), a 128-key tile needs 117 registers and 45 KB
# of shared memory at D = 64, 187 and 82 KB at D = 128: no spills, 2-4 programs per SM. Larger
# SEGMENTs walk several tiles, the next tile's block ids loaded ahead. Must divide SEGMENT.
# Halved while one K tile exceeds TILE_BYTES (D > 128), so that the pipelined K/V buffers fit
# in shared memory.
KEY_TILE = 128
TILE_BYTES = 32 * 1024
NUM_WARPS = 4
# Segments per program (`segment_group`): grouped only in a grid of at least GROUP_ROW_HEADS
# (row, KV head) pairs (rows as the launch sees them: a graph bucket's, an upper bound on the
# real ones), and only while the grid keeps PROGRAMS_PER_GROUP programs (~3 per SM), at most
# SEG_GROUP_MAX segments each (the segment axis then has P = ceil(segments / group) programs,
# each walking every P-th segment). A grouping never changes the numerics, only the schedule.
# H200, verify_step graph replays side by side (round 18): Llama-3-8B B=32 q=5 8.30 -> 8.05
# ms, B=32 q=1 6.83 -> 6.70, B=8 q=5 5.51 -> 5.45; SmolLM2 (never grouped) unchanged. Up to
# 8 segments a program (round 19, attention_kernel.py, attention + combine a layer): B=32
# q=5 66.1 -> 63.8 us, B=64 q=5 126.0 -> 122.7; steps that group fewer are unchanged. Without
# the floor, lone rows and SmolLM2's 8-row steps got slower (round 17: a bucket of 8 Llama rows,
# 64 pairs; SmolLM2 B=8 q=5 in a 32-row bucket, 96 pairs). The grouped loop is a compile-time
# path of its own (GROUPED): the one-segment loop with its stores after it is what SmolLM2's
# steps need (with the grouped loop at P = segments they were up to 14 % slower). A third
# pipeline stage was slower everywhere, flattening the grid with the KV head fastest level.
SEG_GROUP_MAX = 8
PROGRAMS_PER_GROUP = 400
GROUP_ROW_HEADS = 256
# fp32 queries take the exact `ieee` products, which Triton builds from FMAs, not tensor cores,
# and which spill at 4 warps beyond 32-key tiles: 64-key tiles on 8 warps compile without
# spills for every D <= 128 (80-128 registers). The launch configuration is thus a function of
# the model's shape and dtype, never of a step's shapes.
FP32_KEY_TILE = 64
FP32_NUM_WARPS = 8
TILE_ROWS = 32  # M of the packed query tile: BLOCK_Q query positions × GROUP_P heads
NUM_STAGES = 2
# cu_seqlens_q entries probed per dependent load when a program looks up its row: one load for
# up to 127 rows, two up to 16383.
SEARCH_FANOUT = 128
COMBINE_WARPS = 2
# Pinned, not left to the Triton default (which flips to False in Triton 3.10): FMA contraction
# changes the low bits, and the exact mode needs the same bits from every install.
FP_FUSION = True
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
    _grid_sync()
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
        **launch_opts(),
    )


# Lengths vary step to step: not specialized, so one compiled kernel serves every batch shape
# (no recompiles while capturing graphs of other sizes, and one binary for all numerics).
@triton.jit(do_not_specialize=["num_tokens", "num_rows", "table_width"])
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    cu_ptr,
    seq_ptr,
    part_acc_ptr,  # [S, T, H, D] fp32 workspace: unnormalised partial outputs
    part_m_ptr,  # [S, T, H] fp32: running max (exp2 domain)
    part_l_ptr,  # [S, T, H] fp32: sum of weights
    nseg_ptr,  # [T] int32: segments each token's query merges (0: padding token)
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    num_tokens,
    num_rows,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    table_width,
    block_size,
    head_dim,
    group,
    BLOCK_Q: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    FANOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY: tl.constexpr,
    GROUPED: tl.constexpr,
):
    # PDL: with EARLY, everything up to the early exits reads only the step's metadata
    # (query offsets, lengths, block table), which no kernel writes: done while the qkv GEMM
    # before this kernel still runs. The wait comes before the first write and the q/KV loads.
    if not EARLY:
        _grid_sync()
    pid = tl.program_id(0)
    seg = tl.program_id(1)  # this program's first segment; its others: seg + P, seg + 2P, ...
    seg_step = tl.num_programs(1)  # P (`segment_group`)
    kvh = tl.program_id(2)

    # Row of this query block: the largest r in [0, B] with cu[r] // BLOCK_Q + r <= pid (strictly
    # increasing in r, so padding rows of length 0 are fine). r == B: the padding-token tail.
    # FANOUT-ary search: each round probes FANOUT evenly spaced rows of [lo, hi] in one load.
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_rows
    probes = tl.arange(0, FANOUT)
    while lo < hi:
        step = (hi - lo + FANOUT) // FANOUT  # ceil((hi - lo + 1) / FANOUT)
        r = lo + probes * step
        r_ok = r <= hi
        first_block = tl.load(cu_ptr + r, mask=r_ok, other=0) // BLOCK_Q + r
        below = tl.sum((r_ok & (first_block <= pid)).to(tl.int32), 0)  # >= 1: probe lo is
        lo = lo + (below - 1) * step
        hi = tl.minimum(lo + step - 1, hi)
    row = lo
    # The row's lengths and the segment's first block ids, all loaded at once, before any
    # branch on them: the block ids depend on the row alone (masked by the table's width, not
    # yet by the context; the K/V loads are), so the K/V loads wait a single round trip.
    # `volatile` keeps the compiler from sinking them past the early exits (it does, otherwise:
    # sm_90 SASS showed them a round trip later).
    last = tl.minimum(row, num_rows - 1)  # row B (the tail) has no table row nor length
    ctx = tl.load(seq_ptr + last, volatile=True)
    offs_t = tl.arange(0, TILE)
    table = bt_ptr + last.to(tl.int64) * stride_bt
    seg_start = seg * SEGMENT
    k_pos = seg_start + offs_t
    blk = tl.load(
        table + k_pos // block_size, mask=k_pos < table_width * block_size, other=0, volatile=True
    )
    is_tail = row == num_rows
    row_start = tl.load(cu_ptr + row)
    row_end = tl.where(is_tail, num_tokens, tl.load(cu_ptr + tl.minimum(row + 1, num_rows)))
    qlen = row_end - row_start
    q_start = (pid - (row_start // BLOCK_Q + row)) * BLOCK_Q
    if q_start >= qlen:
        return
    # (for the tail, a length of the last row: it only decides which tail programs with seg > 0,
    # which write nothing, exit here)
    num_keys = tl.maximum(ctx - qlen + tl.minimum(q_start + BLOCK_Q, qlen), 0)
    if (seg > 0) & (seg_start >= num_keys):
        return
    if EARLY:
        _grid_sync()
    if is_tail:  # padding tokens: no partials, 0 segments to merge, so the combine writes zeros
        if (seg == 0) & (kvh == 0):
            qv = q_start + tl.arange(0, BLOCK_Q)
            tl.store(nseg_ptr + row_start + qv, tl.zeros([BLOCK_Q], tl.int32), mask=qv < qlen)
        return
    if (seg == 0) & (kvh == 0):
        # Query i of the row sits at ctx - qlen + i and merges segments 0..its_position // SEGMENT.
        qv = q_start + tl.arange(0, BLOCK_Q)
        pos = ctx - qlen + qv
        count = tl.where(pos >= 0, pos // SEGMENT + 1, 0)
        tl.store(nseg_ptr + row_start + qv, count, mask=qv < qlen)

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
    q_pos = ctx - qlen + qi  # sees keys 0..q_pos

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    if not GROUPED:  # one segment a program (P = segments)
        seg_stop = tl.minimum(seg_start + SEGMENT, num_keys)
        for tile_start in range(_index(seg_start), _index(seg_stop), TILE):
            k_pos = tile_start + offs_t
            m_i, l_i, acc, blk = _attend_tile(
                q, q_pos, row_ok, d_ok, offs_t, offs_d, blk, k_pos, k_pos < seg_stop,
                k_pos + TILE, seg_stop, cache_ptr, table, block_size, kvh,
                stride_cb, stride_cs, stride_ch, stride_ckv, qk_scale, m_i, l_i, acc,
                DOT_PRECISION,
            )  # fmt: skip
        part = (seg.to(tl.int64) * num_tokens + tok) * num_heads + head  # [M] workspace row
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        return
    # GROUPED: the program walks the key tiles of segments seg, seg + P, seg + 2P, ... (those
    # that start before its queries' last key) as one loop, so that the loads of a segment's
    # K/V are issued while the one before it is computed. Each segment's partial starts from
    # the same (-inf, 0, 0) state (selected back at the segment's first tile) and is stored
    # after its last tile: exactly what a program of one segment computes, so P never changes
    # a bit. Strided, not consecutive: a table wider than the contexts leaves no program
    # without a segment while another walks several.
    tiles_per_seg = SEGMENT // TILE
    mine = (tl.cdiv(num_keys, SEGMENT) - seg + seg_step - 1) // seg_step  # my segments
    tile_start = seg_start
    for i in range(0, _index(mine * tiles_per_seg)):
        tile_seg = tile_start // SEGMENT
        seg_stop = tl.minimum((tile_seg + 1) * SEGMENT, num_keys)
        first = tile_start % SEGMENT == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        # the next tile of this segment, or the first of the segment P on
        next_start = tl.where(
            (i + 1) % tiles_per_seg == 0, (tile_seg + seg_step) * SEGMENT, tile_start + TILE
        )
        k_pos = tile_start + offs_t
        m_i, l_i, acc, blk = _attend_tile(
            q, q_pos, row_ok, d_ok, offs_t, offs_d, blk, k_pos, k_pos < seg_stop,
            next_start + offs_t, num_keys, cache_ptr, table, block_size, kvh,
            stride_cb, stride_cs, stride_ch, stride_ckv, qk_scale, m_i, l_i, acc, DOT_PRECISION,
        )  # fmt: skip
        # The segment's last tile: its partial, as masked stores (no branch in the loop). A
        # segment's tiles past its last key (only with several tiles a segment) change nothing
        # and store the same partial again.
        done = row_ok & (tile_start + TILE >= seg_stop)
        part = (tile_seg.to(tl.int64) * num_tokens + tok) * num_heads + head  # [M] workspace row
        tl.store(
            part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
            acc,
            mask=done[:, None] & d_ok[None, :],
        )
        tl.store(part_m_ptr + part, m_i, mask=done)
        tl.store(part_l_ptr + part, l_i, mask=done)
        tile_start = next_start
    if seg_start >= num_keys:  # segment 0 of queries that see no key: the empty partial
        part = tok * num_heads + head
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)


@triton.jit
def _attend_tile(
    q, q_pos, row_ok, d_ok, offs_t, offs_d, blk, k_pos, k_ok, next_pos, next_stop,
    cache_ptr, table, block_size, kvh, stride_cb, stride_cs, stride_ch, stride_ckv, qk_scale,
    m_i, l_i, acc, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile (positions k_pos, valid where k_ok, in blocks `blk`) folded into the online
    softmax state (m_i, l_i, acc); also loads the block ids of the next tile (positions
    next_pos, below next_stop) so that their load overlaps this tile's math."""
    slot = blk.to(tl.int64) * stride_cb + (k_pos % block_size) * stride_cs + kvh * stride_ch
    k = tl.load(
        cache_ptr + slot[None, :] + offs_d[:, None],
        mask=k_ok[None, :] & d_ok[:, None],
        other=0.0,
    )  # [BLOCK_D, TILE]
    v = tl.load(
        cache_ptr + stride_ckv + slot[:, None] + offs_d[None, :],
        mask=k_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [TILE, BLOCK_D]
    blk = tl.load(table + next_pos // block_size, mask=next_pos < next_stop, other=0)
    s = _mma(q, k.to(q.dtype), DOT_PRECISION) * qk_scale
    visible = row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A query that has seen no key yet keeps m = -inf; subtract 0 then, not -inf (NaN).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = _exp2(s - m_ref[:, None])
    alpha = _exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION)
    return m_new, l_i, acc, blk


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr):
    """`tl.dot(a, b)` in fp32. Triton's interpreter runs it as numpy's fp32 matmul, whose
    summation order follows the tile's shape and which multiplies bf16's raw bits: there it
    is an fp64 product rounded once to fp32, so a row's result does not depend on its tile."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _partial(acc_rows, max_rows, sum_rows, seg, total, stride, head_dim, h_ok, d_ok):
    """Segment `seg`'s partial (acc, max, sum) at the heads' workspace rows (pointers into
    segment 0, `stride` rows per segment); (0, -inf, 0) past the workspace's `total` segments.
    May be unwritten memory: see `_merge`."""
    ok = tl.where(seg < total, h_ok, False)
    acc = tl.load(acc_rows + seg * stride * head_dim, mask=ok[:, None] & d_ok[None, :], other=0.0)
    mx = tl.load(max_rows + seg * stride, mask=ok, other=float("-inf"))
    den = tl.load(sum_rows + seg * stride, mask=ok, other=0.0)
    return acc, mx, den


@triton.jit
def _merge(acc, mx, den, acc_s, mx_s, den_s, live):
    """Fold one segment's partial into the running (acc, max, sum); `live` false: fold the
    identity (0, -inf, 0) instead (selected, so unwritten memory never reaches arithmetic),
    which leaves them bitwise unchanged: factors 1 and 0, products of exact zeros."""
    acc_s = tl.where(live, acc_s, 0.0)
    mx_s = tl.where(live, mx_s, float("-inf"))
    den_s = tl.where(live, den_s, 0.0)
    mx_new = tl.maximum(mx, mx_s)
    ref = tl.where(mx_new == float("-inf"), 0.0, mx_new)
    alpha = _exp2(mx - ref)
    beta = _exp2(mx_s - ref)
    return acc * alpha[:, None] + acc_s * beta[:, None], mx_new, den * alpha + den_s * beta


@triton.jit
def _merge_chunk(
    acc, mx, den, a_rows, m_rows, l_rows, s, nseg, total, stride, head_dim, h_ok, d_ok
):
    """Merge segments s..s+7, in order: their loads are issued together (one memory latency
    per eight segments), masked by the workspace's extent only; segments at or past the
    query's `nseg` are then replaced by the merge's identity."""
    a0, m0, l0 = _partial(a_rows, m_rows, l_rows, s, total, stride, head_dim, h_ok, d_ok)
    a1, m1, l1 = _partial(a_rows, m_rows, l_rows, s + 1, total, stride, head_dim, h_ok, d_ok)
    a2, m2, l2 = _partial(a_rows, m_rows, l_rows, s + 2, total, stride, head_dim, h_ok, d_ok)
    a3, m3, l3 = _partial(a_rows, m_rows, l_rows, s + 3, total, stride, head_dim, h_ok, d_ok)
    a4, m4, l4 = _partial(a_rows, m_rows, l_rows, s + 4, total, stride, head_dim, h_ok, d_ok)
    a5, m5, l5 = _partial(a_rows, m_rows, l_rows, s + 5, total, stride, head_dim, h_ok, d_ok)
    a6, m6, l6 = _partial(a_rows, m_rows, l_rows, s + 6, total, stride, head_dim, h_ok, d_ok)
    a7, m7, l7 = _partial(a_rows, m_rows, l_rows, s + 7, total, stride, head_dim, h_ok, d_ok)
    acc, mx, den = _merge(acc, mx, den, a0, m0, l0, s < nseg)
    acc, mx, den = _merge(acc, mx, den, a1, m1, l1, s + 1 < nseg)
    acc, mx, den = _merge(acc, mx, den, a2, m2, l2, s + 2 < nseg)
    acc, mx, den = _merge(acc, mx, den, a3, m3, l3, s + 3 < nseg)
    acc, mx, den = _merge(acc, mx, den, a4, m4, l4, s + 4 < nseg)
    acc, mx, den = _merge(acc, mx, den, a5, m5, l5, s + 5 < nseg)
    acc, mx, den = _merge(acc, mx, den, a6, m6, l6, s + 6 < nseg)
    acc, mx, den = _merge(acc, mx, den, a7, m7, l7, s + 7 < nseg)
    return acc, mx, den


@triton.jit(do_not_specialize=["stride", "total"])
def _combine_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    nseg_ptr,
    out_ptr,
    stride,  # T * H: workspace rows per segment
    total,  # S: segments in the workspace
    num_heads,
    stride_ot,
    stride_oh,
    head_dim,
    group,
    GROUP_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per (token, KV head): merge segments 0, 1, 2, ... up to the query's last, in that order,
    and normalise. Segments 0..7 are loaded beside the token's segment count."""
    _grid_sync()
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    hg = tl.arange(0, GROUP_P)
    head = kvh * group + hg
    h_ok = hg < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    part = t.to(tl.int64) * num_heads + head  # the heads' workspace rows in segment 0
    a_rows = part_acc_ptr + part[:, None] * head_dim + offs_d[None, :]
    m_rows = part_m_ptr + part
    l_rows = part_l_ptr + part
    nseg = tl.load(nseg_ptr + t)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    mx = tl.full([GROUP_P], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_P], tl.float32)
    s = tl.zeros([], tl.int64)  # 64-bit workspace offsets
    acc, mx, den = _merge_chunk(
        acc, mx, den, a_rows, m_rows, l_rows, s, nseg, total, stride, head_dim, h_ok, d_ok
    )
    for start in range(8, _index(nseg), 8):
        c = s + start
        acc, mx, den = _merge_chunk(
            acc, mx, den, a_rows, m_rows, l_rows, c, nseg, total, stride, head_dim, h_ok, d_ok
        )
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] queries (after RoPE); T may include padding tokens
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], already holding this step's K/V
    block_tables: torch.Tensor,  # [B, M] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32: row r's queries are q[cu[r]:cu[r+1]]
    seq_lens: torch.Tensor,  # [B] int32: row r's context length including its new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    seg_group: int | None = None,  # segments per program; None: `segment_group`'s choice
) -> torch.Tensor:  # [T, H, D], q's dtype unless `out` says otherwise
    """Causal attention of every row's queries over its paged context, in two launches.

    Query i of row r (qlen = cu[r+1] - cu[r], ctx = seq_lens[r]) sits at position
    ctx - qlen + i and attends keys 0..that position; query head h reads KV head
    h // (H // KVH). Padding rows (qlen 0) cost early-exiting programs; padding tokens
    (>= cu[B]) get zeros. Graph-safe: the grids and the fp32 workspace
    (T * H * ceil(M * BS / SEGMENT) * (D + 2) floats) depend only on shapes.
    """
    t, h, d = q.shape
    kvh = kv_cache.shape[3]
    _check_cache(kv_cache, kvh, d)
    b, width = block_tables.shape
    assert b >= 1 and h % kvh == 0, (b, h, kvh)
    assert cu_seqlens_q.shape == (b + 1,) and seq_lens.shape == (b,)
    assert q.stride(-1) == 1 and block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if t == 0:
        return out
    block_size = kv_cache.shape[2]
    group = h // kvh
    group_p = triton.next_power_of_2(group)
    block_q = max(1, TILE_ROWS // group_p)
    block_d = triton.next_power_of_2(d)
    tile, warps = _key_tile_and_warps(q.dtype, block_d)
    assert SEGMENT % tile == 0, (SEGMENT, tile)
    segments = triton.cdiv(width * block_size, SEGMENT)
    assert segments <= 65535 and kvh <= 65535, (segments, kvh)  # grid axes 1 and 2
    rows = segments * t * h
    workspace = torch.empty(rows * (d + 2), dtype=torch.float32, device=q.device)
    part_acc, part_m, part_l = workspace.split([rows * d, rows, rows])
    nseg = torch.empty(t, dtype=torch.int32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    q_blocks = t // block_q + b + 1
    if seg_group is None:
        seg_group = segment_group(q_blocks * kvh, segments, b * kvh)
    _paged_attention_kernel[(q_blocks, triton.cdiv(segments, seg_group), kvh)](  # P: axis 1
        q,
        kv_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        part_acc,
        part_m,
        part_l,
        nseg,
        scale * _LOG2E,
        t,
        b,
        h,
        q.stride(0),
        q.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        width,
        block_size,
        d,
        group,
        BLOCK_Q=block_q,
        GROUP_P=group_p,
        BLOCK_D=block_d,
        TILE=tile,
        SEGMENT=SEGMENT,
        FANOUT=SEARCH_FANOUT,
        DOT_PRECISION=precision,
        EARLY=early_loads(),
        GROUPED=seg_group > 1,
        num_warps=warps,
        num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
        **launch_opts(),
    )
    _combine_kernel[(t, kvh)](
        part_acc,
        part_m,
        part_l,
        nseg,
        out,
        t * h,
        segments,
        h,
        out.stride(0),
        out.stride(1),
        d,
        group,
        GROUP_P=group_p,
        BLOCK_D=block_d,
        num_warps=COMBINE_WARPS,
        enable_fp_fusion=FP_FUSION,
        **launch_opts(),
    )
    return out


def segment_group(blocks: int, segments: int, row_heads: int) -> int:
    """Segments per attention program, for a grid of `blocks` (query block, KV head) pairs ×
    `segments` over `row_heads` (row, KV head) pairs: 1 below GROUP_ROW_HEADS pairs, else the
    most, up to SEG_GROUP_MAX, that still leave PROGRAMS_PER_GROUP programs. A program walks
    its segments as one pipelined loop, so a large step keeps several K/V tiles in flight per
    program; a small one keeps every segment its own program, spread over the SMs. Numerics do
    not depend on it (each segment's partial is computed alone)."""
    group = 1
    while (
        row_heads >= GROUP_ROW_HEADS
        and group < min(SEG_GROUP_MAX, segments)
        and blocks * triton.cdiv(segments, 2 * group) >= PROGRAMS_PER_GROUP
    ):
        group *= 2
    return group


def _key_tile_and_warps(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """The attention kernel's key tile and warp count for this query dtype and head size."""
    if dtype == torch.float32:
        return min(KEY_TILE, FP32_KEY_TILE), FP32_NUM_WARPS
    tile = KEY_TILE
    while tile > 16 and tile * block_d * 2 > TILE_BYTES:
        tile //= 2
    return tile, NUM_WARPS


def _check_cache(kv_cache: torch.Tensor, kvh: int, d: int) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == kvh and kv_cache.shape[4] == d, (kv_cache.shape, kvh, d)
    assert kv_cache.stride(-1) == 1, "last dim of the KV cache must be contiguous"
