"""Does cuBLAS give our exact GEMM's bits? For weight shapes of the reference models, `F.linear`
(cuBLAS) at 1 to 300 rows against the exact Triton GEMM without a K split, row for row, and
cuBLAS against itself across row counts (batch invariance). GPU only (Triton).

    python3 bench/cublas_bits.py            # one line a shape: rows equal to ours, rows not

Round 22 (bench/RESULTS.md): equal at every row count wherever cuBLAS does not split K.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specwire.common.model import triton_ops as ops  # noqa: E402
from specwire.common.model import triton_tiles as tt  # noqa: E402

SHAPES = {
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o_proj": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    "llama3-8b lm_head": (128256, 4096),
    "smollm2 qkv": (960, 576),
    "smollm2 down": (576, 1536),
    "qwen2.5-1.5b gate_up": (17920, 1536),
}
ROWS = [1, 2, 5, 8, 16, 17, 32, 40, 64, 100, 160, 256, 300]


def main() -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
        x = torch.randn(300, k, device="cuda").to(torch.bfloat16)
        one_split = tt._config(k, 32, 128 if k % 128 == 0 else 64, 1)
        ours = ops.linear(x, w, config=one_split)  # the exact GEMM's K order, no K split
        full = F.linear(x, w)
        invariant = all(torch.equal(F.linear(x[:m], w), full[:m]) for m in ROWS)
        equal = [m for m in ROWS if torch.equal(F.linear(x[:m], w), ours[:m])]
        differ = [m for m in ROWS if m not in equal]
        print(f"{name} ({n}, {k}): cuBLAS batch-invariant {invariant}; "
              f"equal to ours at M = {equal}; differs at M = {differ}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
