"""Experiment: SDPA with native GQA vs expanded K/V heads, and where a verify step's GPU time
goes (torch.profiler top kernels). Uses verify_step.py's model, rows and timers.

    python3 bench/attention_variants.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from verify_step import BLOCK_SIZE, SHAPES, build_model, make_rows, time_ms  # noqa: E402

from specwire.target_service.resources.kv_cache import KVCacheManager  # noqa: E402
from specwire.target_service.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = ["| shape | batch | q | attention | graph replay ms |", "|---|---|---|---|---|"]
    for name in ("smollm2", "llama3-8b"):
        cfg = SHAPES[name]
        max_ctx = args.ctx + 4 + BLOCK_SIZE
        model = build_model(cfg, dev, torch.bfloat16, max_positions=max_ctx + BLOCK_SIZE)
        kv = KVCacheManager(8 * (-(-(args.ctx + 5) // BLOCK_SIZE)) + 1, BLOCK_SIZE, 4)
        caches = model.allocate_kv_cache(kv.num_blocks)
        for expand in (False, True):
            for layer in model.layers:
                layer.attn.expand_kv = expand
            runner = ModelRunner(model, caches, RunnerConfig(8, 4, max_ctx, BLOCK_SIZE, 0))
            runner.warmup(progress=False)
            for batch in (1, 8):
                for k in (0, 4):
                    rows, tables = make_rows(kv, batch, args.ctx, k, cfg.vocab_size)
                    key = runner.graphs.select(runner.prepare(rows, tables))
                    runner.forward(rows, tables)
                    ms = time_ms(runner.graphs.graphs[key].replay, 30, dev, per_call=5)
                    label = "expanded K/V" if expand else "native GQA"
                    lines.append(f"| {name} | {batch} | {1 + k} | {label} | {ms:.3f} |")
                    print(lines[-1], flush=True)
                    if name == "smollm2" and batch == 1 and k == 4:
                        with torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CUDA]
                        ) as prof:
                            runner.forward(rows, tables, allow_graphs=False)
                            torch.cuda.synchronize()
                        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
                        Path(args.out, f"profile_expand{int(expand)}.txt").write_text(table)
                        print(table[:3000], flush=True)
                    for r in rows:
                        kv.free(r.request)
            del runner
        del model, caches
        torch.cuda.empty_cache()
    Path(args.out, "attention_variants.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
