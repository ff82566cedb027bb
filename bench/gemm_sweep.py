"""Tile configs of our Triton GEMMs at decode/verify row counts, against cuBLAS (issue 8).

    python3 bench/gemm_sweep.py [--models smollm2,llama3-8b] [--ms 1,5] [--ops ...] [--out DIR]

For every projection of SmolLM2-135M and Llama-3-8B (and each LM head), and for the fused
prologue kernels (`triton_fused.add_norm_linear` on qkv / gate_up, `silu_linear` on down),
times a grid of `LinearConfig`s (N tile, K tile, K split, warps, stages) inside CUDA graphs, the
weights rotating through enough copies that they stream from HBM as in a real step (see
`layer_ops.graph_us`). Beside each: cuBLAS (`F.linear`; for the fused kernels, our norm or
SiLU·up kernel then cuBLAS, what the unfused layer runs), our current `linear_config`, and the
weight-streaming floor at 4.8 TB/s.

It answers one question per shape: is there one config (a function of N and K only, as the
exact mode needs) that beats cuBLAS at every M swept, and by how much? Prints a table per
shape, the best config over all M, and writes gemm_sweep.{md,json} to --out.

`--wide` (with e.g. `--ms 32,64,160,256`) sweeps `triton_ops.linear_wide` instead: tiles of
32-128 rows whose choice may depend on M (non-exact steps wider than 16 rows, which run cuBLAS
unless `triton_tiles._WIDE` has tiles for them), beside cuBLAS and the current choice. Each
row also names the fastest config that keeps the exact GEMM's K order (its K tile and split)
and whether its output equals the exact mode's `linear` bit for bit (if so, the exact mode
could take it too). Writes gemm_sweep_wide.{md,json}. `--wide --exact-order` sweeps only
configs in the exact GEMM's K order and checks every one of them bit for bit against the
exact `linear` (gemm_sweep_exact_order.{md,json}): the exact mode's wide tiles
(`triton_tiles._EXACT_WIDE`).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_ops import EPS, HBM_BYTES_PER_US, ROTATE_BYTES, graph_us  # noqa: E402
from layer_ops import MODELS as LAYER_MODELS  # noqa: E402

from specwire.common.model.config import (  # noqa: E402
    LLAMA3_2_1B,
    QWEN2_5_1_5B,
    SMOLLM2_360M,
    ModelConfig,
)


def _dims(cfg: ModelConfig) -> dict:
    """A model config in `layer_ops.MODELS`' terms."""
    return dict(
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        inter=cfg.intermediate_size,
        vocab=cfg.vocab_size,
    )


# The reference models, and the shapes between them that verify_step.py measured the exact
# mode on (round 20: no measured tiles yet), for sweeping their tiles (`--models`).
MODELS = {
    **LAYER_MODELS,
    "smollm2-360m": _dims(SMOLLM2_360M),
    "qwen2.5-1.5b": _dims(QWEN2_5_1_5B),
    "llama3.2-1b": _dims(LLAMA3_2_1B),
}

from specwire.common.model import triton_fused as fused  # noqa: E402
from specwire.common.model import triton_ops as ops  # noqa: E402
from specwire.common.model.triton_tiles import (  # noqa: E402
    LinearConfig,
    WideConfig,
    linear_config,
    wide_config,
    wide_tiles,
)

BLOCK_N = (16, 32, 64, 128)
BLOCK_K = (64, 128, 256)
SPLITS = (1, 2, 4, 8)
WARPS = (4, 8)
STAGES = (3, 5)
SMEM_BYTES = 160 * 1024  # leave room: a config over this would not launch (or spill)


def candidates(n: int, k: int) -> list[LinearConfig]:
    out = []
    for bn, bk, split, warps, stages in itertools.product(BLOCK_N, BLOCK_K, SPLITS, WARPS, STAGES):
        if bk > k or (16 * bk + bk * bn) * 2 * stages > SMEM_BYTES:
            continue
        iters = -(-k // bk)
        if split > 1 and iters // split < 2:  # at least two K tiles per split
            continue
        per = -(-iters // split)
        if -(-iters // per) != split:  # would leave an empty split
            continue
        if bn * bk // (32 * warps) > 256:  # the weight tile alone would fill the registers
            continue
        out.append(LinearConfig(bn, bk, split, per * bk, warps, stages))
    return out


def candidates_wide(n: int, k: int) -> list[WideConfig]:
    out = []
    grid = itertools.product((32, 64, 128), (64, 128, 256), (64, 128), (1, 2, 4), (4, 8), (3, 4))
    for bm, bn, bk, split, warps, stages in grid:
        if split > 1 and -(-k // bk) // split < 4:  # at least 4 K tiles a split
            continue
        c = wide_tiles(k, bm, bn, bk, split, warps, stages)
        if c.fits() and c.split_k == split and c not in out:
            out.append(c)
    return out


BIG_TILES = False  # --big-tiles: also 256-row tiles and 2-stage pipelines in the exact order
FREE_BK = False  # --free-bk: --exact-order also tries K tiles narrower than the exact GEMM's


def candidates_exact_order(n: int, k: int) -> list[WideConfig]:
    """Row tiles, N tiles, warps and stages over the exact GEMM's own K order (its K tile and
    split, `linear_config`)."""
    c = linear_config(n, k)
    grid = itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
    if BIG_TILES:
        grid = itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4))
    cands = [
        WideConfig(bm, bn, c.block_k, c.split_k, c.k_per_split, w, st) for bm, bn, w, st in grid
    ]
    if FREE_BK:  # narrower K tiles over the same splits: the same chain of k16 MMAs?
        grid = itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4, 5))
        cands += [
            WideConfig(bm, bn, bk, c.split_k, c.k_per_split, w, st)
            for bm, bn, bk, w, st in grid
            if bk < c.block_k and c.k_per_split % bk == 0
        ]
    return [cfg for cfg in cands if cfg.fits()]


def _same_order(c: WideConfig, exact: LinearConfig) -> bool:
    """Whether `c` splits K where the exact GEMM does, on its K tile (or, with --free-bk, on a
    narrower one: checked bit for bit all the same)."""
    if FREE_BK:
        return c.k_per_split == exact.k_per_split and exact.block_k % c.block_k == 0
    return (c.block_k, c.k_per_split) == (exact.block_k, exact.k_per_split)


def sweep_wide(model, op, n, k, ms, log, exact_order=False):
    """`linear_wide` configs at each M beside cuBLAS (see the module docstring)."""
    ws = _weights(n, k)
    floor = n * k * 2 / HBM_BYTES_PER_US
    cands = candidates_exact_order(n, k) if exact_order else candidates_wide(n, k)
    exact_cfg = linear_config(n, k)
    results = {"model": model, "op": op, "kind": "wide", "n": n, "k": k, "floor_us": floor,
               "rows": []}  # fmt: skip
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for m in ms:
        x = torch.randn(m, k, **bf)
        ref_us = graph_us([partial(F.linear, x, w) for w in ws])
        exact_us = graph_us([partial(ops.linear, x, w, block_m=64) for w in ws])
        times = {}
        for c in cands:
            try:
                times[c] = graph_us([partial(ops.linear_wide, x, w, None, None, c) for w in ws])
            except Exception as e:  # noqa: BLE001 (a config that does not launch: skip it)
                log(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
        best = min(times, key=times.get)
        err = ops.linear_wide(x, ws[0], None, None, best).float() - F.linear(x, ws[0]).float()
        same_k = [c for c in times if _same_order(c, exact_cfg)]
        ex = min(same_k, key=times.get) if same_k else None
        want = ops.linear(x, ws[0], block_m=16)  # the exact mode's bits
        bitwise = ex is not None and torch.equal(ops.linear_wide(x, ws[0], None, None, ex), want)
        # every config in the exact K order, checked bit for bit (exact_order sweeps)
        differ = [
            _wkey(c)
            for c in same_k
            if exact_order and not torch.equal(ops.linear_wide(x, ws[0], None, None, c), want)
        ]
        cur = wide_config(n, k, m)
        results["rows"].append({
            "m": m, "ref_us": ref_us, "exact_us": exact_us, "best": _wkey(best),
            "best_us": times[best], "current": _wkey(cur) if cur else "cublas",
            "current_us": times.get(cur, ref_us) if cur else ref_us,
            "times": {_wkey(c): t for c, t in times.items()},
            "best_max_abs_diff": err.abs().max().item(),
            "same_k_order": _wkey(ex) if ex else None,
            "same_k_order_us": times[ex] if ex else None, "same_k_order_bitwise": bitwise,
            "exact_order_configs": len(same_k), "exact_order_differ": differ,
        })  # fmt: skip
        r = results["rows"][-1]
        log(
            f"| {model} | {op} | {m} | {ref_us:.1f} | {r['current_us']:.1f} | {times[best]:.1f}"
            f" | {_wkey(best)} | {exact_us:.1f} | {_wkey(ex) if ex else '-'} "
            f"| {r['same_k_order_us'] or float('nan'):.1f} | {bitwise} | {floor:.2f} |"
            + (f" {len(same_k) - len(differ)}/{len(same_k)} bitwise {differ[:3]} |" * exact_order)
        )
    ws.clear()
    torch.cuda.empty_cache()
    return results


def _wkey(c: WideConfig) -> str:
    return f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def gemm_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, q, kv = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    return {
        "qkv": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up": (2 * cfg["inter"], h),
        "down": (h, cfg["inter"]),
        "lm_head": (cfg["vocab"], h),
    }


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(1, min(256, ROTATE_BYTES // (n * k * 2)))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    return [w] + [w.clone() for _ in range(copies - 1)]


def _norm_then_cublas(x, res, nw, w):
    h, _ = ops.add_rms_norm(x, res, nw, EPS)
    return F.linear(h, w)


def _silu_then_cublas(gu, w):
    return F.linear(ops.silu_mul(gu), w)


def case_calls(kind: str, m: int, n: int, k: int, ws: list[torch.Tensor]):
    """(reference name, reference calls, function of a config -> calls, fp32 check)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    if kind == "linear":
        x = torch.randn(m, k, **bf)
        ref = [partial(F.linear, x, w) for w in ws]

        def ours(c):
            return [partial(ops.linear, x, w, config=c) for w in ws]

        def check(c):
            return ops.linear(x, ws[0], config=c).float(), F.linear(x, ws[0]).float()

        return "cublas", ref, ours, check
    if kind == "norm":
        x, res, nw = torch.randn(m, k, **bf), torch.randn(m, k, **bf), torch.randn(k, **bf)
        ref = [partial(_norm_then_cublas, x, res, nw, w) for w in ws]

        def ours(c):
            return [partial(fused.add_norm_linear, x, res, nw, EPS, w, config=c) for w in ws]

        def check(c):
            got = fused.add_norm_linear(x, res, nw, EPS, ws[0], config=c)[0]
            return got.float(), _norm_then_cublas(x, res, nw, ws[0]).float()

        return "norm+cublas", ref, ours, check
    gu = torch.randn(m, 2 * k, **bf)
    ref = [partial(_silu_then_cublas, gu, w) for w in ws]

    def ours(c):
        return [partial(fused.silu_linear, gu, w, config=c) for w in ws]

    def check(c):
        return fused.silu_linear(gu, ws[0], config=c).float(), _silu_then_cublas(gu, ws[0]).float()

    return "silu+cublas", ref, ours, check


def sweep_case(model, op, kind, n, k, ms, log):
    ws = _weights(n, k)
    floor = n * k * 2 / HBM_BYTES_PER_US
    cands = candidates(n, k)
    current = linear_config(n, k)
    if current not in cands:
        cands.append(current)
    results = {"model": model, "op": op, "kind": kind, "n": n, "k": k, "floor_us": floor,
               "rows": []}  # fmt: skip
    for m in ms:
        ref_name, ref, ours, check = case_calls(kind, m, n, k, ws)
        ref_us = graph_us(ref)
        times = {}
        for c in cands:
            try:
                times[c] = graph_us(ours(c))
            except Exception as e:  # noqa: BLE001 (a config that does not launch: skip it)
                log(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
        best = min(times, key=times.get)
        got, want = check(best)
        err = (got - want).abs().max().item()
        results["rows"].append({
            "m": m, "ref": ref_name, "ref_us": ref_us, "current_us": times.get(current),
            "times": {_key(c): t for c, t in times.items()}, "best": _key(best),
            "best_us": times[best], "best_max_abs_diff": err,
        })  # fmt: skip
        cur = times.get(current, float("nan"))
        log(
            f"| {model} | {op} | {kind} | {m} | {ref_us:.1f} | {cur:.1f} | {times[best]:.1f}"
            f" | {floor:.2f} | {_key(best)} | {err:.3g} |"
        )
    # One config for every M (exact mode): the least total time over the Ms.
    common = {c for c in cands if all(_key(c) in r["times"] for r in results["rows"])}
    if common:
        overall = min(common, key=lambda c: sum(r["times"][_key(c)] for r in results["rows"]))
        results["overall"] = _key(overall)
        results["overall_us"] = [r["times"][_key(overall)] for r in results["rows"]]
    ws.clear()
    torch.cuda.empty_cache()
    return results


def _key(c: LinearConfig) -> str:
    return f"bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,llama3-8b", help=", ".join(MODELS))
    ap.add_argument("--ms", default="1,5", help="row counts (decode/verify steps)")
    ap.add_argument("--ops", default="qkv,o_proj,gate_up,down,norm_qkv,norm_gate_up,silu_down",
                    help="also: lm_head")  # fmt: skip
    ap.add_argument("--out", help="write gemm_sweep.md and .json here")
    ap.add_argument("--wide", action="store_true", help="sweep linear_wide (see the docstring)")
    ap.add_argument(
        "--exact-order", action="store_true", help="--wide over the exact GEMM's K order only"
    )
    ap.add_argument(
        "--masked-k",
        action="store_true",
        help="our GEMMs mask their K loads as before round 21 (triton_ops.UNMASKED_K off)",
    )
    ap.add_argument(
        "--big-tiles",
        action="store_true",
        help="--exact-order also tries 256-row tiles and 2-stage pipelines",
    )
    ap.add_argument(
        "--free-bk",
        action="store_true",
        help="--exact-order also tries narrower K tiles over the same K splits",
    )
    args = ap.parse_args()
    global BIG_TILES, FREE_BK
    BIG_TILES, FREE_BK = args.big_tiles, args.free_bk
    if args.masked_k:
        from specwire.common.model import triton_ops

        triton_ops.UNMASKED_K = False
    ms = [int(v) for v in args.ms.split(",")]
    wanted = args.ops.split(",")
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("|"):
            lines.append(msg)

    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.wide:
        return _main_wide(args, ms, wanted, log, lines, t0)
    log("| model | op | kernel | M | reference us | current config us | best us | floor us "
        "| best config | best max abs diff |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|")
    all_results = []
    for model in args.models.split(","):
        shapes = gemm_shapes(MODELS[model])
        cases = [(op, "linear", *shapes[op]) for op in shapes if op in wanted]
        cases += [("norm_qkv", "norm", *shapes["qkv"])]
        cases += [("norm_gate_up", "norm", *shapes["gate_up"])]
        n, k = shapes["down"]
        cases.append(("silu_down", "silu", n, k))
        for op, kind, n, k in cases:
            if op not in wanted:
                continue
            try:
                all_results.append(sweep_case(model, op, kind, n, k, ms, log))
            except Exception as e:  # noqa: BLE001 (report, go on)
                log(f"| {model} | {op} | {kind} | ERROR {type(e).__name__}: {str(e)[:200]} |")
    log("")
    log("| model | op | kernel | one config for all M | its us per M | reference us per M |")
    log("|---|---|---|---|---|---|")
    for r in all_results:
        if "overall" in r:
            ref = " / ".join(f"{row['ref_us']:.1f}" for row in r["rows"])
            mine = " / ".join(f"{t:.1f}" for t in r["overall_us"])
            log(f"| {r['model']} | {r['op']} | {r['kind']} | {r['overall']} | {mine} | {ref} |")
    print(f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_sweep.md").write_text("\n".join(lines) + "\n")
        (out / "gemm_sweep.json").write_text(json.dumps(all_results, indent=1))
    return 0


def _main_wide(args, ms, wanted, log, lines, t0) -> int:
    log("| model | op | M | cuBLAS us | current us | best us | best config | exact linear us "
        "| fastest in the exact K order | its us | bitwise = exact | floor us |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for model in args.models.split(","):
        for op, (n, k) in gemm_shapes(MODELS[model]).items():
            if op in wanted:
                try:
                    results.append(sweep_wide(model, op, n, k, ms, log, args.exact_order))
                except Exception as e:  # noqa: BLE001 (report, go on)
                    log(f"| {model} | {op} | ERROR {type(e).__name__}: {str(e)[:200]} |")
    print(f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "gemm_sweep_exact_order" if args.exact_order else "gemm_sweep_wide"
        (out / f"{name}.md").write_text("\n".join(lines) + "\n")
        (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
