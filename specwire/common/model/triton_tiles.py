"""Tile configs of our GEMMs.

- `LinearConfig` (`triton_ops.linear` and the GEMMs with epilogues, the batch-invariant GEMM):
  one config per weight shape (N, K), never per M, which is what keeps a row's bits
  independent of its batch.
- `WideConfig` (`triton_ops.linear_wide`, non-exact steps wider than BLOCK_M rows): a config
  per weight shape and row range, measured against cuBLAS, which those steps run otherwise.

Plain Python (no Triton import), so the tables are checked on any machine
(`tests/test_gemm_tiles.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    iters = _cdiv(k, bk)
    per_split = _cdiv(iters, split)
    return LinearConfig(bn, bk, _cdiv(iters, per_split), per_split * bk, warps, stages)


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
    block_n = 64 if _cdiv(n, 64) >= _TARGET_PROGRAMS // 2 else 32
    tiles_n = _cdiv(n, block_n)
    k_iters = _cdiv(k, block_k)
    split = 1
    if tiles_n < _TARGET_PROGRAMS and k >= 2048:
        split = max(1, min(_cdiv(_TARGET_PROGRAMS, tiles_n), k_iters // 8))
    return _config(k, block_n, block_k, split)


@dataclass(frozen=True)
class WideConfig:
    """Tiles of a non-exact GEMM over more than BLOCK_M rows: a function of (N, K) and the
    row range (bits may depend on M here, as under cuBLAS)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3

    def fits(self) -> bool:
        """Whether the tiles stay within what they were measured within: the pipeline's
        shared memory (SMEM_BYTES) and an fp32 accumulator of at most 128 registers a thread;
        32-row tiles on 4 warps only, at most 128 columns."""
        smem = (self.block_m + self.block_n) * self.block_k * 2 * self.num_stages
        regs = self.block_m * self.block_n // (32 * self.num_warps)
        narrow_ok = self.block_m != 32 or (self.num_warps == 4 and self.block_n <= 128)
        return smem <= SMEM_BYTES and regs <= 128 and narrow_ok


SMEM_BYTES = 200 * 1024  # of the H200's 227 KiB a block may use: what the sweeps allowed


def wide_tiles(k: int, bm: int, bn: int, bk: int, split: int, warps: int, stages: int):
    """A `WideConfig` for a K of `k`: `split` ranges of whole K tiles (fewer when one would be
    empty), as `_config` splits them."""
    c = _config(k, bn, bk, split, warps, stages)
    return WideConfig(bm, bn, bk, c.split_k, c.k_per_split, warps, stages)


# Per weight shape: (largest M, tiles) by increasing M, where our GEMM beat cuBLAS by 3 % or
# more on the H200 (`python3 bench/gemm_sweep.py --wide [--exact-order]`, bench/RESULTS.md round
# 18; µs ours / cuBLAS at the M measured). A shape or an M past its last range keeps cuBLAS,
# which won every projection measured above 64 rows but Llama-3-8B's o_proj at 96.
_WIDE: dict[tuple[int, int], tuple[tuple[int, WideConfig], ...]] = {
    # Llama-3-8B o_proj (M=24: 11.4 / 13.4, 32: 11.6 / 13.6, 48: 11.7 / 14.0; 64: level)
    (4096, 4096): ((48, wide_tiles(4096, 64, 64, 128, 2, 4, 4)),),
    # Llama-3-8B down (M=24: 31.8 / 33.1, 32: 31.7 / 33.5, 48: 32.4 / 33.8, 64: 32.9 / 35.3)
    (4096, 14336): ((64, wide_tiles(14336, 64, 128, 128, 3, 4, 4)),),
    # Llama-3-8B LM head (M=24: 240 / 254, 48: 251 / 258)
    (128256, 4096): ((32, wide_tiles(4096, 32, 128, 128, 1, 4, 3)),),
    # SmolLM2-135M down (M=32: 4.3 / 5.1, 64: 4.5 / 5.1), LM head (M=24: 16.2 / 17.0, 48: 17.1
    # / 18.3)
    (576, 1536): ((64, wide_tiles(1536, 64, 64, 64, 4, 8, 4)),),
    (49152, 576): (
        (32, wide_tiles(576, 32, 128, 64, 1, 4, 3)),
        (64, wide_tiles(576, 64, 128, 64, 1, 8, 3)),
    ),
}

# The exact mode's row tile, N tile, warps and stages per weight shape and row range (largest
# M by increasing M), over its own K order: the fastest measured by `gemm_sweep.py --wide
# --exact-order` at M = 24 / 48 / 96 / 160 / 256 / 512, each range reaching halfway to the next.
# A fifth entry is a narrower K tile over the same K splits (`--free-bk`; see
# `exact_wide_config`). Shapes not listed take `exact_wide_config`'s rule.
_T = tuple[int, ...]  # (block_m, block_n, num_warps, num_stages[, block_k])
_RANGES = (32, 64, 128, 192, 384, 1 << 30)


def _ranges(*tiles: _T) -> tuple[tuple[int, _T], ...]:
    return tuple(zip(_RANGES, tiles, strict=True))


_EXACT_WIDE: dict[tuple[int, int], tuple[tuple[int, _T], ...]] = {
    # Llama-3-8B: qkv, o_proj, gate_up, down, LM head; at M=160: 27.6 / 18.6 / 101.6 / 53.8 /
    # 523 µs against 77.9 / 45.4 / 219.0 / 113.3 / 911 on 64-row mma.sync tiles (round 21's
    # 64-wide K tiles took the first four from 29.9 / 21.4 / 112.1 / 68.0)
    (6144, 4096): _ranges(
        (64, 64, 4, 4),
        (64, 64, 4, 4),
        (64, 128, 8, 4),
        (128, 128, 8, 5, 64),
        (128, 128, 8, 5, 64),
        (128, 64, 8, 4),
    ),  # fmt: skip
    (4096, 4096): _ranges(
        (64, 64, 8, 4),
        (64, 64, 4, 4),
        (64, 128, 4, 4),
        (64, 256, 8, 5, 64),
        (64, 256, 8, 5, 64),
        (128, 128, 4, 3),
    ),  # fmt: skip
    (28672, 4096): _ranges(
        (32, 128, 4, 3),
        (64, 128, 4, 4),
        (128, 128, 8, 3, 64),
        (64, 128, 4, 3, 64),
        (128, 128, 8, 3, 64),
        (128, 128, 8, 3),
    ),  # fmt: skip
    (4096, 14336): _ranges(
        (64, 128, 4, 4),
        (64, 128, 4, 4),
        (128, 128, 4, 5, 64),
        (128, 256, 8, 4, 64),
        (128, 256, 8, 4, 64),
        (128, 128, 4, 3),
    ),  # fmt: skip
    (128256, 4096): _ranges(
        (32, 128, 4, 3),
        (64, 128, 8, 4),
        (128, 128, 8, 3),
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (128, 128, 8, 3),
    ),  # fmt: skip
    # SmolLM2-135M: qkv and o_proj (3.9 against 5.1-5.5 µs), gate_up, down, LM head
    (960, 576): _ranges(*[(64, 64, 4, 4)] * 6),
    (576, 576): _ranges(*[(64, 64, 4, 4)] * 6),
    (3072, 576): _ranges(
        (64, 64, 8, 4),
        (64, 64, 8, 4),
        (64, 64, 8, 4),
        (128, 64, 8, 4),
        (128, 64, 8, 4),
        (128, 128, 8, 4),
    ),  # fmt: skip
    (576, 1536): _ranges(*[(64, 64, 4, 4)] * 6),
    (49152, 576): _ranges(
        (32, 128, 4, 3),
        (64, 128, 8, 3),
        (128, 64, 8, 3),
        (64, 128, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 3),
    ),  # fmt: skip
    # Round 21, the shapes between the reference models (bench/results/round21/, one sweep a
    # model); µs at M=160 measured tiles / before (default tiles) / cuBLAS.
    # SmolLM2-360M: qkv 5.7 / 7.4 / 5.1, o_proj 5.6 / 7.0 / 4.7, gate_up 6.9 / 10.8 / 6.9,
    # down 6.8 / 11.1 / 6.9, LM head 44.6 / 61.0 / 32.0
    (1600, 960): _ranges((64, 64, 4, 4), *[(64, 64, 8, 4)] * 4, (128, 64, 8, 4)),
    (960, 960): _ranges(*[(64, 64, 8, 4)] * 6),
    (5120, 960): _ranges(
        (64, 64, 4, 4),
        (64, 64, 8, 4),
        (128, 64, 8, 4),
        (64, 128, 8, 4),
        (128, 128, 8, 4),
        (64, 128, 4, 3),
    ),  # fmt: skip
    (960, 2560): _ranges(*[(64, 64, 4, 4)] * 5, (64, 128, 4, 4)),
    (49152, 960): _ranges(
        (32, 128, 4, 3),
        (64, 128, 8, 3),
        (128, 64, 8, 3),
        (64, 128, 4, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 3),
    ),  # fmt: skip
    # Qwen2.5-1.5B (swept without its qkv bias): qkv 6.5 / 11.5 / 5.7, o_proj 6.3 / 11.3 /
    # 5.7, gate_up 34.3 / 61.1 / 20.4, down 19.9 / 36.1 / 14.6, LM head 261.8 / 473.3 / 140.6;
    # round 21's 64-wide K tiles (--free-bk): gate_up 32.2 -> 26.6, down 19.4 -> 17.3, LM head
    # 250 -> 201
    (2048, 1536): _ranges(*[(64, 64, 4, 4)] * 5, (128, 64, 8, 4)),
    (1536, 1536): _ranges(*[(64, 64, 4, 4)] * 5, (64, 64, 4, 3)),
    (17920, 1536): _ranges(
        (32, 64, 4, 3),
        (64, 64, 4, 4, 64),
        (64, 128, 4, 3, 64),
        (64, 128, 4, 4, 64),
        (64, 128, 8, 3, 64),
        (128, 128, 8, 3),
    ),  # fmt: skip
    (1536, 8960): _ranges(
        (64, 128, 4, 4),
        (64, 128, 4, 4),
        (64, 256, 8, 5, 64),
        (64, 128, 4, 4, 64),
        (64, 128, 4, 3, 64),
        (64, 128, 4, 4),
    ),  # fmt: skip
    (151936, 1536): _ranges(
        (32, 128, 4, 3),
        (64, 128, 8, 3, 64),
        (128, 128, 8, 3, 64),
        (128, 128, 8, 3, 64),
        (128, 128, 8, 3, 64),
        (128, 128, 8, 3),
    ),  # fmt: skip
    # Llama-3.2-1B: qkv 12.5 / 19.5 / 7.2, o_proj 8.4 / 11.9 / 6.5, gate_up 49.4 / 77.2 /
    # 22.0, down 21.6 / 40.7 / 16.3, LM head 279.1 / 502.5 / 154.6; round 21's 64-wide K tiles:
    # qkv 12.8 -> 11.2, gate_up 48.6 -> 39.4, down 21.1 -> 18.9, LM head 265 -> 234
    (3072, 2048): _ranges(
        (64, 64, 4, 4),
        (64, 64, 4, 4),
        (64, 128, 4, 4),
        (64, 256, 8, 4, 64),
        (64, 64, 4, 4, 64),
        (64, 128, 4, 4),
    ),  # fmt: skip
    (2048, 2048): _ranges(*[(64, 64, 4, 4)] * 3, *[(64, 128, 4, 4)] * 2, (128, 128, 4, 3)),
    (16384, 2048): _ranges(
        (32, 128, 4, 3),
        (64, 64, 8, 3),
        (128, 128, 4, 3, 64),
        (128, 256, 8, 4, 64),
        (128, 256, 8, 4, 64),
        (128, 128, 4, 3),
    ),  # fmt: skip
    (2048, 8192): _ranges(
        (64, 128, 4, 4),
        (64, 128, 4, 4),
        (64, 64, 4, 4, 64),
        (64, 128, 4, 4, 64),
        (128, 256, 8, 4, 64),
        (64, 128, 4, 4),
    ),  # fmt: skip
    (128256, 2048): _ranges(
        (32, 128, 4, 3),
        (64, 128, 4, 4),
        (128, 128, 4, 3, 64),
        (64, 128, 8, 3, 64),
        (128, 128, 8, 3, 64),
        (128, 128, 8, 3),
    ),  # fmt: skip
}


# Weight shapes of the models whose whole verify step the exact mode was measured to slow by
# at most 10 % on the H200 at every step measured (`verify_step.py [--exact]`, ctx 1024, q = 1
# and 5), with its wide steps on cuBLAS where cuBLAS gives its bits (`TritonOps._cublas_exact`,
# round 22): SmolLM2-135M (B = 1, 8, 32: <= 1.04), SmolLM2-360M (B = 1 to 64: 0.83-1.01,
# round 23), Qwen2.5-1.5B with its qkv bias (B = 1, 8, 32, 64: 0.88-1.04). Not cheap:
# Llama-3.2-1B (1.18 at B=32 q=5, 1.21 at B=64 q=5: its K-split shapes stay on our tiles,
# where cuBLAS is faster) and Llama-3-8B (<= 1.07 up to B=32, but 1.14 at B=64 q=5, for the
# same reason).
_EXACT_CHEAP = frozenset(
    {
        *((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)),  # SmolLM2-135M
        *((1600, 960), (960, 960), (5120, 960), (960, 2560), (49152, 960)),  # SmolLM2-360M
        *((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)),  # Qwen2.5-1.5B
    }
)


def exact_measured_cheap(shapes: list[tuple[int, int]]) -> bool:
    """Whether every weight shape (N, K) of a model is one of a model the exact mode was
    measured cheap on (`_EXACT_CHEAP`); those all have measured wide tiles (`_EXACT_WIDE`)."""
    return bool(shapes) and all(s in _EXACT_CHEAP for s in shapes)


# The exact mode's steps wider than this many rows may run a GEMM on cuBLAS, where cuBLAS gives
# the exact GEMM's bits (`TritonOps._cublas_exact`). Measured on the H200 (bench/RESULTS.md,
# round 22): at 32 and 40 rows the measured exact tiles are 1-3 % faster than cuBLAS in the
# whole step (Llama-3-8B B=8 q=5 5.59 against 5.69 ms, SmolLM2 1.06 against 1.09), at 160 rows
# cuBLAS is far faster (Llama-3-8B B=32 q=5 8.34 against 9.83).
EXACT_CUBLAS_ROWS = 64

# ...except for the weight shapes listed here, whose exact steps were measured faster with
# cuBLAS above this many rows (round 23, `verify_step.py --exact`): SmolLM2-360M's, at
# 32-64 rows (B=8 q=5 1.36 against 1.44 ms, B=32 q=1 1.76 / 1.84, B=64 q=1 2.95 / 3.05). Timing
# each GEMM alone at warm-up, even framed by our kernels, did not predict the whole step (round
# 23: it lost as much as it won), so this stays a measured table.
_EXACT_CUBLAS_ABOVE: dict[tuple[int, int], int] = {
    shape: BLOCK_M for shape in ((1600, 960), (960, 960), (5120, 960), (960, 2560), (49152, 960))
}


def exact_cublas_rows(n: int, k: int) -> int:
    """Steps of more than this many rows may run the exact GEMM of weight [N, K] on cuBLAS
    (where it gives the same bits)."""
    return _EXACT_CUBLAS_ABOVE.get((n, k), EXACT_CUBLAS_ROWS)


def wide_config(n: int, k: int, m: int) -> WideConfig | None:
    """The measured tiles for an M-row GEMM on weight [N, K] (M > BLOCK_M), or None: cuBLAS."""
    for max_m, cfg in _WIDE.get((n, k), ()):
        if m <= max_m:
            return cfg
    return None


def exact_wide_config(n: int, k: int, m: int) -> WideConfig:
    """Tiles of the exact mode's GEMM over M > BLOCK_M rows: `linear_config(n, k)`'s K tile
    and split (the K order, hence every row's bits) on a larger row tile, which reads the
    weight from L2 fewer times. wgmma and the 16-row mma.sync chain give the same bits here
    (GPU test `test_gpu_block_m_keeps_bits`; `gemm_sweep.py --wide --exact-order` checked every
    candidate bit for bit at six row counts on both reference models). Measured tiles for the
    reference shapes (`_EXACT_WIDE`); otherwise 64x64 tiles, or 128x128 ones when M > 64 and N
    is wide enough to keep the SMs busy with them.

    The K tile itself is free, as long as it divides the exact one and the splits stay: a tile
    of K accumulates as a chain of 16-wide MMAs into the one fp32 accumulator (`_dot`), so two
    64-wide tiles issue the same chain as one 128-wide tile. Measured: every one of 83 configs
    on K tiles of 32, 64 and 128 gave the exact GEMM's bits on Llama-3-8B's four projections at
    48-256 rows (bench/RESULTS.md, round 21), and `test_gpu_block_m_keeps_bits` checks the
    tables' choices."""
    c = linear_config(n, k)
    tiles = next((t for max_m, t in _EXACT_WIDE.get((n, k), ()) if m <= max_m), None)
    if tiles is None:
        tiles = (128, 128, 8, 3) if m > 64 and n >= 4096 else (64, 64, 4, 4)
    bm, bn, warps, stages, *narrower = tiles
    bk = narrower[0] if narrower else c.block_k
    return WideConfig(bm, bn, bk, c.split_k, c.k_per_split, warps, stages)
