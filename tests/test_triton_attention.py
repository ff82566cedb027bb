"""The Triton paged-attention and KV-store kernels against a per-row fp64 reference, on mixed
batches (decode, verify, prefill chunks, padding rows and tokens), and the bitwise invariance
the exact mode rests on: a query's output depends on its row alone, however many key segments
its context spans and however the segments are laid out in the grid.

Runs on a GPU, or on the CPU under Triton's interpreter:
    TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton dir> python -m pytest tests/test_triton_attention.py
Skipped where Triton is missing (CI) or where there is neither a GPU nor TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_env import INTERPRET, kernel_device

DEVICE = torch.device(kernel_device())  # (skips this module where the kernels cannot run)

from specwire.common.model import triton_attention  # noqa: E402
from specwire.common.model.triton_attention import paged_attention, store_kv  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    """Triton's interpreter stores bf16 as raw uint16 and its `tl.dot` multiplies those bit
    patterns as integers. Widen bf16 operands to fp32 first (exact; the GPU accumulates in fp32
    too). Interpreter only: the GPU path is untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


if INTERPRET:
    _patch_interpreter_bf16_dot()
gpu_only = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a GPU")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Small shapes for the interpreter: SmolLM2-135M's heads (group 3, padded to 4) and group 2.
SMALL_SHAPES = [(9, 3, 64), (4, 2, 32)]
# (SEGMENT, KEY_TILE): the module's, and short segments of two tiles each, so that the
# interpreter's small contexts span several segments and walk the tile loop.
SPLITS = [None, (32, 16)]


@pytest.fixture(params=SPLITS, ids=lambda split: "default" if split is None else f"seg{split[0]}")
def split(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(triton_attention, "SEGMENT", request.param[0])
        monkeypatch.setattr(triton_attention, "KEY_TILE", request.param[1])
    return triton_attention.SEGMENT


@dataclass
class Row:
    seq: int | None  # which stored sequence the row reads; None: a padding row
    qlen: int
    ctx: int  # context length including the row's new tokens


class PagedSequences:
    """Sequences stored in one paged KV cache under shuffled block ids, with a query vector per
    position, so that any set of rows over them can be assembled into one kernel call."""

    def __init__(self, lengths, heads, kv_heads, head_dim, block_size, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.block_size, self.dtype = heads, block_size, dtype
        counts = [-(-n // block_size) for n in lengths]
        num_blocks = 1 + sum(counts) + 3  # block 0 is the dummy; a few blocks stay unused
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.width = max(counts)
        self.tables = []
        for count in counts:
            table, ids = ids[:count], ids[count:]
            self.tables.append(table + [0] * (self.width - count))
        # Every slot no sequence owns is NaN: the kernel must never let one reach an output.
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        self.cache = torch.full(shape, float("nan"), dtype=dtype)
        flat = self.cache.view(2, -1, kv_heads, head_dim)
        for n, table in zip(lengths, self.tables, strict=True):
            flat[:, _slots(table, n, block_size)] = torch.randn(
                2, n, kv_heads, head_dim, generator=gen
            ).to(dtype)
        self.cache = self.cache.to(DEVICE)
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lengths]

    def batch(self, rows: list[Row], pad_tokens: int = 0, extra_blocks: int = 0):
        """(q, block_tables, cu_seqlens_q, seq_lens) for `rows`, `pad_tokens` NaN queries last;
        `extra_blocks` unused columns widen the block table (and the grid's segment axis)."""
        head_dim = self.queries[0].shape[-1]
        qs = [self.queries[r.seq][r.ctx - r.qlen : r.ctx] for r in rows if r.seq is not None]
        qs.append(torch.full((pad_tokens, self.heads, head_dim), float("nan"), dtype=self.dtype))
        tables = [self.tables[r.seq] if r.seq is not None else [0] * self.width for r in rows]
        tables = [table + [0] * extra_blocks for table in tables]
        cu = [0]
        for r in rows:
            cu.append(cu[-1] + r.qlen)
        return (
            torch.cat(qs).to(DEVICE),
            torch.tensor(tables, dtype=torch.int32, device=DEVICE),
            torch.tensor(cu, dtype=torch.int32, device=DEVICE),
            torch.tensor([r.ctx for r in rows], dtype=torch.int32, device=DEVICE),
        )

    def run(
        self, rows: list[Row], pad_tokens: int = 0, extra_blocks: int = 0, seg_group=None
    ) -> torch.Tensor:
        q, tables, cu, seq_lens = self.batch(rows, pad_tokens, extra_blocks)
        return paged_attention(
            q, self.cache, tables, cu, seq_lens, _scale(q), seg_group=seg_group
        ).cpu()


def _slots(table: list[int], n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(table)[pos // block_size] * block_size + pos % block_size


def _scale(q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5


def reference(seqs: PagedSequences, rows: list[Row]) -> torch.Tensor:
    """Per row: gather the context from the cache, causal mask, softmax, all in fp64."""
    q, tables, cu, seq_lens = (x.cpu() for x in seqs.batch(rows))
    cache = seqs.cache.cpu().double()
    _, _, bs, kvh, d = cache.shape
    group = q.shape[1] // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, row in enumerate(rows):
        start, end = int(cu[r]), int(cu[r + 1])
        if start == end:
            continue
        slots = _slots(tables[r].tolist(), row.ctx, bs)
        k = cache[0].reshape(-1, kvh, d)[slots].repeat_interleave(group, 1)  # [ctx, H, D]
        v = cache[1].reshape(-1, kvh, d)[slots].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k) * _scale(q)
        q_pos = row.ctx - row.qlen + torch.arange(row.qlen)
        scores.masked_fill_(torch.arange(row.ctx)[None, None, :] > q_pos[None, :, None], -torch.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


# seq lengths: decode at 20, verify ending at 40, a 37-token chunk after 100 tokens, a fresh
# 17-token prefill, a 1-token sequence, and a verify row straddling the 32-key tile boundary.
MIXED_LENGTHS = [20, 40, 137, 17, 1, 35]
MIXED_ROWS = [
    Row(None, 0, 0),
    Row(0, 1, 20),
    Row(1, 5, 40),
    Row(2, 37, 137),
    Row(None, 0, 0),
    Row(3, 17, 17),
    Row(4, 1, 1),
    Row(5, 5, 35),
]


@pytest.mark.parametrize(
    "shape, block_size, dtype",
    [  # a spread rather than the full product: the interpreter is slow
        (SMALL_SHAPES[0], 16, torch.float32),
        (SMALL_SHAPES[0], 32, torch.bfloat16),
        (SMALL_SHAPES[1], 16, torch.float16),
        (SMALL_SHAPES[1], 8, torch.float32),
    ],
)
def test_mixed_batch_matches_reference(shape, block_size, dtype, split):
    seqs = PagedSequences(MIXED_LENGTHS, *shape, block_size, dtype)
    out = seqs.run(MIXED_ROWS, pad_tokens=3)
    real = sum(r.qlen for r in MIXED_ROWS)
    assert out.dtype == dtype and out.shape == (real + 3, shape[0], shape[2])
    torch.testing.assert_close(
        out[:real].double(),
        reference(seqs, MIXED_ROWS),
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
    )
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))  # padding tokens: zeros


def _check_row_invariance(seqs: PagedSequences, seq: int, ctx: int, others: list[Row]):
    """Positions ctx-5..ctx-1 of `seq`, computed as a verify row (alone, in a batch and under
    a wider block table, i.e. more grid segments), as 1-token rows, inside a prefill chunk and
    in a whole-sequence prefill: bitwise equal."""
    alone = seqs.run([Row(seq, 1, p + 1) for p in range(ctx - 5, ctx)])
    verify = seqs.run([Row(seq, 5, ctx)])
    wide = seqs.run([Row(seq, 5, ctx)], extra_blocks=9)
    in_batch = seqs.run(others[:2] + [Row(seq, 5, ctx)] + others[2:], pad_tokens=2)
    start = sum(r.qlen for r in others[:2])
    chunk = seqs.run([Row(seq, 19, ctx)])[-5:]
    prefill = seqs.run(others[:1] + [Row(seq, ctx, ctx)])[-5:]
    assert torch.equal(verify, alone)
    assert torch.equal(wide, alone)
    assert torch.equal(in_batch[start : start + 5], alone)
    assert torch.equal(chunk, alone)
    assert torch.equal(prefill, alone)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        (SMALL_SHAPES[0], torch.float32),
        (SMALL_SHAPES[0], torch.bfloat16),
        (SMALL_SHAPES[1], torch.bfloat16),
    ],
)
def test_output_depends_on_the_row_alone(shape, dtype, split):
    seqs = PagedSequences(MIXED_LENGTHS, *shape, 16, dtype, seed=1)
    others = [Row(0, 1, 20), Row(None, 0, 0), Row(2, 37, 137), Row(1, 5, 40)]
    # Sequence 5 (35 tokens): positions 30..34 straddle a key-tile edge (default split) or a
    # segment edge (32-key segments) and, there, span two segments.
    _check_row_invariance(seqs, 5, 35, others)
    # Sequence 2 (137 tokens): positions 123..127 end at the 128-key segment edge (default) or
    # sit in the 4th of 32-key segments.
    _check_row_invariance(seqs, 2, 128, others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_walked_per_program_change_no_bit(dtype, split):
    """A program may walk several segments (`seg_group`, chosen by the step's size): each
    segment's partial is still computed alone, so every output bit is the same for 1, 2, 3, 4
    or 8 segments a program, over rows that span one to five segments, a wider block table and
    padding."""
    seqs = PagedSequences(MIXED_LENGTHS, *SMALL_SHAPES[0], 16, dtype, seed=2)
    rows = [Row(0, 1, 20), Row(None, 0, 0), Row(2, 37, 137), Row(1, 5, 40), Row(5, 5, 35)]
    one = seqs.run(rows, pad_tokens=2, extra_blocks=3, seg_group=1)
    real = sum(r.qlen for r in rows)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(one[:real].double(), reference(seqs, rows), atol=tol, rtol=tol)
    for group in (2, 3, 4, 8):
        grouped = seqs.run(rows, pad_tokens=2, extra_blocks=3, seg_group=group)
        assert torch.equal(grouped, one), group


def test_segment_group_keeps_small_steps_spread_and_groups_large_ones():
    """One segment a program while the step has few (row, KV head) pairs or grouping would
    leave too few programs; more (up to the maximum) as the grid grows."""
    group = triton_attention.segment_group
    many, pairs = triton_attention.PROGRAMS_PER_GROUP, triton_attention.GROUP_ROW_HEADS
    assert group(16, 8, 8) == 1  # a lone Llama decode row: 2 query blocks x 8 KV heads
    assert group(10 * many, 8, 8 * 8) == 1  # a bucket of 8 rows (Llama: 64 pairs), however long
    assert group(10 * many, 8, 32 * 3) == 1  # SmolLM2's 3 KV heads x 32 rows
    assert group(many, 1, pairs) == 1  # one segment: nothing to group
    assert group(many, 8, pairs) == triton_attention.SEG_GROUP_MAX  # Llama: a 32-row bucket
    assert group(many // 4, 8, pairs) == 2


def test_positions_past_several_default_segments_depend_on_the_row_alone():
    """Contexts beyond 2 x SEGMENT at the module's own split: positions 254..258 straddle the
    edge of the 2nd and 3rd segments, merged from 2 and 3 segments."""
    assert 2 * triton_attention.SEGMENT == 256, "move the positions along with SEGMENT"
    seqs = PagedSequences([259, 40, 300], *SMALL_SHAPES[0], 16, torch.bfloat16, seed=4)
    others = [Row(1, 1, 40), Row(None, 0, 0), Row(2, 5, 300)]
    _check_row_invariance(seqs, 0, 259, others)
    out = seqs.run([Row(0, 5, 259), Row(2, 5, 300)])
    rows = [Row(0, 5, 259), Row(2, 5, 300)]
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), reference(seqs, rows), atol=tol, rtol=tol)


@pytest.mark.parametrize("seg_group", [1, 2, 3, 4])
def test_segments_merge_in_order_0_1_2(monkeypatch, seg_group):
    """The combine folds a query's segment partials first to last, however many segments a
    program walked (`seg_group`). Weights are all 1 here (zero query: equal scores), so the
    output is the fp32 sum of the per-segment value sums 2^24, 1, 1, 1 in merge order over 64
    keys: first to last gives 2^24 (each +1 rounds away), last to first 2^24 + 4, pairwise
    2^24 + 2."""
    monkeypatch.setattr(triton_attention, "SEGMENT", 16)
    monkeypatch.setattr(triton_attention, "KEY_TILE", 16)
    heads, kv_heads, dim, bs = 4, 2, 32, 16
    cache = torch.zeros(2, 5, bs, kv_heads, dim)
    cache[0].normal_(generator=torch.Generator().manual_seed(5))
    values = cache[1].view(-1, kv_heads, dim)[bs:]  # positions 0..63 in blocks 1..4
    values[0] = 2.0**24
    values[[16, 32, 48]] = 1.0
    q = torch.zeros(1, heads, dim)
    out = paged_attention(
        q.to(DEVICE),
        cache.to(DEVICE),
        torch.tensor([[1, 2, 3, 4]], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        torch.tensor([64], dtype=torch.int32, device=DEVICE),
        _scale(q),
        seg_group=seg_group,
    ).cpu()
    assert torch.equal(out, torch.full_like(out, 2.0**24 / 64))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_given_slots_and_skips_minus_one(cache_dtype):
    kvh, d, bs, nb = 3, 64, 16, 5
    cache = torch.full((2, nb, bs, kvh, d), 7.0, dtype=cache_dtype, device=DEVICE)
    slots = torch.tensor([17, -1, 5, 79, -1, 32, 16], device=DEVICE)
    # fp32 inputs whose values the cache dtype holds exactly: the cast is tested, not its rounding
    # (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even).
    k = torch.randn(len(slots), kvh, d, device=DEVICE).to(cache_dtype).float()
    v = torch.randn(len(slots), kvh, d, device=DEVICE).to(cache_dtype).float()
    store_kv(k, v, cache, slots)
    written = slots >= 0
    expected = torch.full_like(cache, 7.0).view(2, -1, kvh, d)
    expected[0, slots[written]] = k[written].to(cache_dtype)
    expected[1, slots[written]] = v[written].to(cache_dtype)
    assert torch.equal(cache.view(2, -1, kvh, d), expected)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama3_8b_heads_mixed_batch_and_invariance(dtype, block_size):
    seqs = PagedSequences([1024, 300, 777, 64, 1029], 32, 8, 128, block_size, dtype, seed=2)
    rows = [Row(0, 1, 1024), Row(1, 5, 300), Row(None, 0, 0), Row(2, 200, 777), Row(3, 64, 64)]
    out = seqs.run(rows, pad_tokens=5)
    real = sum(r.qlen for r in rows)
    torch.testing.assert_close(
        out[:real].double(), reference(seqs, rows), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    _check_row_invariance(seqs, 4, 1029, rows)


@pytest.mark.gpu
@gpu_only
def test_cuda_graph_replay_follows_new_metadata():
    """Captured once, replayed over other rows of the same shapes: equals eager each time."""
    seqs = PagedSequences([300, 45, 129, 1], 9, 3, 64, 16, torch.bfloat16, seed=3)
    first = [Row(0, 5, 300), Row(1, 5, 45), Row(None, 0, 0), Row(2, 5, 129)]
    second = [Row(2, 1, 100), Row(None, 0, 0), Row(0, 13, 13), Row(3, 1, 1)]
    static = [x.clone() for x in seqs.batch(first, pad_tokens=5)]  # both steps: 15 + 5 tokens
    out = torch.empty_like(static[0])
    scale = _scale(static[0])
    paged_attention(static[0], seqs.cache, *static[1:], scale, out=out)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(static[0], seqs.cache, *static[1:], scale, out=out)
    for rows in (first, second):
        fresh = seqs.batch(rows, pad_tokens=5)
        for buf, new in zip(static, fresh, strict=True):
            buf.copy_(new)
        graph.replay()
        eager = paged_attention(static[0], seqs.cache, *static[1:], scale)
        assert torch.equal(out, eager)
