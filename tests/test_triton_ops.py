"""Triton layer ops against the eager formulas they replace, and the batch invariance of exact
mode: a row's output bits must not depend on how many rows share its batch or where it sits.

Runs on a GPU, or on the CPU under Triton's interpreter (small shapes):
  TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/test_triton_ops.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import kernel_device

DEVICE = kernel_device()  # (skips this module where the kernels cannot run)

from specwire.common.model import triton_ops as ops  # noqa: E402 (triton is known to be there)
from specwire.common.model import triton_tiles as tiles  # noqa: E402
from specwire.common.model.llama import Rotary  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
BATCH_SIZES = [1, 3, 5, 16, 17, 64, 100]
EPS = 1e-5


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # on the GPU: the LM head is 0.5 G
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def _eager_rms_norm(x, w):
    return w * F.rms_norm(x.float(), x.shape[-1:], eps=EPS).to(x.dtype)


def _assert_within_ulp(out, ref):
    """The fp32 statistics differ from PyTorch's in the last bits (its reduction order and
    rsqrt are its own): a few fp32 ulps, which a bf16 result almost never shows."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)
    else:
        torch.testing.assert_close(
            out.float(), ref.float(), rtol=torch.finfo(out.dtype).eps, atol=0
        )
        assert (out == ref).float().mean().item() > 0.99


def _assert_rows_invariant(fn, rows: torch.Tensor, filler: torch.Tensor):
    """fn on every sub-batch of `rows`, padded at shifting offsets with `filler` rows, must give
    each row exactly the bits it gets in the full batch of `rows`."""
    ref = fn(rows)
    g = torch.Generator().manual_seed(1)
    for m in BATCH_SIZES:
        pick = torch.randperm(rows.shape[0], generator=g)[:m].to(rows.device)
        before = (7 * m) % 13  # crosses BLOCK_M = 16 tile boundaries differently for each m
        batch = torch.cat([filler[:before], rows[pick], filler[before : before + m % 5]])
        out = fn(batch)[before : before + m]
        for i in range(m):
            assert torch.equal(out[i], ref[pick[i]]), f"batch of {m}: row {i} changed"


# --- norms, silu_mul, rope: the eager formulas ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 200])  # a power of two's multiple, and a masked row
def test_rms_norm_matches_eager(dtype, n):
    x, w = _randn(7, n, dtype=dtype), _randn(n, dtype=dtype, seed=1)
    _assert_within_ulp(ops.rms_norm(x, w, EPS), _eager_rms_norm(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_eager(dtype):
    x, res = _randn(7, 200, dtype=dtype), _randn(7, 200, dtype=dtype, seed=2)
    w = _randn(200, dtype=dtype, seed=1)
    normed, new_res = ops.add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, x + res)
    _assert_within_ulp(normed, _eager_rms_norm(x + res, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager(dtype):
    gate_up = _randn(5, 2 * 1100, dtype=dtype, scale=3.0)  # I = 1100: two blocks, one masked
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(out, F.silu(gate) * up)
    else:  # fp32 keeps exp's last-bit differences (the interpreter's exp is numpy's)
        torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_rope_matches_rotary_apply(dtype, inplace):
    t, heads, kv_heads, d = 6, 5, 2, 16
    qkv = _randn(t, (heads + 2 * kv_heads) * d, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # strided, like the model
    angles = _randn(t, d // 2, dtype=torch.float32, seed=3) * 10
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref = Rotary.apply(qk.clone(), cos[:, None], sin[:, None])
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    out = ops.rope(qk, cos, sin, inplace=inplace)
    # On the H200 the kernel's x*cos + r*sin is contracted to an FMA, which PyTorch's two eager
    # kernels round twice: the last bit may differ (measured: 4 of 4 cases). The model uses
    # one implementation per run, so this does not touch losslessness.
    _assert_within_ulp(out, ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched
    if inplace:
        assert torch.equal(qk, out)


# --- linear: accuracy ----------------------------------------------------------------------------


def _linear_ref(x, w, b=None):
    out = x.float() @ w.float().T
    return out + b.float() if b is not None else out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 72, 200), (5, 96, 128), (33, 40, 576), (3, 40, 2112)],  # the last takes the K-split path
)
def test_linear_matches_matmul(dtype, m, n, k):
    x = _randn(m, k, dtype=dtype, seed=4)
    w = _randn(n, k, dtype=dtype, seed=5, scale=k**-0.5)
    b = _randn(n, dtype=dtype, seed=6)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    ref = _linear_ref(x, w)
    torch.testing.assert_close(ops.linear(x, w).float(), ref, **tol)
    torch.testing.assert_close(ops.linear(x, w, b).float(), _linear_ref(x, w, b), **tol)
    for block_m in (32, 64):  # the larger row tiles (see `linear`) compute the same thing
        torch.testing.assert_close(ops.linear(x, w, block_m=block_m).float(), ref, **tol)
    # ...and so do the exact mode's wide tiles and a free wide config (`linear_wide`)
    for cfg in (tiles.exact_wide_config(n, k, 100), tiles.wide_tiles(k, 64, 64, 64, 2, 4, 3)):
        got = ops.linear_wide(x, w, b, None, cfg).float()
        torch.testing.assert_close(got, _linear_ref(x, w, b), **tol)
    # fp32 output (logits): the accumulator itself, no rounding to the input dtype
    out32 = ops.linear(x, w, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-5)


def test_k_split_shape_is_split():
    # Guards test_linear_matches_matmul's last shape (and the Llama-3-8B o_proj/down shapes).
    assert tiles.linear_config(40, 2112).split_k > 1
    assert tiles.linear_config(4096, 14336).split_k > 1


def test_tuned_configs_cover_k_without_empty_splits():
    """The reference models' projections have measured tiles (the LM heads do not), and
    every config, measured or from the rule, covers K in whole K tiles with no empty split."""
    projections = [v for m in (SMOLLM2, LLAMA3_8B) for name, v in m.items() if name != "lm_head"]
    assert all(tiles.tuned(n, k) for n, k in projections)
    assert not tiles.tuned(*SMOLLM2["lm_head"]) and not tiles.tuned(72, 200)
    for n, k in projections + [SMOLLM2["lm_head"], LLAMA3_8B["lm_head"], (72, 200), (40, 2112)]:
        c = tiles.linear_config(n, k)
        assert c.k_per_split % c.block_k == 0 and c.k_per_split * c.split_k >= k
        assert c.k_per_split * (c.split_k - 1) < k, f"an empty split for {(n, k)}"


def test_small_steps_of_tuned_shapes_take_our_gemm():
    """TritonOps runs a tuned weight shape on our GEMM for steps of at most BLOCK_M tokens in
    16-bit; wider steps, fp32 and small_gemms="cublas" stay on cuBLAS (F.linear)."""
    from specwire.common.model.ops import TritonOps

    n, k = 576, 576  # SmolLM2's o_proj: tuned
    assert tiles.tuned(n, k)
    w = _randn(n, k, seed=5, scale=k**-0.5)
    small, wide = _randn(5, k, seed=7), _randn(tiles.BLOCK_M + 1, k, seed=8)
    ours, cublas = ops.linear(small, w), F.linear(small, w)
    assert not torch.equal(ours, cublas)  # else the routes below could not be told apart
    assert torch.equal(TritonOps().linear(small, w), ours)
    assert torch.equal(TritonOps().linear(wide, w), F.linear(wide, w))
    assert torch.equal(TritonOps(small_gemms="cublas").linear(small, w), cublas)
    small32, w32 = small.float(), w.float()
    assert torch.equal(TritonOps().linear(small32, w32), F.linear(small32, w32))
    with pytest.raises(ValueError, match="small_gemms"):
        TritonOps(small_gemms="cutlass")


# --- gate_up GEMM with SiLU·up in its epilogue ----------------------------------------------------


@pytest.mark.parametrize("m", [1, 5, tiles.BLOCK_M])
@pytest.mark.parametrize(
    "n,k,dtype",
    [(3072, 576, torch.bfloat16), (144, 200, torch.bfloat16), (144, 200, torch.float32)],
    ids=["smollm2-gate_up", "masked-bf16", "masked-fp32"],  # I = 72, K = 200: masked edges
)
def test_gate_up_silu_is_silu_mul_of_linear_bitwise(m, n, k, dtype):
    x = _randn(m, k, dtype=dtype, seed=4)
    w = _randn(n, k, dtype=dtype, seed=5, scale=k**-0.5)
    out = ops.gate_up_silu(x, w)
    assert out.shape == (m, n // 2) and out.dtype == dtype
    assert torch.equal(out, ops.silu_mul(ops.linear(x, w)))


def test_gate_up_silu_refuses_a_k_split():
    # The split partials are summed (and rounded) by a second kernel: no epilogue to ride in.
    x, w = _randn(3, 2112), _randn(80, 2112, seed=5)
    assert tiles.linear_config(80, 2112).split_k > 1
    with pytest.raises(ValueError, match="split"):
        ops.gate_up_silu(x, w)
    assert ops.gate_up_silu(x[:0, :576], w[:, :576]).shape == (0, 40)  # no K split: empty


def test_mlp_rides_silu_in_the_gate_up_gemm_where_it_keeps_the_bits(monkeypatch):
    """`TritonOps.mlp` takes `gate_up_silu` exactly where `linear` would run the gate_up GEMM
    on our GEMM without a K split (tuned 16-bit shapes in steps of at most BLOCK_M tokens;
    exact mode's BLOCK_M-row tiles, any shape), and gives the bits of the composition it
    replaces (`fuse_small=False`)."""
    from specwire.common.model.ops import TritonOps

    calls = []
    real = ops.gate_up_silu
    monkeypatch.setattr(ops, "gate_up_silu", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def check(ops_new, ops_old, m, dtype, picked, hidden=576, inter=1536, first=False):
        # default: SmolLM2's gate_up and down, both tuned
        gu = _randn(2 * inter, hidden, dtype=dtype, seed=5, scale=hidden**-0.5)
        down = _randn(hidden, inter, dtype=dtype, seed=6, scale=inter**-0.5)
        nw = (1.0 + 0.1 * _randn(hidden, dtype=torch.float32, seed=7)).to(dtype)
        x, res = _randn(m, hidden, dtype=dtype, seed=8), _randn(m, hidden, dtype=dtype, seed=9)
        for r in (res, None) if first else (res,):  # None: the first layer, no residual add
            calls.clear()
            out, new_res = ops_new.mlp(x, r, nw, EPS, gu, down)
            assert len(calls) == int(picked), (ops_new.name, m, dtype)
            ref, ref_res = ops_old.mlp(x, r, nw, EPS, gu, down)
            assert torch.equal(out, ref) and torch.equal(new_res, ref_res)

    default, previous = TritonOps(), TritonOps(fuse_small=False)
    assert previous.name == "triton-nofuse" and not previous.fuse_rope and default.fuse_rope
    check(default, previous, 1, torch.bfloat16, picked=True, first=True)
    check(default, previous, tiles.BLOCK_M, torch.bfloat16, picked=True)
    check(default, previous, tiles.BLOCK_M + 1, torch.bfloat16, picked=False)  # wide: cuBLAS
    check(default, previous, 5, torch.float32, picked=False)  # fp32: cuBLAS
    cublas = TritonOps(small_gemms="cublas")
    check(cublas, TritonOps(small_gemms="cublas", fuse_small=False), 5, torch.bfloat16, False)
    check(default, previous, 5, torch.bfloat16, picked=False, hidden=200, inter=72)  # untuned
    exact, exact_previous = TritonOps(exact=True), TritonOps(exact=True, fuse_small=False)
    assert exact.fuse_rope and exact_previous.name == "triton-exact-nofuse"
    for dtype in (torch.bfloat16, torch.float32):  # exact mode: our GEMM, any shape and dtype
        check(exact, exact_previous, 5, dtype, picked=True, hidden=200, inter=72, first=True)
        check(exact, exact_previous, 17, dtype, picked=False, hidden=200, inter=72)


def _layer_tail(ops_obj, attn, residual, w):
    """A decoder layer's o_proj -> mlp -> the next layer's norm, as `DecoderLayer` chains
    them (`defer=True`: o_proj's and down's outputs reach only the next norm)."""
    x = ops_obj.linear(attn, w["o"], defer=True)
    x, residual = ops_obj.mlp(x, residual, w["nw1"], EPS, w["gu"], w["down"], defer=True)
    return ops_obj.add_norm(x, residual, w["nw2"], EPS)


def _tail_weights(hidden, inter, dtype=torch.bfloat16):
    return dict(
        o=_randn(hidden, hidden, dtype=dtype, seed=11, scale=hidden**-0.5),
        gu=_randn(2 * inter, hidden, dtype=dtype, seed=12, scale=hidden**-0.5),
        down=_randn(hidden, inter, dtype=dtype, seed=13, scale=inter**-0.5),
        nw1=(1.0 + 0.1 * _randn(hidden, dtype=torch.float32, seed=14)).to(dtype),
        nw2=(1.0 + 0.1 * _randn(hidden, dtype=torch.float32, seed=15)).to(dtype),
    )


def test_k_split_partials_are_summed_in_the_norm_bitwise():
    """`linear(..., defer=True)` of a K-split GEMM without a bias hands back its fp32 partials
    (`SplitPartials`); `add_rms_norm` and `rms_norm` sum them in their own launch with the
    split sum's arithmetic: the same bits as summing first. No split, or a bias: a tensor."""
    n, k, m = 40, 2112, 5
    assert tiles.linear_config(n, k).split_k > 1
    x, w = _randn(m, k, seed=4), _randn(n, k, seed=5, scale=k**-0.5)
    res, nw = _randn(m, n, seed=6), (1.0 + 0.1 * _randn(n, dtype=torch.float32, seed=7))
    nw = nw.to(torch.bfloat16)
    dense = ops.linear(x, w)
    parts = ops.linear(x, w, defer=True)
    assert isinstance(parts, ops.SplitPartials) and parts.shape == dense.shape
    assert parts.dtype == dense.dtype and torch.equal(parts.dense(), dense)
    ref, ref_res = ops.add_rms_norm(dense, res, nw, EPS)
    got, got_res = ops.add_rms_norm(parts, res, nw, EPS)
    assert torch.equal(got, ref) and torch.equal(got_res, ref_res)
    assert torch.equal(ops.rms_norm(parts, nw, EPS), ops.rms_norm(dense, nw, EPS))
    cfg = tiles.wide_tiles(k, 64, 64, 64, 2, 4, 3)  # a wide config with a split defers too
    wide = ops.linear_wide(x, w, None, None, cfg, defer=True)
    assert isinstance(wide, ops.SplitPartials)
    assert torch.equal(wide.dense(), ops.linear_wide(x, w, None, None, cfg))
    bias = _randn(n, seed=8)
    assert torch.equal(ops.linear(x, w, bias, defer=True), ops.linear(x, w, bias))
    assert isinstance(ops.linear(x[:, :200], w[:, :200], defer=True), torch.Tensor)  # no split


def test_layer_tail_with_deferred_split_sums_keeps_the_bits():
    """o_proj -> mlp -> next norm through `TritonOps` with K-split GEMMs (the exact mode's
    GEMMs here; down [200, 2112] splits K): deferring the split sums into the norms
    (`defer_splits`, the default) hands the norm down's partials and gives exactly the bits of
    summing them first."""
    from specwire.common.model.ops import TritonOps

    w = _tail_weights(200, 2112)  # down [200, 2112]: split by the rule
    assert tiles.linear_config(200, 2112).split_k > 1
    attn, residual = _randn(5, 200, seed=16), _randn(5, 200, seed=17)
    on, off = TritonOps(exact=True), TritonOps(exact=True)
    off.defer_splits = False
    args = (attn, residual, w["nw1"], EPS, w["gu"], w["down"])
    assert isinstance(on.mlp(*args, defer=True)[0], ops.SplitPartials)
    assert isinstance(off.mlp(*args, defer=True)[0], torch.Tensor)  # summed in its own launch
    ref = _layer_tail(off, attn, residual, w)
    got = _layer_tail(on, attn, residual, w)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_linear_handles_empty_batch():
    x, w = _randn(0, 64), _randn(32, 64)
    assert ops.linear(x, w).shape == (0, 32)


# --- batch invariance ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(72, 200), (40, 2112)])  # one program per tile; K split
def test_linear_rows_are_batch_invariant(n, k):
    w = _randn(n, k, seed=5, scale=k**-0.5)
    b = _randn(n, seed=6)
    rows, filler = _randn(100, k, seed=7), _randn(20, k, seed=8)
    _assert_rows_invariant(lambda x: ops.linear(x, w, b), rows, filler)
    _assert_rows_invariant(lambda x: ops.linear(x, w, out_dtype=torch.float32), rows, filler)


def test_norm_rows_are_batch_invariant():
    w = _randn(200, seed=1)
    rows, filler = _randn(100, 200, seed=7), _randn(20, 200, seed=8)
    _assert_rows_invariant(lambda x: ops.rms_norm(x, w, EPS), rows, filler)
    res = _randn(100, 200, seed=9)

    def add_norm(x):  # the residual rides along in the other half of the row
        h = x.shape[1] // 2
        return torch.cat(ops.add_rms_norm(x[:, :h], x[:, h:], w[:h], EPS), dim=1)

    _assert_rows_invariant(add_norm, torch.cat([rows, res], 1), torch.cat([filler, filler], 1))


# --- GPU shapes (H200) ---------------------------------------------------------------------------

SMOLLM2 = dict(qkv=(960, 576), o=(576, 576), gate_up=(3072, 576), down=(576, 1536))
SMOLLM2["lm_head"] = (49152, 576)
LLAMA3_8B = dict(qkv=(6144, 4096), o=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336))
LLAMA3_8B["lm_head"] = (128256, 4096)
GPU_SHAPES = [(f"smollm2-{k}", *v) for k, v in SMOLLM2.items()]
GPU_SHAPES += [(f"llama3-8b-{k}", *v) for k, v in LLAMA3_8B.items()]
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="GPU-size shapes")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name,n,k", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["bf16", "fp32-out"])
def test_gpu_linear_model_shapes(name, n, k, out_dtype):
    w = _randn(n, k, seed=5, scale=k**-0.5)
    rows, filler = _randn(320, k, seed=7), _randn(20, k, seed=8)
    out = ops.linear(rows, w, out_dtype=out_dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if out_dtype else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), _linear_ref(rows, w), **tol)
    _assert_rows_invariant(lambda x: ops.linear(x, w, out_dtype=out_dtype), rows, filler)


# Every other shape with measured exact wide tiles (`triton_tiles._EXACT_WIDE`): those of the
# models `--exact auto` turns the exact mode on for (`_EXACT_CHEAP`), and those whose tiles use
# a narrower K tile than the exact GEMM's (fifth entries), whose bits rest on the same chain of
# MMAs.
TABLE_SHAPES = [
    (f"{n}x{k}", n, k)
    for (n, k) in tiles._EXACT_WIDE
    if (n, k) not in {(s[1], s[2]) for s in GPU_SHAPES}
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "name,n,k", GPU_SHAPES + TABLE_SHAPES, ids=[s[0] for s in GPU_SHAPES + TABLE_SHAPES]
)
def test_gpu_block_m_keeps_bits(name, n, k):
    """Larger row tiles (still mma.sync, see `linear`) must give every row the same bits, and
    so must the exact mode's wide tiles (`exact_wide_config`: wgmma at 64 and 128 rows, K tiles
    narrower than the exact GEMM's where the table says) at every row count they serve, in
    bf16 and as fp32 logits."""
    w, rows = _randn(n, k, seed=5, scale=k**-0.5), _randn(300, k, seed=7)
    ref = ops.linear(rows[:100], w)
    for block_m in (32, 64):
        assert torch.equal(ops.linear(rows[:100], w, block_m=block_m), ref), f"block_m={block_m}"
    for out_dtype in (None, torch.float32):
        ref = ops.linear(rows, w, out_dtype=out_dtype)  # 16-row tiles: the exact mode's bits
        for m in (17, 40, 64, 65, 160, 300):
            cfg = tiles.exact_wide_config(n, k, m)
            got = ops.linear_wide(rows[-m:], w, None, out_dtype, cfg)
            assert torch.equal(got, ref[-m:]), f"M={m} {cfg}"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "name,n,k", GPU_SHAPES + TABLE_SHAPES, ids=[s[0] for s in GPU_SHAPES + TABLE_SHAPES]
)
def test_gpu_exact_wide_steps_on_cublas_keep_bits(name, n, k):
    """The exact mode's wide GEMMs, on cuBLAS above `exact_cublas_rows` rows wherever
    `TritonOps._cublas_exact` finds its bits equal to the exact GEMM's and on our tiles
    elsewhere: every row equals the 16-row exact GEMM's, eager and replayed from a CUDA graph
    (the capture reuses the eager check), bf16 and fp32 logits, with and without a bias."""
    from specwire.common.model.ops import TritonOps

    exact = TritonOps(exact=True)
    w, rows = _randn(n, k, seed=5, scale=k**-0.5), _randn(300, k, seed=7)
    bias = _randn(n, seed=9)
    for b, out_dtype in ((None, None), (None, torch.float32), (bias, None)):
        ref = ops.linear(rows, w, b, out_dtype=out_dtype)
        for m in (17, 40, 160, 300):
            x = rows[-m:].clone()
            assert torch.equal(exact.linear(x, w, b, out_dtype), ref[-m:]), f"eager M={m}"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = exact.linear(x, w, b, out_dtype)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref[-m:]), f"graph M={m} bias={b is not None} {out_dtype}"
    used = [f"M={key[2]} bias={key[3]} {key[4]}" for key, ok in exact._cublas_ok.items() if ok]
    print(f"{name}: on cuBLAS: {', '.join(used) or 'none'}; {exact.gemm_note()}")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_gpu_deferred_split_sums_keep_the_bits(exact):
    """Llama-3-8B's layer tail (o_proj and down split K) through `TritonOps`, default and exact
    mode, at the step widths that take our GEMM with a split (1-16 rows), the measured wide
    tiles (40, 64) and the exact mode's wide tiles (160): deferring the split sums into the
    next norms gives the bits of summing them first, eager and replayed from a CUDA graph."""
    from specwire.common.model.ops import TritonOps

    w = _tail_weights(4096, 14336)
    on, off = TritonOps(exact=exact), TritonOps(exact=exact)
    off.defer_splits = False
    for m in (1, 5, 16, 40, 64, 160):
        attn, residual = _randn(m, 4096, seed=16), _randn(m, 4096, seed=17)
        ref = _layer_tail(off, attn, residual, w)
        got = _layer_tail(on, attn, residual, w)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), f"eager M={m}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _layer_tail(on, attn, residual, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), f"graph M={m}"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name,n,k", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_unmasked_k_loads_keep_bits(name, n, k, monkeypatch):
    """Loads without K masks (`EVEN_K`, where BLOCK_K divides K) are another binary, but must
    give the masked loop's bits: the exact GEMM at 5 and 160 rows (narrow and wide tiles, bf16
    and fp32 logits) and SiLU·up in the gate_up epilogue, each side by side with UNMASKED_K
    off."""
    w, rows = _randn(n, k, seed=5, scale=k**-0.5), _randn(160, k, seed=7)

    def outputs() -> list[torch.Tensor]:
        got = [ops.linear(rows[:5], w), ops.linear(rows[:5], w, out_dtype=torch.float32)]
        got.append(ops.linear_wide(rows, w, None, None, tiles.exact_wide_config(n, k, 160)))
        if n % 2 == 0 and tiles.linear_config(n, k).split_k == 1:
            got.append(ops.gate_up_silu(rows[:5], w))
        return got

    if not ops.even_k(k, tiles.linear_config(n, k).block_k):
        pytest.skip(f"BLOCK_K does not divide K={k}: its loads stay masked either way")
    unmasked = outputs()
    monkeypatch.setattr(ops, "UNMASKED_K", False)
    for new, old in zip(unmasked, outputs(), strict=True):
        assert torch.equal(new, old)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name,n,k", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_wide_tiles_match_matmul(name, n, k):
    """The non-exact wide tiles (`triton_tiles._WIDE`) compute x @ w.T at the row counts they
    serve (bits may differ from the exact GEMM's, as cuBLAS's do)."""
    w, rows = _randn(n, k, seed=5, scale=k**-0.5), _randn(64, k, seed=7)
    for m in (17, 40, 48, 64):
        cfg = tiles.wide_config(n, k, m)
        if cfg is not None:
            got = ops.linear_wide(rows[:m], w, None, None, cfg).float()
            torch.testing.assert_close(got, _linear_ref(rows[:m], w), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("hidden,inter", [(576, 1536), (4096, 14336)])
def test_gpu_elementwise_ops_model_shapes(hidden, inter):
    x, res, w = _randn(64, hidden), _randn(64, hidden, seed=2), _randn(hidden, seed=1)
    _assert_within_ulp(ops.rms_norm(x, w, EPS), _eager_rms_norm(x, w))
    _assert_rows_invariant(lambda r: ops.rms_norm(r, w, EPS), _randn(100, hidden), x[:20])
    normed, new_res = ops.add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, x + res)
    _assert_within_ulp(normed, _eager_rms_norm(x + res, w))
    gate_up = _randn(64, 2 * inter, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.gpu
@on_gpu
def test_gpu_fp32_linear_is_ieee():
    x, w = _randn(5, 576, dtype=torch.float32), _randn(960, 576, dtype=torch.float32, seed=5)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@on_gpu
def test_gpu_ops_replay_in_a_cuda_graph():
    n, k = LLAMA3_8B["o"]
    x, w, nw = _randn(8, k), _randn(n, k, seed=5, scale=k**-0.5), _randn(n, seed=1)
    gate_up = _randn(8, 2 * 256, seed=3)

    def step():
        h = ops.linear(x, w)
        normed, res = ops.add_rms_norm(h, x, nw, EPS)
        return normed, res, ops.silu_mul(gate_up)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)
