"""Triton layer ops (specwire/common/model/triton_ops.py) against their eager PyTorch equivalents,
bf16,
for SmolLM2-135M and Llama-3-8B shapes at the decode/verify batch sizes.

    python3 bench/layer_ops.py [--out DIR] [--no-block-m]

Every op is timed inside a CUDA graph (as the model runs), each graph replaying many calls back
to back; the GEMMs rotate through enough weight copies (up to 256 MiB) that the weights come
from HBM, not L2, as they do when a real step walks the layers. `floor` is the weight bytes over
4.8 TB/s. `bm32`/`bm64` time `linear(block_m=32/64)` (see `linear`'s docstring). A shape that
fails prints its error and the table goes on.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specwire.common.model import triton_ops as ops  # noqa: E402
from specwire.common.model.llama import Rotary  # noqa: E402

MODELS = {
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536, vocab=49152),
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256),
}
BATCH = (1, 5, 8, 40, 64, 320)
HBM_BYTES_PER_US = 4.8e6
ROTATE_BYTES = 256 << 20
EPS = 1e-5


def graph_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Mean GPU microseconds per call, with `calls` captured back to back in one CUDA graph."""
    calls = calls * -(-16 // len(calls))  # at least 16 calls a replay
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


def _linear_then_float(x, w):
    return F.linear(x, w).float()


def linear_rows(name: str, cfg: dict, m: int, block_m: bool):
    h, q, kv = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    gemms = {
        "qkv": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up": (2 * cfg["inter"], h),
        "down": (h, cfg["inter"]),
        "lm_head": (cfg["vocab"], h),
    }
    for op, (n, k) in gemms.items():
        try:
            nbytes = n * k * 2
            copies = max(1, min(256, ROTATE_BYTES // nbytes))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5]
            ws += [ws[0].clone() for _ in range(copies - 1)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.float32 if op == "lm_head" else None
            tri = graph_us([partial(ops.linear, x, w, out_dtype=out) for w in ws])
            eager_fn = F.linear if out is None else _linear_then_float  # the model's path
            eager = graph_us([partial(eager_fn, x, w) for w in ws])
            extra = {}
            for bm in (32, 64) if block_m else ():
                calls = [partial(ops.linear, x, w, out_dtype=out, block_m=bm) for w in ws]
                extra[f"bm{bm}"] = graph_us(calls)
            c = ops.linear_config(n, k)
            note = f"N{n} K{k} bn{c.block_n} bk{c.block_k} split{c.split_k}"
            yield name, op, m, tri, eager, nbytes / HBM_BYTES_PER_US, extra, note
        except Exception as e:  # noqa: BLE001 (report and go on to the next shape)
            print(f"| {name} | {op} | {m} | ERROR {type(e).__name__}: {e} |", flush=True)
        finally:
            ws = None
            torch.cuda.empty_cache()


def elementwise_rows(name: str, cfg: dict, m: int):
    h, d = cfg["hidden"], cfg["head_dim"]
    heads = cfg["heads"] + cfg["kv_heads"]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res, w = torch.randn(m, h, **bf), torch.randn(m, h, **bf), torch.randn(h, **bf)
    gate_up = torch.randn(m, 2 * cfg["inter"], **bf)
    qkv = torch.randn(m, (heads + cfg["kv_heads"]) * d, **bf)
    qk = qkv[:, : heads * d].view(m, heads, d)
    cos, sin = torch.randn(m, d, **bf), torch.randn(m, d, **bf)

    def eager_norm(a):
        return w * F.rms_norm(a.float(), (h,), eps=EPS).to(a.dtype)

    def eager_add_norm():
        s = x + res
        return eager_norm(s), s

    pairs = {
        "rms_norm": (lambda: ops.rms_norm(x, w, EPS), lambda: eager_norm(x)),
        "add_rms_norm": (lambda: ops.add_rms_norm(x, res, w, EPS), eager_add_norm),
        "silu_mul": (
            lambda: ops.silu_mul(gate_up),
            lambda: (lambda g, u: F.silu(g) * u)(*gate_up.chunk(2, dim=-1)),
        ),
        "rope": (
            lambda: ops.rope(qk, cos, sin, inplace=True),
            lambda: Rotary.apply(qk, cos[:, None], sin[:, None]),
        ),
    }
    for op, (tri_fn, eager_fn) in pairs.items():
        try:
            tri, eager = graph_us([tri_fn] * 32), graph_us([eager_fn] * 32)
            yield name, op, m, tri, eager, None, {}, ""
        except Exception as e:  # noqa: BLE001
            print(f"| {name} | {op} | {m} | ERROR {type(e).__name__}: {e} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write layer_ops.md here")
    ap.add_argument("--no-block-m", action="store_true", help="skip the bm32/bm64 columns")
    args = ap.parse_args()
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    lines = [
        "| model | op | M | triton us | eager us | triton/eager | floor us | bm32 us | bm64 us "
        "| config |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, cfg in MODELS.items():
        for m in BATCH:
            rows = list(elementwise_rows(name, cfg, m))
            rows += list(linear_rows(name, cfg, m, block_m=not args.no_block_m))
            for model, op, mm, tri, eager, floor, extra, note in rows:
                fl = f"{floor:.2f}" if floor else ""
                bms = " | ".join(f"{extra[k]:.1f}" if k in extra else "" for k in ("bm32", "bm64"))
                lines.append(
                    f"| {model} | {op} | {mm} | {tri:.1f} | {eager:.1f} | {tri / eager:.2f} "
                    f"| {fl} | {bms} | {note} |"
                )
                print(lines[-1], flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "layer_ops.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
