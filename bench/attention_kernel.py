"""Micro-benchmark: the Triton paged-attention kernel vs the PyTorch SDPA path it replaces.

One attention layer (KV store + attention) at the SmolLM2-135M and Llama-3-8B head shapes, bf16,
block size 16, every row with `--ctx` tokens of context: B decode rows (q = 1), B verify rows
(q = 5) and a mixed step (two 256-token prefill chunks, decode and verify rows, padding).

- triton us:  `store_kv` + `paged_attention` (3 launches: store, split attention, combine)
- attn us:    `paged_attention` alone (split attention + combine)
- sdpa us:    `TorchPagedAttention.forward` (uniform layout for uniform rows, ragged for mixed)
- KV GB/s:    K/V bytes of the rows' contexts ÷ attn time (the H200 streams ~4.8 TB/s)
- max diff:   largest |triton - sdpa| over the outputs (a sanity check, bf16)

Each number is GPU time per call: 10 calls captured in one CUDA graph, replayed after warm-up,
timed with CUDA events, median of 20 replays. The SDPA ragged path (mixed step) loops over
rows on the host and is eager-only in the runner, so it is timed eagerly (marked `*`).
Then the B >= 8 rows under 1, 2 and 4 segments walked per program (`--seg-groups`; the
numerics are the same), and the target rows under other key segments and key tiles
(VARIANTS), without SDPA.

    python bench/attention_kernel.py [--ctx 1024] [--seg-groups 1,2,4] [--no-variants] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specwire.common.model import triton_attention  # noqa: E402
from specwire.common.model.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from specwire.common.model.triton_attention import paged_attention, store_kv  # noqa: E402

BLOCK_SIZE = 16
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
CALLS_PER_REPLAY = 10
# Launch settings tried after the main table (SEGMENT, KEY_TILE), the first being the module's:
# they change the numerics, so the kernel keeps one; this says which one to keep. A sweep of
# each around the default rather than the full product: the bench stays under a minute.
VARIANTS = [(128, 128), (256, 128), (512, 128), (128, 64), (128, 32)]
# The rows the kernel has latency/throughput targets for: (heads, batch, query length).
VARIANT_STEPS = [("smollm2", 1, 1), ("smollm2", 64, 5), ("llama3-8b", 1, 5), ("llama3-8b", 32, 5)]


def time_us(fn: Callable[[], object], graph: bool = True) -> float:
    """Microseconds per call of `fn`: GPU time inside a CUDA graph, else eager wall time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run, per_replay = fn, 1
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(CALLS_PER_REPLAY):
                fn()
        run, per_replay = captured.replay, CALLS_PER_REPLAY
    for _ in range(3):
        run()
    samples = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per_replay)
    return statistics.median(samples)


def case(
    heads: tuple[int, int, int],
    rows: list[tuple[int, int]],
    pad: int,
    sdpa: bool = True,
    seg_group: int | None = None,
) -> dict:
    """Time one step of `rows` [(qlen, ctx)] with `pad` padding tokens at the end; `sdpa`:
    time the SDPA path too; `seg_group`: segments per program (None: the module's choice)."""
    h, kvh, d = heads
    dev, dtype = torch.device("cuda"), torch.bfloat16
    counts = [-(-ctx // BLOCK_SIZE) for _, ctx in rows]
    width = max(counts)
    num_blocks = 1 + sum(counts)
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, slots = [], []
    for (qlen, ctx), n in zip(rows, counts, strict=True):
        table, ids = ids[:n], ids[n:]
        tables.append(table + [0] * (width - n))
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx - qlen, ctx)
        ]
    t = sum(q for q, _ in rows) + pad
    slots += [-1] * pad
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kvh, d, device=dev, dtype=dtype)
    q = torch.randn(t, h, d, device=dev, dtype=dtype)
    k = torch.randn(t, kvh, d, device=dev, dtype=dtype)
    v = torch.randn(t, kvh, d, device=dev, dtype=dtype)
    block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
    cu = torch.tensor([0] + [sum(q for q, _ in rows[: i + 1]) for i in range(len(rows))])
    cu = cu.to(dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([c for _, c in rows], dtype=torch.int32, device=dev)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)
    scale = d**-0.5

    def triton_step():
        store_kv(k, v, cache, slot_mapping)
        paged_attention(q, cache, block_tables, cu, seq_lens, scale, out=out, seg_group=seg_group)

    def attn_only():
        paged_attention(q, cache, block_tables, cu, seq_lens, scale, out=out, seg_group=seg_group)

    # The SDPA path knows no padding: it gets the real rows and tokens only. Its ragged layout
    # (mixed steps) loops over rows on the host and is eager-only in the runner: timed eagerly.
    real = t - pad
    keep = torch.tensor([i for i, (qlen, _) in enumerate(rows) if qlen > 0], device=dev)
    real_rows = [r for r in rows if r[0] > 0]
    ref = TorchPagedAttention(h, kvh, d, BLOCK_SIZE)
    qlens = {qlen for qlen, _ in real_rows}
    uniform = len(qlens) == 1
    meta = AttentionMetadata(
        slot_mapping=slot_mapping[:real],
        block_tables=block_tables[keep],
        context_lens=seq_lens[keep],
        query_lens=None if uniform else [qlen for qlen, _ in real_rows],
        context_lens_host=None if uniform else [c for _, c in real_rows],
        uniform_q=qlens.pop() if uniform else 0,
    )

    def sdpa_step():
        ref.forward(q[:real], k[:real], v[:real], cache, meta)

    kv_bytes = sum(c for _, c in rows) * kvh * d * 2 * cache.element_size()
    attn_us = time_us(attn_only)
    triton_step()
    diff = out[:real].float() - ref.forward(q[:real], k[:real], v[:real], cache, meta).float()
    return {
        "max_abs_diff": diff.abs().max().item(),
        "triton_us": time_us(triton_step),
        "attn_us": attn_us,
        "sdpa_us": time_us(sdpa_step, graph=uniform) if sdpa else float("nan"),
        "sdpa_graph": uniform,
        "kv_gb_per_s": kv_bytes / attn_us / 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", help="folder for attention_kernel.{json,md}")
    ap.add_argument(
        "--seg-groups",
        default="1,2,4",
        help="segments per program to compare on the B >= 8 steps (numerics unchanged)",
    )
    ap.add_argument(
        "--stages",
        default="",
        help="software-pipeline stages to compare, e.g. 2,3; '': the module's",
    )
    ap.add_argument("--no-variants", action="store_true", help="skip the SEGMENT/KEY_TILE sweep")
    args = ap.parse_args()
    ctx = args.ctx
    steps: list[tuple[str, list[tuple[int, int]], int]] = []
    for b in (1, 8, 32, 64):
        for qlen in (1, 5):
            steps.append((f"B={b} q={qlen}", [(qlen, ctx)] * b, 0))
    mixed = [(256, ctx), (256, 256)] + [(1, ctx)] * 16 + [(5, ctx)] * 14 + [(0, 0)] * 4
    steps.append(("mixed: 2 chunks of 256, 16 decode, 14 verify", mixed, 7))
    lines = [
        f"ctx {ctx}, bf16, block size {BLOCK_SIZE}, {torch.cuda.get_device_name()}",
        "",
        "| heads | step | triton us | attn us | sdpa us | sdpa ÷ triton | KV GB/s | max diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    results: list[dict] = []

    def run(
        name: str, label: str, rows: list[tuple[int, int]], pad: int, tag: str = "", group=None
    ) -> None:
        try:
            r = case(HEADS[name], rows, pad, sdpa=not tag, seg_group=group)
        except Exception as e:  # keep going: one failure must not hide the other rows
            results.append({"heads": name, "step": label, "variant": tag, "error": repr(e)})
            print(f"{name} {label} {tag}: FAILED {e!r}", flush=True)
            return
        results.append({"heads": name, "step": label, "variant": tag, **r})
        mark = "" if r["sdpa_graph"] else "*"
        lines.append(
            f"| {name} | {label}{tag} | {r['triton_us']:.1f} | {r['attn_us']:.1f} | "
            f"{r['sdpa_us']:.1f}{mark} | {r['sdpa_us'] / r['triton_us']:.2f} | "
            f"{r['kv_gb_per_s']:.0f} | {r['max_abs_diff']:.1e} |"
        )
        print(lines[-1], flush=True)

    for name in HEADS:
        for label, rows, pad in steps:
            run(name, label, rows, pad)
    stages = [int(n) for n in args.stages.split(",") if n] or [triton_attention.NUM_STAGES]
    kept = triton_attention.NUM_STAGES
    try:
        for n in stages:
            triton_attention.NUM_STAGES = n
            for group in [int(g) for g in args.seg_groups.split(",") if g]:
                tag = f" ({group} seg/program, {n} stages)"
                for name in HEADS:
                    for b in (8, 32, 64):
                        for qlen in (1, 5):
                            run(name, f"B={b} q={qlen}", [(qlen, ctx)] * b, 0, tag, group)
    finally:
        triton_attention.NUM_STAGES = kept
    default = (triton_attention.SEGMENT, triton_attention.KEY_TILE)
    try:
        for segment, tile in [] if args.no_variants else VARIANTS:
            triton_attention.SEGMENT, triton_attention.KEY_TILE = segment, tile
            for name, b, qlen in VARIANT_STEPS:
                tag = f" (segment {segment}, tile {tile})"
                run(name, f"B={b} q={qlen}", [(qlen, ctx)] * b, 0, tag)
    finally:
        triton_attention.SEGMENT, triton_attention.KEY_TILE = default
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention_kernel.md").write_text(table + "\n")
        (out / "attention_kernel.json").write_text(
            json.dumps({"ctx": ctx, "block_size": BLOCK_SIZE, "results": results}, indent=1)
        )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
