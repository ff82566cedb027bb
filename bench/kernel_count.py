"""GPU kernels per decoder layer and per step, from the PyTorch profiler.

One eager decode step (B rows, q tokens each, random weights of the real shape) is profiled
with the PyTorch ops and the SDPA attention (the reference, and what the target ran before the
Triton path), and with our Triton attention beside our Triton ops: the default, the default
without its bit-exact fusions ("nofuse": `TritonOps(fuse_small=False)`, the kernel sequence
before them) and fused (`triton_fused.py`: steps of up to 16 tokens) -- or, with --exact, the
exact ops with and without the bit-exact fusions. Eager runs launch exactly the kernels a CUDA
graph of the same step replays.

`--compile default,max-autotune` adds the PyTorch ops under torch.compile
(`compiled_ops.py`: the math between two attention calls compiled, "max-autotune" = mode
"max-autotune-no-cudagraphs") beside our Triton attention; the two warm-up steps compile.

    python bench/kernel_count.py [--shape smollm2] [--batch 1] [--q 5] [--exact]
        [--compile default,max-autotune]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiled_ops import MODES as COMPILE_MODES  # noqa: E402  (bench/, next to this file)
from compiled_ops import CompiledOps  # noqa: E402

from specwire.common.model.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from specwire.common.model.config import (  # noqa: E402
    LLAMA3_2_1B,
    LLAMA3_8B,
    QWEN2_5_1_5B,
    SMOLLM2_135M,
    SMOLLM2_360M,
)
from specwire.common.model.llama import LlamaModel  # noqa: E402
from specwire.common.model.ops import TorchOps, TritonOps  # noqa: E402
from specwire.common.model.triton_backend import TritonPagedAttention  # noqa: E402

SHAPES = {
    "smollm2": SMOLLM2_135M,
    "llama3-8b": LLAMA3_8B,
    "smollm2-360m": SMOLLM2_360M,
    "qwen2.5-1.5b": QWEN2_5_1_5B,
    "llama3.2-1b": LLAMA3_2_1B,
}
BS = 16


def step_inputs(batch: int, q: int, ctx: int, device):
    """`batch` rows of q tokens each on top of `ctx` cached tokens; blocks 1.. in order."""
    blocks = -(-(ctx + q) // BS)
    tables = torch.arange(1, 1 + batch * blocks, dtype=torch.int32, device=device)
    tables = tables.view(batch, blocks)
    pos = torch.arange(ctx, ctx + q, device=device).repeat(batch)
    rows = torch.arange(batch, device=device).repeat_interleave(q)
    slots = tables[rows, pos // BS].long() * BS + pos % BS
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=torch.full((batch,), ctx + q, dtype=torch.int32, device=device),
        uniform_q=q,
        cu_seqlens_q=torch.arange(0, batch * q + 1, q, dtype=torch.int32, device=device),
    )
    ids = torch.zeros(batch * q, dtype=torch.long, device=device)
    return ids, pos, meta, 1 + batch * blocks


def count(
    model: LlamaModel, kv, ids, pos, meta
) -> tuple[int, collections.Counter, collections.Counter]:
    """(kernels launched, launches per kernel name, device µs per kernel name) of one step."""
    with torch.inference_mode():
        for _ in range(2):  # warm-up: compile, plan
            model.compute_logits(model(ids, pos, kv, meta)[-1:])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.compute_logits(model(ids, pos, kv, meta)[-1:])
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = collections.Counter(e.name for e in kernels)
    micros: collections.Counter = collections.Counter()
    for e in kernels:
        micros[e.name] += e.time_range.elapsed_us()
    return sum(names.values()), names, micros


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--exact", action="store_true")
    ap.add_argument(
        "--compile",
        default="",
        help="comma list of torch.compile modes to add (default, max-autotune); off: none",
    )
    args = ap.parse_args()
    modes = [m for m in args.compile.split(",") if m and m != "off"]
    if any(m not in COMPILE_MODES for m in modes):
        ap.error(f"--compile: use a comma list of off, {', '.join(COMPILE_MODES)}")
    dev = torch.device("cuda")
    cfg = SHAPES[args.shape]
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = LlamaModel(cfg, block_size=BS, max_positions=args.ctx + args.q + BS).eval()
    torch.set_default_dtype(torch.float32)
    ids, pos, meta, blocks = step_inputs(args.batch, args.q, args.ctx, dev)
    kv = model.allocate_kv_cache(blocks)
    args_ = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BS)
    paths = [("pytorch ops + SDPA", TorchPagedAttention(*args_), TorchOps())]
    variants = {  # label: TritonOps arguments
        "default": {},
        "nofuse": dict(fuse_small=False),
        "fused": dict(fused=True),
    }
    if args.exact:
        variants = {"exact": dict(exact=True), "exact, nofuse": dict(exact=True, fuse_small=False)}
    for label, kwargs in variants.items():
        attn, ops = TritonPagedAttention(*args_), TritonOps(**kwargs)
        paths.append((f"triton ops ({label}) + triton attention", attn, ops))
    rows = []
    for name, attn, ops in paths:
        model.set_attention(attn)
        model.set_ops(ops)
        meta.uniform_mask = None
        total, names, micros = count(model, kv, ids, pos, meta)
        rows.append((name, total, total / cfg.num_layers, names, micros))
    for mode in modes:  # the PyTorch math compiled, between Triton attention calls
        model.set_attention(TritonPagedAttention(*args_))
        compiled = CompiledOps(model, mode)
        compiled.attach()
        meta.uniform_mask = None
        total, names, micros = count(model, kv, ids, pos, meta)
        compiled.detach()
        name = f"pytorch ops compiled ({mode}) + triton attention"
        rows.append((name, total, total / cfg.num_layers, names, micros))
    print(f"{args.shape}, B={args.batch} q={args.q} ctx={args.ctx}, bf16, {cfg.num_layers} layers")
    print("| path | kernels per step | per layer | kernel time per step µs |")
    print("|---|---|---|---|")
    for name, total, per_layer, _, micros in rows:
        print(f"| {name} | {total} | {per_layer:.1f} | {sum(micros.values()):.0f} |")
    for name, _, _, names, micros in rows:
        print(f"\n{name}: kernels by device time (launches, µs in all, µs each)")
        for kernel, us in micros.most_common(14):
            n = names[kernel]
            print(f"  {n:5d}  {us:9.1f}  {us / n:7.2f}  {kernel[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
