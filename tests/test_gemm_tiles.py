"""The GEMM tile tables (`triton_tiles`): plain Python, so they are checked without a GPU.

What must hold for every shape and row count the target can ask for: the exact mode's wide
tiles keep the exact GEMM's K order (its K tile and split, hence every row's bits: the GPU test
`test_gpu_block_m_keeps_bits` checks the bits themselves), every config fits the shared memory
and registers it was measured within, and the row ranges are ordered so that a lookup takes
the tiles measured for that range.
"""

from __future__ import annotations

import pytest

from specwire.common.model import triton_tiles as tiles

SHAPES = sorted(set(tiles._EXACT_WIDE) | set(tiles._WIDE) | set(tiles._TUNED))
OTHER_SHAPES = [(72, 200), (2560, 2560), (14336, 5120), (151936, 896)]  # rule-only shapes
ROW_COUNTS = [17, 24, 32, 33, 40, 64, 65, 96, 128, 129, 160, 192, 193, 256, 384, 385, 1024, 4096]


def _covers_k(cfg, k: int) -> None:
    assert cfg.k_per_split % cfg.block_k == 0
    # every K element in some split, and no split empty
    assert cfg.split_k * cfg.k_per_split >= k > (cfg.split_k - 1) * cfg.k_per_split


@pytest.mark.parametrize("n,k", SHAPES + OTHER_SHAPES)
def test_exact_wide_tiles_keep_the_exact_k_order(n, k):
    exact = tiles.linear_config(n, k)
    for m in ROW_COUNTS:
        cfg = tiles.exact_wide_config(n, k, m)
        # the same K splits; a K tile that divides the exact one (the same chain of MMAs)
        assert (cfg.split_k, cfg.k_per_split) == (exact.split_k, exact.k_per_split), (m, cfg)
        assert exact.block_k % cfg.block_k == 0 and cfg.block_k >= 16, (m, cfg)
        _covers_k(cfg, k)
        assert cfg.block_m in (32, 64, 128) and cfg.num_warps in (4, 8)
        assert cfg.fits(), (m, cfg)  # shared memory and registers


@pytest.mark.parametrize("n,k", SHAPES + OTHER_SHAPES)
def test_wide_tiles_cover_k_and_fit(n, k):
    for m in ROW_COUNTS:
        cfg = tiles.wide_config(n, k, m)
        if cfg is None:  # cuBLAS
            assert (n, k) not in tiles._WIDE or m > tiles._WIDE[(n, k)][-1][0]
            continue
        _covers_k(cfg, k)
        assert cfg.fits(), (m, cfg)


def test_rule_only_shapes_are_not_in_the_tables():
    for shape in OTHER_SHAPES:
        assert shape not in tiles._EXACT_WIDE and shape not in tiles._WIDE, shape


def test_shapes_measured_cheap_have_measured_exact_tiles():
    """`--exact auto`'s shapes (`exact_measured_cheap`) all run measured wide tiles; measured
    tiles alone are not enough (Llama-3.2-1B's shapes have them and stay out: +21 %)."""
    assert tiles._EXACT_CHEAP and tiles._EXACT_CHEAP <= set(tiles._EXACT_WIDE)
    assert tiles.exact_measured_cheap(sorted(tiles._EXACT_CHEAP))
    llama3_2_1b = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]
    assert all(s in tiles._EXACT_WIDE for s in llama3_2_1b)
    assert not tiles.exact_measured_cheap(llama3_2_1b)
    assert not tiles.exact_measured_cheap([])


def test_row_ranges_increase_and_lookups_take_their_range():
    for table in (tiles._WIDE, tiles._EXACT_WIDE):
        for shape, ranges in table.items():
            limits = [max_m for max_m, _ in ranges]
            assert limits == sorted(set(limits)) and limits[0] > tiles.BLOCK_M, shape
    # the first range's tiles at its limit, the next range's one row past it
    n, k = (4096, 4096)
    (first, first_tiles), (_, second_tiles) = tiles._EXACT_WIDE[(n, k)][:2]
    assert tiles.exact_wide_config(n, k, first).block_n == first_tiles[1]
    assert tiles.exact_wide_config(n, k, first + 1).block_n == second_tiles[1]
    assert tiles.exact_wide_config(n, k, first + 1).num_warps == second_tiles[2]


def test_fits_rejects_tiles_past_the_shared_memory_or_registers():
    ok = tiles.wide_tiles(4096, 128, 128, 128, 1, 8, 3)  # 192 KiB, 64 registers
    assert ok.fits()
    assert not tiles.wide_tiles(4096, 128, 128, 128, 1, 8, 4).fits()  # 256 KiB of stages
    assert not tiles.wide_tiles(4096, 128, 256, 64, 1, 4, 3).fits()  # 256 accumulator registers
    assert not tiles.wide_tiles(4096, 32, 64, 64, 1, 8, 3).fits()  # 32 rows on 8 warps


def test_tuned_tiles_cover_k():
    for (n, k), cfg in tiles._TUNED.items():
        _covers_k(cfg, k)
        assert tiles.linear_config(n, k) == cfg and tiles.tuned(n, k)
    assert not tiles.tuned(72, 200)


def test_exact_cublas_rows_only_for_wide_steps_of_measured_shapes():
    """cuBLAS may take an exact GEMM only in steps wider than BLOCK_M rows (narrower steps keep
    the 16-row exact GEMM that defines the bits), from 64 rows on unless a shape was measured
    otherwise, and only shapes with measured exact tiles were."""
    assert tiles.exact_cublas_rows(4096, 14336) == tiles.EXACT_CUBLAS_ROWS == 64
    for shape, rows in tiles._EXACT_CUBLAS_ABOVE.items():
        assert rows >= tiles.BLOCK_M and shape in tiles._EXACT_WIDE
        assert tiles.exact_cublas_rows(*shape) == rows
