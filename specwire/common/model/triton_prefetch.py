"""Weights into L2 ahead of their GEMM: the HBM is idle while a step's small kernels run.

A decode or verify step of a large model streams every weight once. Its GEMMs are
bandwidth-bound, but each one starts with an empty memory pipeline and ends with a tail wave,
and between them the norms, RoPE and attention read almost nothing: the HBM idles for a few
microseconds around every GEMM. Here, right after a GEMM is launched, one small kernel asks the
L2 to fetch the start of the *next* GEMM's weight (`cp.async.bulk.prefetch.L2`: fire and
forget, no registers, no shared memory) — the rows and leading K columns that the next GEMM's
first wave of programs reads first. That kernel is placed when the GEMM before releases its
dependents (after its K loop: its tail), so the loads fill the tail and the small kernels
after it, and the next GEMM finds its first tiles in L2.

Nothing computed changes: the GEMMs run the same instructions on the same values. The plan is
static (weights do not move), so the address tables are built once, before any graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwire.common.model.triton_base import _grid_release, _grid_wait, launch_opts
from specwire.common.model.triton_tiles import linear_config

# Programs that stream at once in a GEMM's first wave: 2 per SM on the H200's 132 SMs.
FIRST_WAVE = 264
_BLOCK = 128  # addresses per program of the prefetch kernel (one per thread, 4 warps)


@triton.jit
def _prefetch_kernel(addr_ptr, n, nbytes, BLOCK: tl.constexpr):
    """Each thread asks the L2 for `nbytes` from one address of the table, then the kernel
    passes PDL's baton on: release first (the next kernel may be placed), then wait for the
    kernel before, so that this kernel's completion still implies that one's."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    addr = tl.load(addr_ptr + offs, mask=offs < n, other=0)
    size = tl.full((BLOCK,), 0, tl.int32) + nbytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s64 p, $1, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    _grid_release()
    _grid_wait()


def _first_wave_rows(n: int, k: int) -> tuple[list[tuple[int, int]], int]:
    """(row, first K column) of every weight row the first wave of `linear`'s programs reads
    first (grid order: N tiles, then K splits), and the K columns each program has."""
    cfg = linear_config(n, k)
    tiles_n = triton.cdiv(n, cfg.block_n)
    starts: list[tuple[int, int]] = []
    for pid in range(min(FIRST_WAVE, tiles_n * cfg.split_k)):
        tile, split = pid % tiles_n, pid // tiles_n
        rows = range(tile * cfg.block_n, min(n, (tile + 1) * cfg.block_n))
        starts += [(r, split * cfg.k_per_split) for r in rows]
    return starts, cfg.k_per_split


class PrefetchTable:
    """The L2 prefetch of one weight [N, K] (unit last stride): a chunk of `nbytes` from the
    start of each row range its GEMM's first wave reads first, `budget` bytes at most."""

    def __init__(self, weight: torch.Tensor, budget: int):
        n, k = weight.shape
        starts, per_split = _first_wave_rows(n, k)
        elem = weight.element_size()
        # Whole 128-byte lines per row, as many as the budget spreads over the rows.
        cols = min(per_split, budget // max(1, len(starts) * elem)) // 64 * 64
        self.nbytes = cols * elem
        base, stride = weight.data_ptr(), weight.stride(0) * elem
        addrs = [base + r * stride + c * elem for r, c in starts] if cols else []
        self.addrs = torch.tensor(addrs, dtype=torch.int64, device=weight.device)

    def launch(self) -> None:
        n = self.addrs.numel()
        if n:
            _prefetch_kernel[(triton.cdiv(n, _BLOCK),)](
                self.addrs, n, self.nbytes, BLOCK=_BLOCK, num_warps=4, **launch_opts()
            )


class PrefetchPlan:
    """Which weight's start to fetch after each GEMM: the model's GEMM weights in launch order
    (layer by layer: qkv, o, gate_up, down); after the last, nothing."""

    def __init__(self, weights: list[torch.Tensor], budget_bytes: int):
        self._next: dict[int, PrefetchTable] = {}
        for w, nxt in zip(weights, weights[1:]):
            if nxt.is_cuda and nxt.stride(-1) == 1:
                self._next[w.data_ptr()] = PrefetchTable(nxt, budget_bytes)

    def after(self, weight: torch.Tensor) -> None:
        """Launch the prefetch of the weight after `weight` (just launched), if any."""
        table = self._next.get(weight.data_ptr())
        if table is not None:
            table.launch()
