"""What the target's host can do without its gRPC front end: the same engine and prompts as
`bench/serving.py`, driven in one process by an asyncio loop that does what the servicer does
(tokenise on a pool, submit, await each request's events) minus gRPC and protobuf.

Next to a `serving.py` run of the same model and flags on the same machine, the ratio is the
most a front end in its own process could win while the host is the limit (a model whose GPU
time is negligible, e.g. tiny-random, measures the host alone):

    python bench/engine_only.py --model tiny-random --device cuda --max-batch-size 64 \\
        --max-num-tokens 1024 --concurrency 1,32,64 --min-prompts 48 --pass-factor 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from prompt_pool import build_pool  # noqa: E402
from serving_plan import plan_passes  # noqa: E402
from thread_profile import add_profile_flags, print_profile, profile_thread  # noqa: E402

from specwire.target_service.config import TargetConfig  # noqa: E402
from specwire.target_service.engine import build_engine  # noqa: E402
from specwire.target_service.events import Chunk, Complete, Failed  # noqa: E402
from specwire.target_service.params import GenerationParams  # noqa: E402


async def run_pass(
    engine, plan, args, pool, request_draft_len: int | None = None, params_for=None
) -> dict:
    """One pass of `plan` through the engine. `params_for(name, i, prompt)`: each request's
    GenerationParams (default: the prompt's text as one chat message). The result's
    `outputs`: each completed request's token ids, by its request id."""
    todo = iter(enumerate(plan.prompts))
    tokens = errors = chunks = 0
    outputs: dict[str, list[int]] = {}

    async def worker() -> None:
        nonlocal tokens, errors, chunks
        loop = asyncio.get_running_loop()
        for i, prompt in todo:
            if params_for is not None:
                params = params_for(plan.name, i, prompt)
            else:
                params = GenerationParams(
                    chat=({"role": "user", "content": prompt.text},),
                    max_new_tokens=args.max_new_tokens,
                    request_id=f"{plan.name}/{i}",
                    max_draft_len=request_draft_len,
                )
            requests = await loop.run_in_executor(pool, engine.normalize, params)
            events, _streams = engine.submit(requests)
            while True:
                ev = await events.aget()
                if isinstance(ev, Chunk):
                    chunks += 1
                elif isinstance(ev, Complete):
                    tokens += ev.completion_tokens
                    outputs[params.request_id] = ev.token_ids
                    break
                elif isinstance(ev, Failed):
                    errors += 1
                    if errors == 1:
                        print(f"first error: {ev.code}: {ev.message}", flush=True)
                    break

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    wall = time.perf_counter() - t0
    return dict(
        name=plan.name,
        concurrency=plan.concurrency,
        tokens=tokens,
        wall_s=wall,
        tok_per_s=tokens / wall,
        chunks=chunks,
        errors=errors,
        outputs=outputs,
    )


async def main_async(args) -> list[dict]:
    cfg = TargetConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
        drafter=args.drafter,
        max_draft_len=args.max_draft_len,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        progress=False,
    )
    engine = build_engine(cfg)
    gc.collect()  # as `specwire target` does once warm
    gc.freeze()
    profiler = profile_thread(engine, args.profile, args.profile_mode, args.profile_interval_ms)
    engine.executor.start()
    pool = futures.ThreadPoolExecutor(4, "tokenize")
    prompts, _source = build_pool(True)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    plans = plan_passes(prompts, levels, None, 16, args.min_prompts, args.pass_factor)
    out = []
    try:
        for plan in plans:
            rec = await run_pass(engine, plan, args, pool, args.request_draft_len)
            out.append(rec)
            print(
                f"engine-only {args.drafter} k={args.request_draft_len} {plan.name}: "
                f"{rec['tokens']} tokens in "
                f"{rec['wall_s']:.2f}s ({rec['tok_per_s']:.1f} tok/s), chunks {rec['chunks']}, "
                f"errors {rec['errors']}",
                flush=True,
            )
    finally:
        engine.shutdown()
        pool.shutdown()
    print_profile(profiler, args)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,32,64")
    ap.add_argument("--min-prompts", type=int, default=48)
    ap.add_argument("--pass-factor", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--request-draft-len",
        type=int,
        default=None,
        help="every request's max_draft_len (0: a server with a drafter that never drafts)",
    )
    ap.add_argument("--json", default=None)
    add_profile_flags(ap)
    ap.add_argument("--gil-switch-interval", type=float, default=5e-4, help="as the target's")
    args = ap.parse_args()
    sys.setswitchinterval(args.gil_switch_interval)
    out = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), passes=out), indent=1))
    return 1 if any(p["errors"] for p in out) else 0


if __name__ == "__main__":
    sys.exit(main())
