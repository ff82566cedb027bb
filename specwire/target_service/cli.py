"""`specwire target`: serve specwire.v1.GenerationService."""

from __future__ import annotations

import argparse
import gc
import sys

from specwire.common.cli_env import Flag, add_config_flags, add_env_flag, config_kwargs
from specwire.common.errors import UserError
from specwire.common.security import (
    add_client_flags,
    add_server_flags,
    client_security_from_args,
    server_security_from_args,
)
from specwire.target_service.config import PIPELINE_CHOICES, TargetConfig
from specwire.target_service.drafters.remote_channel import (
    ASK_AT,
    BRANCHES_AT,
    MODES,
    WAIT_RULES,
)

# The TargetConfig fields a user sets; flag, variable, type and default come from the field.
ENGINE_FLAGS = {
    "model": Flag("smollm2-135m, tiny-random, a HF folder or a .gguf file"),
    "drafter": Flag("none | ngram | model:NAME | module:Class | grpc://HOST:PORT"),
    "max_draft_len": Flag(
        "most draft tokens per sequence per step (-1: auto, 8 on a CUDA device with graphs and"
        " the adaptive policy, else 4)"
    ),
    "max_ngram": Flag("ngram drafter: longest n-gram matched"),
    "ngram_vote": Flag(
        "ngram drafter: earlier occurrences of the match whose next token votes (1: the latest"
        " alone)"
    ),
    "draft_on_device": Flag(
        "ngram drafter: the lookup runs on the device inside the step (one Triton launch on"
        " CUDA), off the host's critical path; same drafts as on the host (auto: on for CUDA)"
    ),
    "pipeline_drafts": Flag(
        "ngram drafter on the device or a remote drafter: a drafting step is launched before"
        " the one before it is read (greedy requests), its rows moved on the device by what"
        " that step accepted; the host's work (and a remote drafter's round trip) leaves the"
        " critical path (auto: on CUDA where the lookup runs on the device; a remote drafter's"
        " pipelined steps are experimental)"
    ),
    "pipeline_choice": Flag(
        "where drafting steps may be pipelined, under the adaptive policy: measured (each load"
        " runs its drafting steps pipelined or synchronous, whichever measured faster there) |"
        " always (auto: measured for a remote drafter, always for the device lookup)",
        choices=PIPELINE_CHOICES,
    ),
    "device": Flag("cpu | cuda[:N]"),
    "dtype": Flag(
        "float32 | bfloat16 | float16 (unset: float32 on CPU, bfloat16 on GPU)", default=None
    ),
    "cuda_graphs": Flag("run every step eagerly, without CUDA graphs"),
    "overlap": Flag("run every step synchronously (no step launched before the last is read)"),
    "two_batch_rows": Flag(
        "speculative steps alternate two halves of the batch when at least this many requests"
        " are running or waiting, one half prepared while the device runs the other (greedy"
        " requests; 0 = never; experimental, not yet measured on a GPU)"
    ),
    "attention": Flag(
        "auto (triton on CUDA, sdpa on CPU) | triton | sdpa", choices=("auto", "triton", "sdpa")
    ),
    "exact": Flag(
        "GPU: batch-invariant kernels, so bf16 output with speculation equals without: on | off"
        " | auto (on for bf16/fp16 models whose GEMM shapes are of a model it was measured to"
        " cost <= 10%% on: SmolLM2-135M, SmolLM2-360M, Qwen2.5-1.5B)",
        choices=("auto", "on", "off"),
    ),
    "fused": Flag(
        "GPU, experimental: norms and SiLU·up folded into Triton GEMMs for steps of <= 16 tokens"
        " (slower than the default on the H200 so far: bench/RESULTS.md)"
    ),
    "draft_policy": Flag(
        "adaptive (K per step from measured costs and acceptance; GPU) | static",
        choices=("adaptive", "static"),
    ),
    "max_batch_size": Flag("most requests in one step"),
    "max_num_tokens": Flag("most tokens (prompt chunks + drafts) in one step"),
    "max_context_len": Flag("prompt + generated tokens per request"),
    "num_kv_blocks": Flag("KV cache blocks (0 = enough for max-batch-size full contexts)"),
    "drafter_mode": Flag(
        "remote drafters: a DraftStream (stream), the same held by a relay process (relay), "
        "its frames on the drafter service's unix socket on this host, no gRPC on the round "
        "trip (socket), or unary calls; auto: socket when a drafter socket is named, else stream",
        choices=("auto", *MODES),
    ),
    "drafter_socket": Flag(
        "remote drafters in socket mode: the unix socket that the drafter service named by"
        " the drafter flag serves (the path it was given as its socket)"
    ),
    "drafter_spin_ms": Flag(
        "remote drafters in socket mode: a step waiting for a reply polls the socket this long"
        " (at most its wait) before it sleeps, and asks the drafter service to poll as long"
        " after each event while connected, so neither end must be woken (a busy core each)"
        "; -1 = auto: 20 on a CUDA device, else 0",
        env="SPECWIRE_DRAFTER_SPIN_MS",
    ),
    "drafter_deadline_ms": Flag("remote drafters: wait this long for drafts, then go without"),
    "drafter_wait_s": Flag(
        "remote drafters, at start-up: wait this long for a drafter that is not up yet, then"
        " refuse to start (once running, a drafter that goes away only costs drafts)"
    ),
    "drafter_patience_ms": Flag(
        "remote drafters: wait this long for drafts asked for as the previous step committed,"
        " then go without and keep the late reply for the steps after"
        " (-1 = auto: only if due within 30%% of a drafting step, at most that long)"
    ),
    "drafter_lookahead": Flag(
        "remote drafters: draft tokens asked past a step's own, used when it accepts them all"
        " (-1 = auto: 4(K+1) for an n-gram drafter or one offering branches, else 0)"
    ),
    "drafter_branches": Flag(
        "remote drafters offering branches: other tokens asked for at the first two draft"
        " positions, each with the drafts after it, so a step that rejects a draft has the"
        " next drafts at once (-1 = auto: 4 while a message carries <= 8 sequences, else 0;"
        " only when the look-ahead the drafter's max-draft-len leaves is at least 2)"
    ),
    "drafter_branches_at": Flag(
        "remote drafters, stream modes: the branches in a reply of their own right after the"
        " drafts, so a step never waits for them (later), or in the drafts' reply (reply)",
        choices=BRANCHES_AT,
    ),
    "drafter_ask_at": Flag(
        "remote drafters, auto patience: ask once the next step is launched, off the critical"
        " path, when that step will not use the reply: it would not wait for it, or every"
        " request's drafts come from a kept proposal (auto); the first reason only (timed);"
        " always at the commit (commit); or always at the launch (launch)",
        choices=ASK_AT,
    ),
    "drafter_wait_rule": Flag(
        "remote drafters, auto patience: how long a step waits for a reply on its way: at most"
        " 30%% of a drafting step (share), or as long as its drafts still pay for the wait by"
        " the draft-length policy's measured step costs and acceptance (gain)",
        choices=WAIT_RULES,
    ),
    "drafter_max_inflight": Flag(
        "remote drafters, stream mode: questions the stream may have in flight at once (1-4);"
        " with 2 (default) a step that commits asks again while the previous question is"
        " unanswered"
    ),
    "progress": Flag("no progress bars while loading"),
    "max_prompt_bytes": Flag("most UTF-8 bytes of a prompt (checked before tokenising)"),
    "max_stop_strings": Flag("most stop strings per request"),
    "max_stop_len": Flag("most characters per stop string"),
    "max_queue": Flag("most requests queued beyond the batch size"),
    "stream_interval": Flag(
        "steps per streamed chunk (1 = every step): fewer, larger messages cost the server less"
        " host time per token under load; the first chunk and the last are never held"
    ),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, TargetConfig, ENGINE_FLAGS)
    # The target -> drafter link (grpc:// drafters): --drafter-tls-ca, --drafter-tls-cert,
    # --drafter-tls-key, --drafter-token-file (or env SPECWIRE_DRAFTER_TOKEN).
    add_client_flags(p, flag="drafter-", env="SPECWIRE_DRAFTER_CLIENT")


def config_from_args(args: argparse.Namespace) -> TargetConfig:
    kwargs = config_kwargs(args, ENGINE_FLAGS)
    kwargs["dtype"] = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    kwargs["drafter_security"] = client_security_from_args(
        args, flag="drafter-", token_env="SPECWIRE_DRAFTER_TOKEN"
    )
    return TargetConfig(**kwargs)


def _drafter_mode(cfg: TargetConfig) -> str:
    """How the listening line names a remote drafter's carrier (empty for the others)."""
    if not cfg.drafter.startswith("grpc://"):
        return ""
    return f" ({' '.join(filter(None, (cfg.drafter_mode, cfg.drafter_socket)))})"


def register(sub) -> None:
    p = sub.add_parser("target", help="serve the target model (specwire.v1.GenerationService)")
    add_env_flag(p, "--host", "SPECWIRE_HOST", "127.0.0.1", "address to listen on")
    add_env_flag(p, "--port", "SPECWIRE_PORT", 50051, "port to listen on (0 = any free port)", int)
    add_env_flag(
        p,
        "--metrics-port",
        "SPECWIRE_METRICS_PORT",
        0,
        "serve Prometheus metrics at /metrics on this port (0 = off)",
        int,
    )
    add_env_flag(
        p,
        "--drain-timeout",
        "SPECWIRE_DRAIN_TIMEOUT",
        30.0,
        "on SIGTERM, seconds in-flight requests get to finish before they are cancelled",
        float,
    )
    add_env_flag(
        p,
        "--gil-switch-interval",
        "SPECWIRE_GIL_SWITCH_INTERVAL",
        5e-4,
        "seconds a thread may hold the GIL while the executor waits for it (sys.setswitchinterval)",
        float,
    )
    add_env_flag(
        p,
        "--engine-process",
        "SPECWIRE_ENGINE_PROCESS",
        "auto",
        "run the engine (model, executor) in a child process of its own, so the gRPC front end "
        "and the executor do not share one GIL (auto: on for a CUDA device, where the host "
        "sets the pace under load)",
        choices=("auto", "on", "off"),
    )
    add_server_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not 1e-6 <= args.gil_switch_interval <= 0.1:  # CPython keeps whole microseconds
        raise UserError(
            "--gil-switch-interval must be between 1e-06 and 0.1 seconds, "
            f"got {args.gil_switch_interval}"
        )
    # The executor thread is the critical path, and it gives the GIL up during every CUDA
    # call; with Python's 5 ms switch interval the gRPC loop or the output thread can keep it
    # for milliseconds each time. A short interval bounds that wait, but too short a one makes
    # every thread hand the GIL over mid-work: on the H200 host, host-bound serving ran
    # fastest at 0.5-1 ms and 25 % slower at 0.05 ms (bench/RESULTS.md, round 6).
    sys.setswitchinterval(args.gil_switch_interval)
    own_process = args.engine_process == "on" or (
        args.engine_process == "auto" and cfg.device.startswith("cuda")
    )
    engine_args = dict(
        metrics_port=args.metrics_port,
        metrics_host=args.host,
        switch_interval=args.gil_switch_interval,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    spawned = None
    if own_process:
        # The child first: it imports torch and loads the model while this process imports
        # its own modules and starts listening (one after the other, a GPU start took
        # seconds longer: bench/RESULTS.md, round 56).
        from specwire.target_service.engine_spawn import spawn_engine

        spawned = spawn_engine(cfg, **engine_args)
    try:
        from specwire.target_service.engine import build_engine
        from specwire.target_service.engine_process import EngineProcess
        from specwire.target_service.server import TargetServer

        server = TargetServer(args.host, args.port, server_security_from_args(args))
        server.start()
    except BaseException:
        if spawned is not None:
            spawned.kill()
        raise
    print(
        f"specwire target starting on {args.host}:{server.port} (loading {cfg.model})",
        file=sys.stderr,
        flush=True,
    )
    try:
        if own_process:
            engine = EngineProcess(cfg, spawned=spawned)
            supervised, k, graphs = engine, engine.max_draft_len, engine.graphs
            where = f" engine-pid={engine.pid}"
        else:
            engine = build_engine(cfg)
            supervised, k = engine.executor, engine.executor.max_draft_len
            graphs, where = engine.runner.graphs is not None, ""
    except BaseException:
        server.stop(0)
        raise
    # Everything loaded so far (weights, tokenizer, graphs) lives as long as the process:
    # keep it out of the cyclic collector's full passes, which otherwise stall a step now
    # and then for as long as it takes to walk it all.
    gc.collect()
    gc.freeze()
    # From here SIGTERM drains (before the listening line: whoever waits for it may signal
    # at once); during the load above it still ends the process outright.
    from specwire.common.transport import StopSignal

    stopped = StopSignal()
    server.attach(engine)
    if args.metrics_port and not own_process:  # the engine process serves its own
        engine.executor.metrics.serve(args.metrics_port, args.host)
    print(
        f"specwire target listening on {args.host}:{server.port} "
        f"(model={cfg.model} drafter={cfg.drafter}{_drafter_mode(cfg)} K={k} "
        f"device={cfg.device} graphs={graphs} "
        f"security={server.security.describe()}{where})",
        flush=True,
    )
    # The supervisor: a dead executor (or engine process) turns health NOT_SERVING (in
    # `attach`) and ends the process with a non-zero code, so an orchestrator restarts it.
    supervised.on_death = lambda exc: (server.mark_dead(exc), stopped.set())
    if supervised.death is not None:  # died before the hook was set
        stopped.set()
    stopped.wait()
    death = supervised.death
    if death is not None:
        server.stop(0)
        why = str(death) if own_process else f"the executor stopped: {death!r}"
        print(f"specwire: error: {why}", file=sys.stderr, flush=True)
        return 1
    print(f"specwire target draining (up to {args.drain_timeout:g}s)", file=sys.stderr, flush=True)
    server.drain(args.drain_timeout)
    return 0
