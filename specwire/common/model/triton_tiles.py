"""Tile configs of the batch-invariant GEMM (`triton_ops.linear` and the GEMMs with epilogues):
one config per weight shape (N, K), never per M, which is what keeps a row's bits independent
of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

BLOCK_M = 16  # tl.dot's minimum; fixed for every M (small M is the decode/verify regime)
_TARGET_PROGRAMS = 264  # 2 per SM on the H200's 132 SMs, for the weight-streaming (small M) case


@dataclass(frozen=True)
class LinearConfig:
    """Tile config of one weight shape. A function of (N, K) only: never of M."""

    block_n: int
    block_k: int
    split_k: int  # K splits, each reduced by its own program into an fp32 workspace
    k_per_split: int  # elements of K per split (a multiple of block_k)
    num_warps: int = 4
    num_stages: int = 4


def _config(k: int, bn: int, bk: int, split: int, warps: int = 4, stages: int = 4):
    """Tiles for a K of `k`: `split` ranges of whole K tiles (fewer when one would be empty)."""
    iters = triton.cdiv(k, bk)
    per_split = triton.cdiv(iters, split)
    return LinearConfig(bn, bk, triton.cdiv(iters, per_split), per_split * bk, warps, stages)


# Tiles measured fastest at M = 1 and 5 (one config for both, as the exact mode needs) by
# `python3 bench/gemm_sweep.py` on the H200 (bench/RESULTS.md, round 13), for the projections of
# the two reference models. Each is within 3 % of cuBLAS there or faster, so `TritonOps` runs these
# shapes on our GEMM for steps of at most BLOCK_M tokens (`tuned`). Another GPU still gets valid
# (if untuned) tiles; shapes not listed take `linear_config`'s rule.
_TUNED: dict[tuple[int, int], LinearConfig] = {
    # SmolLM2-135M: qkv, o_proj, gate_up, down (3.2 / 3.2 / 3.9 / 4.7 us; cuBLAS 3.6-3.7 /
    # 3.6 / 4.1 / 5.0-5.1)
    (960, 576): _config(576, 16, 128, 1, 4, 5),
    (576, 576): _config(576, 16, 128, 1, 4, 5),
    (3072, 576): _config(576, 32, 64, 1, 4, 5),
    (576, 1536): _config(1536, 16, 128, 1, 4, 5),
    # Llama-3-8B (15.7-15.8 / 12.0 / 56.6-57.0 / 30.9-31.4 us; cuBLAS 15.4-16.1 / 13.1-13.2 /
    # 56.5-56.8 / 31.9-32.2)
    (6144, 4096): _config(4096, 32, 128, 1, 4, 5),
    (4096, 4096): _config(4096, 32, 128, 2, 4, 5),
    (28672, 4096): _config(4096, 32, 128, 1, 4, 3),
    (4096, 14336): _config(14336, 32, 128, 3, 4, 4),
}


def tuned(n: int, k: int) -> bool:
    """Whether weight shape [N, K] has measured tiles (`_TUNED`)."""
    return (n, k) in _TUNED


def linear_config(n: int, k: int) -> LinearConfig:
    """The measured tiles of a `_TUNED` shape. Otherwise a rule: small-M calls are
    weight-bandwidth-bound, so spread the weight over enough programs to keep every SM
    streaming: 64-wide N tiles, 32-wide when N is small, and a K split when there are still too
    few tiles and K is long enough for each split to stay efficient (at least 8 K iterations, so
    the pipeline reaches its steady state). num_stages 4 keeps 3 weight tiles in flight per
    program; with 4 warps and at most 20 KB a stage, two or more programs fit on an SM. The
    sweep found the rule within a few per cent of the best tiles except for wide N (Llama's
    gate_up: 66.7 us against 56.6) and the smallest weights (SmolLM2: 10-25 % behind)."""
    if (n, k) in _TUNED:
        return _TUNED[(n, k)]
    block_k = next((b for b in (128, 64, 32) if k % b == 0), 64)
    block_n = 64 if triton.cdiv(n, 64) >= _TARGET_PROGRAMS // 2 else 32
    tiles_n = triton.cdiv(n, block_n)
    k_iters = triton.cdiv(k, block_k)
    split = 1
    if tiles_n < _TARGET_PROGRAMS and k >= 2048:
        split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles_n), k_iters // 8))
    return _config(k, block_n, block_k, split)
