"""An experiment for issue 8: the exact mode's wide GEMM with TMA loads (Hopper's tensor memory
accelerator) instead of pointer loads, in the exact GEMM's K order, timed and checked bit for
bit against the exact mode's current wide tiles (`triton_ops.linear_wide` on
`triton_tiles.exact_wide_config`) and cuBLAS.

Each candidate keeps the exact GEMM's K order: its K tile and split (`linear_config(N, K)`), K
tiles accumulated in order into one fp32 accumulator per split, the splits summed in order by
`_split_sum_kernel`. Only the row/column tiles, warps and stages vary, as in `gemm_sweep.py
--wide --exact-order`. A candidate counts only if its output equals the exact GEMM's.

    python3 bench/gemm_tma.py [--models llama3-8b,smollm2-360m] [--ms 24,160] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_sweep import MODELS, gemm_shapes  # noqa: E402
from layer_ops import ROTATE_BYTES, graph_us  # noqa: E402

from specwire.common.model import triton_ops  # noqa: E402
from specwire.common.model.triton_tiles import exact_wide_config, linear_config  # noqa: E402


@triton.jit(do_not_specialize=["M"])
def _tma_linear_kernel(
    x_desc, w_desc, out_ptr, M, N, K, out_stride, out_split_stride, K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = tl.dot(a, b.T, acc)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + pid_k * out_split_stride + rm[:, None] * out_stride + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def tma_linear(x, w, out_dtype, bm, bn, warps, stages, warp_spec=False):
    """x @ w.T in the exact GEMM's K order (`linear_config`), on TMA loads."""
    (m, k), n = x.shape, w.shape[0]
    c = linear_config(n, k)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    target = out if c.split_k == 1 else torch.empty((c.split_k, m, n), dtype=torch.float32,
                                                    device=x.device)  # fmt: skip
    x_desc = TensorDescriptor.from_tensor(x, [bm, c.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [bn, c.block_k])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), c.split_k)
    _tma_linear_kernel[grid](
        x_desc, w_desc, target, m, n, k, n, m * n, c.k_per_split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=c.block_k, NUM_STAGES=stages, WARP_SPEC=warp_spec,
        num_warps=warps,
    )  # fmt: skip
    if c.split_k > 1:
        total, block = m * n, 1024
        triton_ops._split_sum_kernel[(triton.cdiv(total, block),)](
            target, target, out, total, n, m * n, SPLIT=c.split_k, HAS_BIAS=False, BLOCK=block,
            **triton_ops.launch_opts(),
        )  # fmt: skip
    return out


def _alloc(size: int, alignment: int, stream):  # device-side descriptors' scratch, if any
    return torch.empty(size, dtype=torch.int8, device="cuda")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3-8b,smollm2-360m")
    ap.add_argument("--ms", default="24,160")
    ap.add_argument("--ops", default="qkv,o_proj,gate_up,down,lm_head")
    ap.add_argument("--warp-spec", default="off", help="off | on | off,on")
    ap.add_argument("--out")
    args = ap.parse_args()
    triton.set_allocator(_alloc)
    ms = [int(v) for v in args.ms.split(",")]
    specs = [v == "on" for v in args.warp_spec.split(",")]
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    lines = [
        "| model | op | M | cuBLAS us | exact now us | best TMA us | TMA config | bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    results = []
    t0 = time.time()
    for model in args.models.split(","):
        for op, (n, k) in gemm_shapes(MODELS[model]).items():
            if op not in args.ops.split(","):
                continue
            copies = max(1, min(16, ROTATE_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
                  for _ in range(copies)]  # fmt: skip
            out_dtype = torch.float32 if op == "lm_head" else None
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                cfg = exact_wide_config(n, k, m)
                ref = triton_ops.linear_wide(x, ws[0], None, out_dtype, cfg)
                cublas = graph_us([partial(F.linear, x, w) for w in ws])
                now = graph_us([partial(triton_ops.linear_wide, x, w, None, out_dtype, cfg)
                                for w in ws])  # fmt: skip
                times, equal = {}, {}
                for bm, bn, warps, stages, spec in itertools.product(
                    (64, 128), (128, 256), (4, 8), (3, 4), specs
                ):
                    name = f"bm{bm} bn{bn} w{warps} st{stages}" + (" ws" if spec else "")
                    c = linear_config(n, k)
                    if (bm + bn) * c.block_k * 2 * stages > 220 * 1024 or bm * bn // (
                        32 * warps
                    ) > 128:
                        continue
                    try:
                        got = tma_linear(x, ws[0], out_dtype, bm, bn, warps, stages, spec)
                        equal[name] = bool(torch.equal(got, ref))
                        a = (out_dtype, bm, bn, warps, stages, spec)
                        times[name] = graph_us([partial(tma_linear, x, w, *a) for w in ws])
                        print(f"  {name}: {times[name]:.1f} us, bitwise {equal[name]}", flush=True)
                    except Exception as exc:  # a config that does not compile: skip it
                        print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                ok = {c: t for c, t in times.items() if equal[c]}
                best = min(ok, key=ok.get) if ok else None
                nbit = sum(equal.values())
                line = (
                    f"| {model} | {op} | {m} | {cublas:.1f} | {now:.1f} | "
                    f"{ok[best]:.1f} | {best} | {nbit}/{len(equal)} |"
                    if best
                    else f"| {model} | {op} | {m} | {cublas:.1f} | {now:.1f} | - | - | "
                    f"{nbit}/{len(equal)} |"
                )
                print(line, flush=True)
                lines.append(line)
                results.append(dict(model=model, op=op, n=n, k=k, m=m, cublas_us=cublas,
                                    exact_now_us=now, times=times, bitwise=equal))  # fmt: skip
            del ws
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_tma.md").write_text("\n".join(lines) + "\n")
        (out / "gemm_tma.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
