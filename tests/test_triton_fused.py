"""The fused Triton kernels (norm -> GEMM, SiLU·up -> GEMM, RoPE + KV store) against the unfused
ops they replace, and a whole model step with fused against unfused ops.

Runs on a GPU, or on the CPU under Triton's interpreter (small shapes):
  TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/test_triton_fused.py
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from triton_env import kernel_device

DEVICE = kernel_device()  # (skips this module where the kernels cannot run)

# noqa: E402 below: triton is known to be there
from specwire.common.model import triton_base, triton_ops, triton_tiles  # noqa: E402
from specwire.common.model import triton_fused as fused  # noqa: E402
from specwire.common.model.attention import AttentionMetadata  # noqa: E402
from specwire.common.model.config import SMOLLM2_135M, TINY_RANDOM  # noqa: E402
from specwire.common.model.llama import LlamaModel  # noqa: E402
from specwire.common.model.ops import TritonOps  # noqa: E402
from specwire.common.model.triton_attention import store_kv  # noqa: E402
from specwire.common.model.triton_backend import TritonPagedAttention  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 3, 5, 16]  # up to fused.MAX_TOKENS: one row tile
# (N, K): masked N and K edges; a long K that takes the K split (see test_shapes_cover_k_split)
GEMM_SHAPES = [(72, 200), (40, 2112)]
EPS = 1e-5


@functools.cache
def _unfused() -> TritonOps:
    return TritonOps(fused=False)


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def _norm_weight(k, dtype, seed=1):
    return (1.0 + 0.1 * _randn(k, dtype=torch.float32, seed=seed)).to(dtype)


def _assert_matches(out, unfused, operand, weight, bias=None):
    """`out` against the unfused path's output, and against an fp32 product of the unfused
    path's GEMM operand (the normalised row, or silu(gate) * up). The dot's K order is ours,
    not cuBLAS's (which may also reduce bf16 splits in bf16), and the mean square's sum order
    differs from the norm kernel's: fp32 agrees to rounding noise, bf16 to an ulp. Against the
    fp32 product of the same operand bits, bf16 is almost always bitwise: an operand rounded
    differently from the unfused path would show here."""
    assert out.dtype == unfused.dtype and out.shape == unfused.shape
    product = operand.float() @ weight.float().T
    product = (product if bias is None else product + bias.float()).to(out.dtype)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, unfused, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, product, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), unfused.float(), rtol=1.6e-2, atol=1e-2)
        assert (out == product).float().mean().item() > 0.95


def test_shapes_cover_k_split():
    assert triton_tiles.linear_config(*GEMM_SHAPES[0]).split_k == 1
    assert triton_tiles.linear_config(*GEMM_SHAPES[1]).split_k > 1


# --- norm -> GEMM ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_add_norm_linear_matches_unfused(dtype, m, n, k):
    x, res = _randn(m, k, dtype=dtype, seed=2), _randn(m, k, dtype=dtype, seed=3)
    nw, w = _norm_weight(k, dtype), _randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=5) if m % 2 else None  # with and without a bias
    out, new_res = fused.add_norm_linear(x, res, nw, EPS, w, bias)
    ref, ref_res = _unfused().add_norm_linear(x, res, nw, EPS, w, bias)
    assert torch.equal(new_res, ref_res)  # x + residual, rounded once: bitwise
    _assert_matches(out, ref, triton_ops.add_rms_norm(x, res, nw, EPS)[0], w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear_without_residual_matches_unfused(dtype):
    m, n, k = 5, 72, 200
    x, nw = _randn(m, k, dtype=dtype, seed=2), _norm_weight(k, dtype)
    w = _randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    out, new_res = fused.add_norm_linear(x, None, nw, EPS, w)
    ref, _ = _unfused().add_norm_linear(x, None, nw, EPS, w)
    assert new_res is x  # the first layer's residual is its input, as unfused
    _assert_matches(out, ref, triton_ops.rms_norm(x, nw, EPS), w)


def test_norm_linear_handles_empty_batch():
    x, nw, w = _randn(0, 64), _norm_weight(64, torch.bfloat16), _randn(32, 64)
    out, new_res = fused.add_norm_linear(x, x, nw, EPS, w)
    assert out.shape == (0, 32) and new_res.shape == (0, 64)


# --- SiLU·up -> GEMM -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("n,inter", GEMM_SHAPES)
def test_silu_linear_matches_unfused(dtype, m, n, inter):
    gate_up = _randn(m, 2 * inter, dtype=dtype, seed=6, scale=3.0)
    w = _randn(n, inter, dtype=dtype, seed=7, scale=inter**-0.5)
    out, ref = fused.silu_linear(gate_up, w), _unfused().silu_linear(gate_up, w)
    _assert_matches(out, ref, triton_ops.silu_mul(gate_up), w)


# --- routing ---------------------------------------------------------------------------------


def test_wide_steps_and_exact_mode_keep_the_unfused_path():
    n, k = 72, 200
    w, nw = _randn(n, k, seed=4, scale=k**-0.5), _norm_weight(k, torch.bfloat16)
    wide = fused.MAX_TOKENS + 1
    x, res = _randn(wide, k, seed=2), _randn(wide, k, seed=3)
    out, _ = TritonOps(fused=True).add_norm_linear(x, res, nw, EPS, w)
    assert torch.equal(out, _unfused().add_norm_linear(x, res, nw, EPS, w)[0])
    exact = TritonOps(exact=True, fused=True)
    assert exact.name == "triton-exact"
    assert exact.fuse_rope  # RoPE + store is bitwise the same as rope then store_kv
    for m in (1, wide):  # exact mode: the batch-invariant GEMM after the norm kernel, always
        out, _ = exact.add_norm_linear(x[:m], res[:m], nw, EPS, w)
        h = triton_ops.add_rms_norm(x[:m], res[:m], nw, EPS)[0]
        assert torch.equal(out, triton_ops.linear(h, w, block_m=16 if m <= 16 else 64))
        gate_up = _randn(m, 2 * k, seed=6)
        ref = triton_ops.linear(triton_ops.silu_mul(gate_up), w, block_m=16 if m <= 16 else 64)
        assert torch.equal(exact.silu_linear(gate_up, w), ref)


# --- RoPE + KV store -------------------------------------------------------------------------


def _rotary(t, d, dtype, seed=8):
    angles = _randn(t, d // 2, dtype=torch.float32, seed=seed) * 10
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, D] each


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (9, 3, 64)])  # GQA groups 2 and 3
@pytest.mark.parametrize("cache_dtype", [None, torch.float32], ids=["same", "fp32-cache"])
def test_rope_store_kv_matches_rope_then_store(dtype, heads, kv_heads, d, cache_dtype):
    t, block_size, num_blocks = 7, 4, 9
    qkv = _randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=9)
    cos, sin = _rotary(t, d, dtype)
    # Tokens of three rows at different positions, over shuffled blocks; one padding token (-1).
    slots = torch.tensor([5, 6, 7, 8, 30, 31, -1], device=DEVICE)  # blocks 1, 2, 7
    cache = _randn(2, num_blocks, block_size, kv_heads, d, dtype=cache_dtype or dtype, seed=10)

    def split(buf):
        qk = buf[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
        return qk, buf[:, (heads + kv_heads) * d :].view(t, kv_heads, d)

    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    qk, v = split(ref_qkv)
    triton_ops.rope(qk, cos, sin, inplace=True)
    store_kv(qk[:, heads:], v, ref_cache, slots)
    qk, v = split(qkv)
    fused.rope_store_kv(qk, v, cos, sin, cache, slots, heads)
    # The same per-element formula (`triton_ops._rotate`): the same bits, fp32 included (for
    # sm_90 both kernels contract x * cos + r * sin into the same FMAs; their PTX has the same
    # float instructions in the same order). TritonOps relies on it (`fuse_rope`).
    assert torch.equal(qkv, ref_qkv) and torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize(
    "heads,kv_heads,d,k,bias",
    [(9, 3, 64, 576, False), (4, 2, 16, 200, True)],  # SmolLM2's qkv; 2 heads a tile, a bias
    ids=["smollm2", "small-bias"],
)
@pytest.mark.parametrize("cache_dtype", [None, torch.float32], ids=["same", "fp32-cache"])
def test_qkv_rope_store_is_linear_then_rope_store_kv(dtype, m, heads, kv_heads, d, k, bias,
                                                      cache_dtype):  # fmt: skip
    n, block_size, num_blocks = (heads + 2 * kv_heads) * d, 4, 9
    x = _randn(m, k, dtype=dtype, seed=2)
    w = _randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    b = _randn(n, dtype=dtype, seed=5) if bias else None
    cos, sin = _rotary(m, d, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(m))
    slots = slots[:m].to(DEVICE)
    slots[m // 2] = -1  # a padding token: rotated, never stored
    cache = _randn(2, num_blocks, block_size, kv_heads, d, dtype=cache_dtype or dtype, seed=10)
    ref_cache = cache.clone()
    ref = triton_ops.linear(x, w, b)
    qk = ref[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d)
    v = ref[:, (heads + kv_heads) * d :].view(m, kv_heads, d)
    fused.rope_store_kv(qk, v, cos, sin, ref_cache, slots, heads)
    out = fused.qkv_rope_store(x, w, b, cos, sin, cache, slots, heads)
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_norms_in_the_gemm_prologues_keep_every_bit(dtype, m, with_residual):
    """The RMSNorm (and its residual add) folded into the qkv and gate_up GEMMs' prologues, at
    SmolLM2's widths: the norm kernel's output fed to the same GEMMs, bit for bit, and the same
    new residual (x itself for the first layer)."""
    k, heads, kv_heads, d, inter = 576, 9, 3, 64, 1536
    x = _randn(m, k, dtype=dtype, seed=2)
    res = _randn(m, k, dtype=dtype, seed=3) if with_residual else None
    nw = _norm_weight(k, dtype)
    if with_residual:
        h, ref_res = triton_ops.add_rms_norm(x, res, nw, EPS)
    else:
        h, ref_res = triton_ops.rms_norm(x, nw, EPS), x
    w_gu = _randn(2 * inter, k, dtype=dtype, seed=4, scale=k**-0.5)
    assert triton_ops.norm_fuses(k, triton_tiles.linear_config(2 * inter, k))
    out, new_res = triton_ops.add_norm_gate_up_silu(x, res, nw, EPS, w_gu)
    assert torch.equal(out, triton_ops.gate_up_silu(h, w_gu)) and torch.equal(new_res, ref_res)
    w = _randn((heads + 2 * kv_heads) * d, k, dtype=dtype, seed=5, scale=k**-0.5)
    cos, sin = _rotary(m, d, dtype)
    slots = torch.arange(m, device=DEVICE) * 2 + 1
    cache = _randn(2, 9, 4, kv_heads, d, dtype=dtype, seed=10)
    ref_cache = cache.clone()
    ref = fused.qkv_rope_store(h, w, None, cos, sin, ref_cache, slots, heads)
    out, new_res = fused.add_norm_qkv_rope_store(
        x, res, nw, EPS, w, None, cos, sin, cache, slots, heads
    )
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)
    assert torch.equal(new_res, ref_res)


def test_norm_prologue_refuses_tiles_that_would_sum_differently():
    """Llama-3-8B's tiles run 4 warps where its norm kernel runs 16 (another reduction order):
    no fused norm there, and a clear error if asked."""
    assert triton_ops.norm_warps(4096) == 16 and triton_ops.norm_warps(576) == 4
    assert not triton_ops.norm_fuses(4096, triton_tiles.linear_config(28672, 4096))
    x, w = _randn(2, 4096), _randn(28672, 4096)
    with pytest.raises(ValueError, match="cannot take the norm"):
        triton_ops.add_norm_gate_up_silu(x, None, _norm_weight(4096, x.dtype), EPS, w)


def test_qkv_rope_store_refuses_what_it_cannot_match():
    heads, kv_heads, d = 1, 1, 16
    cache = torch.zeros(2, 2, 4, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = _rotary(3, d, torch.bfloat16)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    x, w = _randn(3, 2112), _randn(48, 2112)  # K long enough to take a K split
    assert triton_tiles.linear_config(48, 2112).split_k > 1
    with pytest.raises(ValueError, match="split"):
        fused.qkv_rope_store(x, w, None, cos, sin, cache, slots, heads)
    with pytest.raises(ValueError, match="heads"):  # 2 heads of q: 64 rows, not 48
        fused.qkv_rope_store(x[:, :64], _randn(48, 64), None, cos, sin, cache, slots, 2)


# --- a whole model step ----------------------------------------------------------------------


def _tiny_model(dtype, cfg=TINY_RANDOM) -> LlamaModel:
    """`cfg`'s shapes with a qkv bias (so the fused bias path runs), seeded weights."""
    cfg = dataclasses.replace(cfg, attention_bias=True)
    model = LlamaModel(cfg, block_size=4, max_positions=64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            scale = cfg.hidden_size**-0.5
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * scale)
    model = model.to(device=DEVICE, dtype=dtype).eval()
    model.set_attention(TritonPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4))
    return model


def _step(rows: list[tuple[int, int]], pad_tokens: int, block_size: int, width: int):
    """(positions, meta) for rows of (cached tokens, new tokens) on disjoint shuffled blocks,
    plus `pad_tokens` padding tokens (slot -1) after the last row."""
    perm = torch.randperm(len(rows) * width, generator=torch.Generator().manual_seed(1)) + 1
    tables = perm.view(len(rows), width)
    positions, slots, cu = [], [], [0]
    for r, (cached, new) in enumerate(rows):
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + new)
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=tables.to(device=DEVICE, dtype=torch.int32),
        context_lens=torch.tensor([c + n for c, n in rows], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
    )
    return torch.tensor(positions, device=DEVICE), meta


MODEL_DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", MODEL_DTYPES)  # bf16 attention needs the GPU's tl.dot
@pytest.mark.parametrize(
    "rows,pad",
    [([(3, 1), (9, 5), (14, 2)], 1), ([(3, 6), (9, 7), (14, 5)], 0)],  # T = 9 fused; T = 18 wide
)
def test_model_step_fused_matches_unfused(dtype, rows, pad):
    model = _tiny_model(dtype)
    positions, meta = _step(rows, pad, model.block_size, width=5)
    num_blocks = 1 + meta.block_tables.numel()
    kv = model.allocate_kv_cache(num_blocks)
    kv.copy_(_randn(*kv.shape, dtype=dtype, seed=11))  # the rows' earlier context
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, positions.shape, generator=g).to(DEVICE)
    results = []
    for ops in (TritonOps(fused=False), TritonOps(fused=True)):
        model.set_ops(ops)
        cache = kv.clone()
        logits = model.compute_logits(model(ids, positions, cache, meta))
        results.append((logits[: sum(n for _, n in rows)], cache))
    (ref, ref_cache), (out, out_cache) = results
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out_cache, ref_cache, **tol)


# SmolLM2's layer widths (its tuned GEMMs: the default ops run them on our GEMM in 16-bit), one
# layer, a small vocabulary.
SMOLLM2_LAYER = dataclasses.replace(
    SMOLLM2_135M, num_layers=1, vocab_size=256, max_position_embeddings=64
)
BIT_EXACT_CASES = [
    (cfg, dtype, exact)
    for cfg in (TINY_RANDOM, SMOLLM2_LAYER)
    for dtype in MODEL_DTYPES
    for exact in (False, True)
    if dtype == torch.bfloat16 or exact  # fp32 without exact: cuBLAS, no SiLU to fuse
]


@pytest.mark.parametrize(
    "cfg,dtype,exact",
    BIT_EXACT_CASES,
    ids=[
        f"{'smollm2' if c is SMOLLM2_LAYER else 'tiny'}-{str(d)[6:]}-{'exact' if e else 'plain'}"
        for c, d, e in BIT_EXACT_CASES
    ],
)
@pytest.mark.parametrize(
    "rows,pad", [([(3, 1), (9, 5), (14, 2)], 1), ([(3, 6), (9, 7), (14, 5)], 0)]
)
def test_model_step_bit_exact_fusions_keep_every_bit(monkeypatch, cfg, dtype, exact, rows, pad):
    """The default ops' fusions (SiLU·up in the gate_up GEMM; RoPE and the KV store in the qkv
    GEMM, or in one kernel; with `fuse_norm=True` also the RMSNorms in the GEMM prologues)
    against the kernels they replace (`fuse_small=False`): the same
    logits and cache, bit for bit, and each fusion taken where it applies (T = 9 on our GEMM:
    both GEMM epilogues; otherwise RoPE + store in one kernel)."""
    names = [
        (triton_ops, "gate_up_silu"),
        (fused, "qkv_rope_store"),
        (fused, "rope_store_kv"),
        (triton_ops, "add_norm_gate_up_silu"),
        (fused, "add_norm_qkv_rope_store"),
    ]
    calls = {name: 0 for _, name in names}
    for module, name in names:
        real = getattr(module, name)

        def spy(*a, real=real, name=name, **kw):
            calls[name] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, spy)
    model = _tiny_model(dtype, cfg)
    positions, meta = _step(rows, pad, model.block_size, width=5)
    kv = model.allocate_kv_cache(1 + meta.block_tables.numel())
    kv.copy_(_randn(*kv.shape, dtype=dtype, seed=11))  # the rows' earlier context
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, positions.shape, generator=g).to(DEVICE)

    def run(**kw):
        model.set_ops(TritonOps(exact=exact, **kw))
        cache = kv.clone()
        for name in calls:
            calls[name] = 0
        return model.compute_logits(model(ids, positions, cache, meta)), cache

    ref, ref_cache = run(fuse_small=False)
    small = positions.shape[0] <= triton_tiles.BLOCK_M
    epilogues = small and (exact or (dtype == torch.bfloat16 and cfg is SMOLLM2_LAYER))
    for fuse_norm in (False, True):
        out, out_cache = run(fuse_small=True, fuse_norm=fuse_norm)
        assert torch.equal(out, ref) and torch.equal(out_cache, ref_cache)
        # With fuse_norm, the norms ride along where the tiles run the norm kernel's warps:
        # SmolLM2's, not tiny's.
        norms = fuse_norm and epilogues and cfg is SMOLLM2_LAYER
        assert calls == {
            "gate_up_silu": cfg.num_layers * (epilogues and not norms),
            "qkv_rope_store": cfg.num_layers * (epilogues and not norms),
            "rope_store_kv": cfg.num_layers * (not epilogues),
            "add_norm_gate_up_silu": cfg.num_layers * norms,
            "add_norm_qkv_rope_store": cfg.num_layers * norms,
        }, fuse_norm


# --- GPU shapes (H200) -----------------------------------------------------------------------

on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="GPU-size shapes")
# (name, hidden K, qkv N, gate_up N, down: (N, I))
MODEL_SHAPES = [("smollm2", 576, 960, 3072, 1536), ("llama3-8b", 4096, 6144, 28672, 14336)]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "name,hidden,qkv,gate_up,inter", MODEL_SHAPES, ids=[s[0] for s in MODEL_SHAPES]
)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gpu_model_shapes_match_unfused(name, hidden, qkv, gate_up, inter, m):
    x, res, nw = (
        _randn(m, hidden, seed=2),
        _randn(m, hidden, seed=3),
        _norm_weight(hidden, torch.bfloat16),
    )
    for n in (qkv, gate_up):
        w = _randn(n, hidden, seed=4, scale=hidden**-0.5)
        out, new_res = fused.add_norm_linear(x, res, nw, EPS, w)
        ref, ref_res = _unfused().add_norm_linear(x, res, nw, EPS, w)
        assert torch.equal(new_res, ref_res)
        _assert_matches(out, ref, triton_ops.add_rms_norm(x, res, nw, EPS)[0], w)
    gu = _randn(m, 2 * inter, seed=6, scale=3.0)
    w = _randn(hidden, inter, seed=7, scale=inter**-0.5)
    out, ref = fused.silu_linear(gu, w), _unfused().silu_linear(gu, w)
    _assert_matches(out, ref, triton_ops.silu_mul(gu), w)


# (name, hidden, heads, KV heads, head dim, intermediate): the bit-exact epilogues' real shapes
EPILOGUE_SHAPES = [("smollm2", 576, 9, 3, 64, 1536), ("llama3-8b", 4096, 32, 8, 128, 14336)]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "name,hidden,heads,kv_heads,d,inter", EPILOGUE_SHAPES, ids=[s[0] for s in EPILOGUE_SHAPES]
)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gpu_bit_exact_epilogues_model_shapes(name, hidden, heads, kv_heads, d, inter, m):
    """The default ops' GEMM epilogues on the compiled kernels (the interpreter cannot show
    the compiler's FMA contraction or mma order): bitwise the kernels they replace."""
    x = _randn(m, hidden, seed=2)
    gu = _randn(2 * inter, hidden, seed=4, scale=hidden**-0.5)
    assert torch.equal(
        triton_ops.gate_up_silu(x, gu), triton_ops.silu_mul(triton_ops.linear(x, gu))
    )
    w = _randn((heads + 2 * kv_heads) * d, hidden, seed=5, scale=hidden**-0.5)
    cos, sin = _rotary(m, d, torch.bfloat16)
    slots = torch.arange(m, device=DEVICE) * 3 + 1
    slots[m // 2] = -1
    cache = _randn(2, 4, 16, kv_heads, d, seed=10)
    ref_cache, ref = cache.clone(), triton_ops.linear(x, w)
    qk = ref[:, : (heads + kv_heads) * d].view(m, heads + kv_heads, d)
    v = ref[:, (heads + kv_heads) * d :].view(m, kv_heads, d)
    fused.rope_store_kv(qk, v, cos, sin, ref_cache, slots, heads)
    out = fused.qkv_rope_store(x, w, None, cos, sin, cache, slots, heads)
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)


@pytest.mark.gpu
@on_gpu
def test_gpu_fused_ops_replay_in_a_cuda_graph():
    hidden, inter, heads, kv_heads, d = 576, 1536, 9, 3, 64
    x, res, nw = _randn(5, hidden), _randn(5, hidden, seed=2), _norm_weight(hidden, torch.bfloat16)
    w_qkv = _randn((heads + 2 * kv_heads) * d, hidden, seed=4, scale=hidden**-0.5)
    w_down = _randn(hidden, inter, seed=5, scale=inter**-0.5)
    gate_up = _randn(5, 2 * inter, seed=6)
    cos, sin = _rotary(5, d, torch.bfloat16)
    cache = torch.zeros(2, 4, 16, kv_heads, d, dtype=torch.bfloat16, device=DEVICE)
    cache2 = cache.clone()
    w_gate_up = _randn(2 * inter, hidden, seed=6, scale=hidden**-0.5)
    slots = torch.tensor([17, 18, 19, 20, -1], device=DEVICE)

    def step():
        qkv, new_res = fused.add_norm_linear(x, res, nw, EPS, w_qkv)
        qk = qkv[:, : (heads + kv_heads) * d].view(5, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(5, kv_heads, d)
        fused.rope_store_kv(qk, v, cos, sin, cache, slots, heads)
        h = triton_ops.rms_norm(x, nw, EPS)  # the default ops' bit-exact epilogues
        stored = fused.qkv_rope_store(h, w_qkv, None, cos, sin, cache2, slots, heads)
        silu = triton_ops.gate_up_silu(h, w_gate_up)
        outs = (qkv, new_res, fused.silu_linear(gate_up, w_down), cache.clone())
        return (*outs, stored, cache2.clone(), silu)

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


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
@torch.no_grad()
def test_gpu_pdl_keeps_every_bit_eager_and_in_a_graph(exact):
    """Programmatic dependent launch (the default on sm_90+, with the norm weights and the
    attention's metadata loaded before each kernel's wait) and PDL with nothing before the
    wait, against plain launches: a SmolLM2-wide model step (norms, GEMMs with their
    epilogues, attention and its combine), eagerly and replayed from a CUDA graph twice, gives
    the same logits and cache bit for bit. A kernel that read what its producer writes before
    its `_grid_sync` wait would race it and differ."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    cfg = dataclasses.replace(SMOLLM2_LAYER, num_layers=4)
    model = _tiny_model(torch.bfloat16, cfg)
    positions, meta = _step([(3, 1), (9, 5)], 1, model.block_size, width=5)
    kv = model.allocate_kv_cache(1 + meta.block_tables.numel())
    kv.copy_(_randn(*kv.shape, dtype=torch.bfloat16, seed=11))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, positions.shape, generator=g).to(DEVICE)
    results = {}
    try:
        for pdl, early in ((False, True), (True, False), (True, True)):
            model.set_ops(TritonOps(exact=exact, pdl=pdl, pdl_early=early))
            assert triton_base.pdl_enabled() == pdl and triton_base.early_loads() == early
            cache = kv.clone()
            eager = model.compute_logits(model(ids, positions, cache, meta))
            graph_cache = kv.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(ids, positions, graph_cache.clone(), meta)  # compile outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = model.compute_logits(model(ids, positions, graph_cache, meta))
            replays = []
            for _ in range(2):
                graph_cache.copy_(kv)
                graph.replay()
                replays.append((captured.clone(), graph_cache.clone()))
            torch.cuda.synchronize()
            results[pdl, early] = (eager, cache, replays)
    finally:
        triton_base.set_pdl(True)
    ref, ref_cache, ref_replays = results.pop((False, True))
    for out, out_cache, replays in results.values():
        assert torch.equal(out, ref) and torch.equal(out_cache, ref_cache)
        for (a, ac), (b, bc) in zip(replays, ref_replays, strict=True):
            assert torch.equal(a, ref) and torch.equal(ac, ref_cache)
            assert torch.equal(a, b) and torch.equal(ac, bc)
