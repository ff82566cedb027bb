"""The GPU attention backend: our Triton kernels (`triton_attention.py`) behind the backend seam.

One launch per layer stores the step's K/V by slot (slot -1 = padding, skipped; with
`TritonOps`, whose `rope` it reproduces bit for bit, the same launch applies RoPE to q and k:
`forward_rope`) and one launch attends (a second merges its KV splits) for every
row of the step — prefill chunks, decode rows and verify rows together —
reading only each row's real context through its block table. The launch grid depends only on
tensor shapes, so any step can be captured in a CUDA graph keyed by its padded token count,
and no shape is compiled or planned at serving time. Each query's result depends only on its
own row (fixed key tiles from position 0, split-KV only at fixed absolute key positions and
merged in a fixed order): the same logits whether a position is
verified alone, in a 1+K verify row or in a prefill chunk.
"""

from __future__ import annotations

import torch

from specwire.common.model.attention import AttentionMetadata, AttentionShape
from specwire.common.model.triton_tiles import exact_measured_cheap


class TritonPagedAttention(AttentionShape):
    name = "triton"
    varlen = True
    graphs = True
    fused_rope = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        # imports triton: only on GPU machines
        from specwire.common.model import triton_attention, triton_fused

        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        self._ops = triton_attention
        self._fused = triton_fused

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        self._ops.store_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta)

    def forward_rope(
        self,
        qk: torch.Tensor,  # [T, H + KVH, D]: q heads then k heads, rotated in place
        v: torch.Tensor,  # [T, KVH, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        """`forward` after `TritonOps.rope`, with the rotation and the K/V store in one launch."""
        self._fused.rope_store_kv(qk, v, cos, sin, kv_cache, meta.slot_mapping, self.num_heads)
        return self.attend(qk[:, : self.num_heads], kv_cache, meta)

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], this step's K/V already stored
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        """`forward` without the store: the ops' qkv GEMM stored K/V (`qkv_rope_store`)."""
        assert meta.cu_seqlens_q is not None, "the Triton backend needs varlen metadata"
        return self._ops.paged_attention(
            q, kv_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, self.scale
        )


def make_backend(kind: str, model, device: torch.device):
    """The attention backend for `kind` ("auto" = Triton on CUDA, SDPA elsewhere)."""
    from specwire.common.errors import UserError
    from specwire.common.model.attention import TorchPagedAttention

    cfg = model.cfg
    args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.block_size)
    if kind == "auto":
        kind = "triton" if device.type == "cuda" else "sdpa"
    if kind == "sdpa":
        return TorchPagedAttention(*args)
    if kind == "triton":
        if device.type != "cuda":
            raise UserError("--attention triton needs a CUDA device (use sdpa on the CPU)")
        try:
            return TritonPagedAttention(*args)
        except ImportError as exc:
            raise UserError(f"--attention triton needs the triton package ({exc})") from exc
    raise UserError(f"unknown attention backend {kind!r} (use auto, triton or sdpa)")


# `--exact auto` turns the exact mode on, in bf16 or fp16 with the Triton kernels, for models
# whose GEMM weight shapes are all of a model the exact mode was measured cheap on (at most
# +10 % at every verify step measured: `triton_tiles.exact_measured_cheap`). Measured on the
# H200 (bench/RESULTS.md, rounds 18-22), exact / default verify step, with the exact mode's
# wide steps on cuBLAS where it gives their bits (round 22): SmolLM2-135M <= 1.04 and nothing
# measurable served (c = 1, 8, 32; rounds 19, 23); SmolLM2-360M 0.83-1.01 (round 23) and
# Qwen2.5-1.5B 0.88-1.04 (B = 1 to 64); not Llama-3.2-1B (1.21 at B=64 q=5) or Llama-3-8B
# (1.07 up to B=32, 1.14 at B=64 q=5), whose K-split GEMMs stay on our slower tiles. Neither
# hidden size nor tiles make it cheap; only a measurement does. Other models keep it opt-in
# (`--exact on`).


def resolve_exact(
    mode: str,
    attention,
    dtype: torch.dtype,
    gemm_shapes: list[tuple[int, int]],
    fused: bool,
) -> bool:
    """Whether the model runs the exact mode: `--exact on|off`, or auto (see the note above;
    `gemm_shapes`: `LlamaModel.gemm_shapes`). fp32 needs no exact mode
    (its speculation is lossless as it is), and auto yields to an explicit `--fused`, which
    the exact mode would ignore."""
    if mode != "auto":
        return mode == "on"
    return (
        attention.name == "triton"
        and dtype in (torch.bfloat16, torch.float16)
        and exact_measured_cheap(gemm_shapes)
        and not fused
    )


def make_ops(
    attention,
    exact: bool = False,
    fused: bool = False,
    small_gemms: str = "triton",
    fuse_small: bool = True,
    pdl: bool = True,
    fuse_norm: bool = False,
    pdl_early: bool = True,
):
    """The model's ops to go with its attention backend: our fused Triton kernels beside the
    Triton attention (batch-invariant GEMMs too when `exact`), plain PyTorch otherwise.

    `fused` (`--fused`, experimental): fold norms and SiLU·up into the GEMMs of small steps
    (`triton_fused.py`; never in exact mode). Off by default: on the H200 the fused SiLU GEMM
    is far slower than cuBLAS (bench/RESULTS.md). `fuse_small=False` turns the bit-exact
    fusions off (`TritonOps`), `pdl=False` programmatic dependent launch (`pdl_early=False`
    no loads before its wait), `fuse_norm=True` the norms in the GEMMs' prologues, for
    benchmarks."""
    from specwire.common.errors import UserError
    from specwire.common.model.ops import TorchOps, TritonOps

    if attention.name == "triton":
        return TritonOps(
            exact=exact,
            fused=fused,
            small_gemms=small_gemms,
            fuse_small=fuse_small,
            pdl=pdl,
            fuse_norm=fuse_norm,
            pdl_early=pdl_early,
        )
    if exact or fused:
        flag = "--exact on" if exact else "--fused"
        raise UserError(f"{flag} needs the Triton kernels (--device cuda --attention triton)")
    return TorchOps()
