"""The target's host work per generated token, with the model replaced by a stub: what a
loaded server spends in Python (scheduling, input preparation, committing, rendering,
streaming events) when the device costs nothing. Runs anywhere (CPU).

The real engine (`build_engine`, tiny-random) runs its executor, output thread and the
servicer-like asyncio consumer of `bench/engine_only.py`; only `ModelRunner.forward` is
replaced: it does the GPU path's host part (`InputPreparer.prepare_varlen` and the staging of
those lists into host arrays, as `TokenGraphs.replay` does) and returns each row's next token
from a fixed pseudo-random function of the token fed at that position (and of the position: a
second table at every 5th, so that n-gram drafts are sometimes wrong) instead of launching a
model. Greedy output is then a deterministic function of the context, as a model's is, so
speculation (`--drafter ngram`: synchronous steps, drafting, verification, committing several
tokens a row) runs its real host path too, and with the same output as plain decoding. A stub,
because the device part cannot run here; no figure from it says anything about GPU time.

`--replay OUTPUTS.json[.gz]` (greedy outputs saved by `bench/branch_replay.py --save-outputs`: a
real model's prompts and greedy continuations) makes the stub *be* that model: each request
sends a recorded prompt's token ids and the next token at every position is the recorded
output's, so drafts are accepted exactly as they would be against the real model (greedy is
lossless: any drafter commits those tokens). Ids are mapped into the stub's vocabulary, most
frequent first (the rarest share ids), never onto its EOS. With `--device-ms` this is the
serving path of a real workload on a simulated device: the drafters, the drafter service, gRPC
and every thread's contention for the GIL are real.

    python bench/host_only.py --concurrency 1,32,64 [--drafter ngram] [--profile executor|output]
    python bench/host_only.py --replay bench/results/round24/greedy80.json.gz --concurrency 1,8 \
        --device-ms 0.7 --adaptive --drafter remote-ngram --min-prompts 24 --max-new-tokens 128

Prints tok/s per pass and, with --profile, the top functions of that thread (cProfile, or
with --profile-mode sample stack samples: `thread_profile.py`; wall time, so a function's
share includes its waits for the GIL); with --draft-lengths, how
many drafts each drafting row got over the run (0: a step that went without). With
--device-ms, each pass also says how long the simulated device sat idle before each step that
only decodes, drafted or plain: the host time on the critical path between one step's end and
the next one's launch (for a plain step the overlap hides most of it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine_only import run_pass  # noqa: E402
from host_probes import DraftLengths, StepCPU  # noqa: E402
from procs import start_service, stop_service  # noqa: E402
from prompt_pool import build_pool  # noqa: E402
from serving_plan import plan_passes  # noqa: E402
from sim_device import DeviceClock  # noqa: E402
from stub_model import Replay, StubForward  # noqa: E402
from thread_profile import add_profile_flags, print_profile, profile_thread  # noqa: E402

from specwire.target_service.config import TargetConfig  # noqa: E402
from specwire.target_service.engine import build_engine  # noqa: E402
from specwire.target_service.params import GenerationParams  # noqa: E402
from specwire.target_service.runner.graphs import token_buckets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32,64")
    ap.add_argument("--min-prompts", type=int, default=48)
    ap.add_argument("--pass-factor", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument(
        "--drafter",
        default="none",
        help="none, ngram (in-process) or remote-ngram (a `specwire drafter --drafter ngram`"
        " process on loopback)",
    )
    ap.add_argument("--drafter-branches", type=int, default=-1, help="remote: -1 auto, 0 off")
    ap.add_argument("--drafter-branches-at", default="later", help="remote: later or reply")
    ap.add_argument("--drafter-patience-ms", type=float, default=-1.0, help="remote: -1 auto")
    ap.add_argument("--drafter-lookahead", type=int, default=-1, help="remote: -1 auto")
    ap.add_argument(
        "--drafter-mode", default="stream", help="remote: stream, relay, socket or unary"
    )
    ap.add_argument("--drafter-ask-at", default="auto", help="remote: remote_channel.ASK_AT")
    ap.add_argument(
        "--drafter-wait-rule", default="share", help="remote: remote_channel.WAIT_RULES"
    )
    ap.add_argument("--drafter-max-inflight", type=int, default=2, help="remote: 1-4")
    ap.add_argument(
        "--drafter-spin-ms",
        type=float,
        default=-1.0,
        help="socket mode: both ends poll this long after each event; -1 auto, which is 0 on"
        " this CPU target and 20 on a GPU's (pass 20, with --pin, to poll as a GPU host does)",
    )
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument(
        "--draft-on-device",
        action="store_true",
        help="ngram: the stub's 'device' drafts (needs --replay; its lookups are timed apart)",
    )
    ap.add_argument(
        "--pipeline-drafts",
        action="store_true",
        help="with --draft-on-device: drafting steps launched before the one before is read",
    )
    ap.add_argument(
        "--pipeline-choice",
        default="auto",
        help="with --pipeline-drafts: measured | always | auto (TargetConfig.pipeline_choice)",
    )
    ap.add_argument("--two-batch-rows", type=int, default=0)
    ap.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="simulate a device: each step takes this long (plus --device-us-per-token)",
    )
    ap.add_argument("--device-us-per-token", type=float, default=0.0)
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="with a simulated device: the adaptive draft-length policy, its cost table seeded"
        " from the device (as the GPU's is from graph replays); else static K as on the CPU",
    )
    ap.add_argument(
        "--replay",
        metavar="OUTPUTS.json[.gz]",
        help="recorded greedy outputs (branch_replay.py --save-outputs) as the stub's model",
    )
    add_profile_flags(ap)
    ap.add_argument(
        "--draft-lengths",
        action="store_true",
        help="print how many drafts each drafting row got (0 = a step that went without)",
    )
    ap.add_argument(
        "--gc-threshold", type=int, default=None, help="gc.set_threshold(N) after warm-up"
    )
    ap.add_argument(
        "--speculation-off",
        action="store_true",
        help="every request with speculation disabled (serving.py's 'off' passes): what a"
        " drafter costs the steps of requests that do not speculate",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="this process on CPU 0 and the drafter service on CPU 1 (taskset): a drafter with"
        " a core of its own, as on a GPU host, instead of both fighting over the dev VM's two",
    )
    args = ap.parse_args()
    if args.draft_on_device and not args.replay:
        ap.error("--draft-on-device needs --replay (the stub drafts from the recordings)")
    if args.speculation_off and not args.replay:
        ap.error("--speculation-off needs --replay")
    sys.setswitchinterval(5e-4)  # as `specwire target` sets it
    if args.pin:
        os.sched_setaffinity(0, {0})  # this process (the target's threads) on CPU 0
    drafter, service, sock = args.drafter, None, ""
    if drafter == "remote-ngram":
        cmd = [sys.executable, "-m", "specwire.common.cli", "drafter", "--host", "127.0.0.1"]
        if args.pin:  # the drafter on CPU 1 (it inherits nothing: started before the pin)
            cmd = ["taskset", "-c", "1", *cmd]
        cmd += ["--port", "0", "--drafter", "ngram"]  # its default cap: room for the look-ahead
        if args.drafter_mode == "socket":  # the same service, on a unix socket too
            sock = f"{tempfile.mkdtemp(prefix='specwire-')}/drafter.sock"
            cmd += ["--socket", sock]
        env = {"PYTHONPATH": str(ROOT)}
        service, m = start_service(cmd, env, r"listening on (\S+):(\d+)", 60, cwd=ROOT)
        drafter = f"grpc://127.0.0.1:{m.group(2)}"
    cfg = TargetConfig(
        model="tiny-random",
        drafter=drafter,
        drafter_branches=args.drafter_branches,
        drafter_branches_at=args.drafter_branches_at,
        drafter_patience_ms=args.drafter_patience_ms,
        drafter_lookahead=args.drafter_lookahead,
        drafter_mode=args.drafter_mode,
        drafter_socket=sock,
        drafter_ask_at=args.drafter_ask_at,
        drafter_wait_rule=args.drafter_wait_rule,
        drafter_max_inflight=args.drafter_max_inflight,
        drafter_spin_ms=args.drafter_spin_ms,
        max_draft_len=args.max_draft_len,
        draft_on_device=args.draft_on_device,
        pipeline_drafts=args.pipeline_drafts,
        pipeline_choice=args.pipeline_choice,
        two_batch_rows=args.two_batch_rows,
        max_batch_size=args.max_batch_size,
        max_num_tokens=1024,
        max_context_len=2048,
        progress=False,
    )
    engine = build_engine(cfg)
    runner = engine.runner
    device = None
    if args.device_ms or args.device_us_per_token:
        device = DeviceClock(args.device_ms, args.device_us_per_token)
        if args.adaptive and drafter != "none":
            # As on the GPU: the policy's cost table is the device's step time per captured
            # token count (here the simulated device's), and it decides when to speculate.
            policy = engine.executor.scheduler.policy
            policy.adaptive = True
            policy.seed_costs(
                {b: device.step_s + b * device.token_s for b in token_buckets(cfg.max_num_tokens)}
            )
    vocab = engine.loaded.config.vocab_size
    replay = None
    if args.replay:
        replay = Replay(args.replay, vocab, engine.loaded.tokenizer.eos_token_id)
    truths = replay.truths if replay is not None else None
    stub = StubForward(
        runner,
        vocab,
        cfg.max_num_tokens,
        device,
        truths=truths,
        runner_ngram=(cfg.max_ngram, cfg.ngram_vote),
    )
    runner.forward = stub
    engine.executor.drafts.pads = False  # as on the GPU's varlen backends: real drafts only
    cpu = StepCPU(engine.executor)
    lengths = DraftLengths(engine.executor.drafts) if args.draft_lengths else None
    gc.collect()
    gc.freeze()
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    profiler = profile_thread(engine, args.profile, args.profile_mode, args.profile_interval_ms)
    engine.executor.start()
    prompts = replay.pool if replay is not None else build_pool(True)[0]
    params_for = replay.params(args.max_new_tokens) if replay is not None else None
    if args.speculation_off and params_for is not None:
        with_spec = params_for

        def params_for(name: str, i: int, prompt) -> GenerationParams:
            return dataclasses.replace(with_spec(name, i, prompt), speculate=False)

    levels = [int(c) for c in args.concurrency.split(",") if c]
    plans = plan_passes(prompts, levels, None, 16, args.min_prompts, args.pass_factor)
    pool = futures.ThreadPoolExecutor(4, "tokenize")

    label = args.drafter + (" adaptive" if args.adaptive else "")
    label += " replay" if args.replay else ""
    if service is not None:
        label += f" branches={args.drafter_branches}@{args.drafter_branches_at}"
        label += f" patience={args.drafter_patience_ms:g}"
        label += f" lookahead={args.drafter_lookahead} mode={args.drafter_mode}"
        label += f" ask-at={args.drafter_ask_at} inflight={args.drafter_max_inflight}"
        label += f" spin={args.drafter_spin_ms:g}"
        label += f" wait={args.drafter_wait_rule}"
    label += f" two-batch>={args.two_batch_rows}" if args.two_batch_rows else ""
    label += " device-drafts" if args.draft_on_device else ""
    label += " pipelined" if args.pipeline_drafts else ""
    label += " (measured)" if args.pipeline_drafts and cfg.pipeline_choice == "measured" else ""

    metrics = engine.executor.metrics

    def two_batch_steps() -> float:
        labels = {"model": metrics.model}
        return metrics.registry.get_sample_value("specwire_two_batch_steps_total", labels) or 0

    async def go() -> None:
        for plan in plans:
            t0 = time.perf_counter()
            cpu.reset()
            stub.lookup_s = 0.0
            if device is not None:
                device.idle.clear()  # from this pass on
            halves = two_batch_steps()
            rec = await run_pass(engine, plan, args, pool, params_for=params_for)
            checked = replay.check(rec["outputs"]) if replay is not None else 0
            halves = two_batch_steps() - halves
            print(
                f"host-only {label} "
                f"{plan.name}: {rec['tokens']} tokens in "
                f"{rec['wall_s']:.2f}s ({rec['tok_per_s']:.0f} tok/s), chunks {rec['chunks']}, "
                f"errors {rec['errors']}; executor CPU {cpu.seconds * 1e6 / cpu.steps:.0f} us/step"
                + (
                    f" (of which the stub's device lookups {stub.lookup_s * 1e6 / cpu.steps:.0f})"
                    if args.draft_on_device
                    else ""
                )
                + f" over {cpu.steps} steps ({halves:.0f} two-batch), "
                f"{cpu.seconds * 1e6 / max(rec['tokens'], 1):.1f} us/token "
                f"[{time.perf_counter() - t0:.1f}s]"
                + (f"; {checked} completions equal their recordings" if replay else "")
                + (f"; {device.idle_summary()}" if device is not None else ""),
                flush=True,
            )

    try:
        asyncio.run(go())
        if lengths is not None:
            print(f"host-only {label}: {lengths.summary()}", flush=True)
        if service is not None:
            print(f"host-only {label}: drafter counters {engine.drafter.counters()}", flush=True)
            timings = engine.drafter.timings()  # the auto patience's view (EMAs)
            ms = ", ".join(f"{k} {v * 1e3:.2f} ms" if v else f"{k} n/a" for k, v in timings.items())
            print(f"host-only {label}: {ms} (EMAs)")
        choice = engine.executor.scheduler.policy.choice
        if choice is not None:  # --pipeline-choice measured: what each load measured
            snap = choice.snapshot()
            rates = ", ".join(
                f"{v}@{rows} {r:.0f} ({snap['windows'][(v, rows)]} windows)"
                for (v, rows), r in sorted(snap["rates"].items(), key=lambda x: x[0][::-1])
            )
            print(f"host-only {label}: pipelining steps {snap['steps']}; tok/s/row {rates}")
    finally:
        engine.shutdown()
        pool.shutdown()
        if service is not None:
            stop_service(service)
    print_profile(profiler, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
