"""The target's host work per generated token, with the model replaced by a stub: what a
loaded server spends in Python (scheduling, input preparation, committing, rendering,
streaming events) when the device costs nothing. Runs anywhere (CPU).

The real engine (`build_engine`, tiny-random) runs its executor, output thread and the
servicer-like asyncio consumer of `bench/engine_only.py`; only `ModelRunner.forward` is
replaced: it does the GPU path's host part (`InputPreparer.prepare_varlen` and the staging of
those lists into host arrays, as `TokenGraphs.replay` does) and returns each row's next token
from a fixed pseudo-random table instead of launching a model. A stub, because the device part
cannot run here; no figure from it says anything about GPU time. Plain decoding only (the
overlapped path: speculation's verify needs real logits).

    python bench/host_only.py --concurrency 1,32,64 [--profile executor|output]

Prints tok/s per pass and, with --profile, the top functions of that thread (cProfile;
wall time, so a function's share includes its waits for the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine_only import run_pass  # noqa: E402
from prompt_pool import build_pool  # noqa: E402
from serving import plan_passes  # noqa: E402

from specwire.target_service.config import TargetConfig  # noqa: E402
from specwire.target_service.engine import build_engine  # noqa: E402
from specwire.target_service.runner.model_runner import StepLogits  # noqa: E402


class StubForward:
    """`ModelRunner.forward` minus the device: the varlen inputs are prepared and staged on
    the host as on the GPU path, the next tokens come from a table."""

    def __init__(self, runner, vocab: int, max_tokens: int) -> None:
        self.inputs = runner.inputs
        self.table = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, 1 << 16))
        self.n = 0
        shape = (max_tokens,)
        self.h_ids, self.h_pos, self.h_slots = (np.zeros(shape, np.int64) for _ in range(3))

    def __call__(self, rows, tables, allow_graphs: bool = True) -> StepLogits:
        step = self.inputs.prepare_varlen(rows, tables)
        t = step.num_tokens
        self.h_ids[:t] = step.ids
        self.h_pos[:t] = step.positions
        self.h_slots[:t] = step.slots
        k = len(step.logit_rows)
        start = self.n % (len(self.table) - k)
        self.n += k
        greedy = self.table[start : start + k]
        return StepLogits(torch.empty(0), step.spans, "stub", greedy=greedy)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32,64")
    ap.add_argument("--min-prompts", type=int, default=48)
    ap.add_argument("--pass-factor", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--profile", choices=("executor", "output"), default=None)
    ap.add_argument(
        "--gc-threshold", type=int, default=None, help="gc.set_threshold(N) after warm-up"
    )
    args = ap.parse_args()
    sys.setswitchinterval(5e-4)  # as `specwire target` sets it
    cfg = TargetConfig(
        model="tiny-random",
        drafter="none",
        max_batch_size=args.max_batch_size,
        max_num_tokens=1024,
        max_context_len=2048,
        progress=False,
    )
    engine = build_engine(cfg)
    runner = engine.runner
    runner.forward = StubForward(runner, engine.loaded.config.vocab_size, cfg.max_num_tokens)
    gc.collect()
    gc.freeze()
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:  # profile the chosen thread from its start
        name = {"executor": "specwire-executor", "output": "specwire-output"}[args.profile]
        real_start = threading.Thread.start

        def start(thread):
            if thread.name == name:
                run = thread.run

                def profiled():
                    profiler.enable()
                    try:
                        run()
                    finally:
                        profiler.disable()

                thread.run = profiled
            real_start(thread)

        threading.Thread.start = start
        if args.profile == "output":  # already running: restart it under the profiler
            engine.executor.output.close()
            from specwire.target_service.output import OutputWorker

            engine.executor.output = OutputWorker(engine.executor._stopped)
    engine.executor.start()
    prompts, _ = build_pool(True)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    plans = plan_passes(prompts, levels, None, 16, args.min_prompts, args.pass_factor)
    pool = futures.ThreadPoolExecutor(4, "tokenize")

    async def go() -> None:
        for plan in plans:
            t0 = time.perf_counter()
            rec = await run_pass(engine, plan, args, pool)
            print(
                f"host-only {plan.name}: {rec['tokens']} tokens in {rec['wall_s']:.2f}s "
                f"({rec['tok_per_s']:.0f} tok/s), chunks {rec['chunks']}, errors {rec['errors']}"
                f" [{time.perf_counter() - t0:.1f}s]",
                flush=True,
            )

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
        pool.shutdown()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
