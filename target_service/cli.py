"""`specwire target`: serve specwire.v1.Generation."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING

from common.cli_env import env_default as env
from common.security import (
    add_client_flags,
    add_server_flags,
    client_security_from_args,
    server_security_from_args,
)

if TYPE_CHECKING:  # torch is imported only when a command runs, so --help is instant
    from target_service.config import TargetConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=env("SPECWIRE_MODEL", "smollm2-135m"),
        help="smollm2-135m (default), tiny-random, a HF folder or a .gguf file",
    )
    p.add_argument(
        "--drafter",
        default=env("SPECWIRE_DRAFTER", "ngram"),
        help="none | ngram | module:Class | grpc://HOST:PORT",
    )
    p.add_argument("--max-draft-len", type=int, default=env("SPECWIRE_MAX_DRAFT_LEN", 4, int))
    p.add_argument("--max-ngram", type=int, default=env("SPECWIRE_MAX_NGRAM", 3, int))
    p.add_argument("--device", default=env("SPECWIRE_DEVICE", "cpu"), help="cpu | cuda[:N]")
    p.add_argument(
        "--dtype",
        default=env("SPECWIRE_DTYPE", None),
        help="float32 | bfloat16 | float16 (default float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument(
        "--no-cuda-graphs", action="store_true", default=env("SPECWIRE_NO_CUDA_GRAPHS", False, bool)
    )
    p.add_argument(
        "--attention",
        default=env("SPECWIRE_ATTENTION", "auto"),
        help="auto (triton on CUDA, sdpa on CPU) | triton | sdpa",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        default=env("SPECWIRE_EXACT", False, bool),
        help="GPU: batch-invariant kernels, so bf16 output with speculation equals without it",
    )
    p.add_argument(
        "--draft-policy",
        default=env("SPECWIRE_DRAFT_POLICY", "adaptive"),
        help="adaptive (K per step from measured costs and acceptance; GPU) | static",
    )
    p.add_argument("--max-batch-size", type=int, default=env("SPECWIRE_MAX_BATCH_SIZE", 16, int))
    p.add_argument("--max-num-tokens", type=int, default=env("SPECWIRE_MAX_NUM_TOKENS", 1024, int))
    p.add_argument(
        "--max-context-len", type=int, default=env("SPECWIRE_MAX_CONTEXT_LEN", 2048, int)
    )
    p.add_argument("--num-kv-blocks", type=int, default=env("SPECWIRE_NUM_KV_BLOCKS", 0, int))
    p.add_argument(
        "--drafter-mode",
        default=env("SPECWIRE_DRAFTER_MODE", "stream"),
        help="remote drafters: stream (default) | unary",
    )
    p.add_argument(
        "--drafter-deadline-ms",
        type=float,
        default=env("SPECWIRE_DRAFTER_DEADLINE_MS", 50.0, float),
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    # The target -> drafter link (grpc:// drafters): --drafter-tls-ca, --drafter-tls-cert,
    # --drafter-tls-key, --drafter-token-file (or env SPECWIRE_DRAFTER_TOKEN).
    add_client_flags(p, flag="drafter-", env="SPECWIRE_DRAFTER_CLIENT")
    limits = (
        ("--max-prompt-bytes", "SPECWIRE_MAX_PROMPT_BYTES", 1 << 20, "UTF-8 bytes of a prompt"),
        ("--max-stop-strings", "SPECWIRE_MAX_STOP_STRINGS", 16, "stop strings per request"),
        ("--max-stop-len", "SPECWIRE_MAX_STOP_LEN", 256, "characters per stop string"),
        ("--max-queue", "SPECWIRE_MAX_QUEUE", 256, "requests queued beyond --max-batch-size"),
    )
    for flag, var, default, text in limits:
        p.add_argument(flag, type=int, default=env(var, default, int), help=f"most {text}")


def config_from_args(args: argparse.Namespace) -> TargetConfig:
    from target_service.config import TargetConfig

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return TargetConfig(
        model=args.model,
        drafter=args.drafter,
        max_draft_len=args.max_draft_len,
        max_ngram=args.max_ngram,
        device=args.device,
        dtype=dtype,
        cuda_graphs=not args.no_cuda_graphs,
        attention=args.attention,
        draft_policy=args.draft_policy,
        exact=args.exact,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_context_len=args.max_context_len,
        num_kv_blocks=args.num_kv_blocks,
        drafter_mode=args.drafter_mode,
        drafter_deadline_ms=args.drafter_deadline_ms,
        progress=not args.no_progress,
        drafter_security=client_security_from_args(
            args, flag="drafter-", token_env="SPECWIRE_DRAFTER_TOKEN"
        ),
        max_prompt_bytes=args.max_prompt_bytes,
        max_stop_strings=args.max_stop_strings,
        max_stop_len=args.max_stop_len,
        max_queue=args.max_queue,
    )


def register(sub) -> None:
    p = sub.add_parser("target", help="serve the target model (specwire.v1.Generation)")
    p.add_argument("--host", default=env("SPECWIRE_HOST", "127.0.0.1"))
    p.add_argument(
        "--port", type=int, default=env("SPECWIRE_PORT", 50051, int), help="0 picks a free port"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env("SPECWIRE_METRICS_PORT", 0, int),
        help="serve Prometheus metrics on this port (0 = off)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=env("SPECWIRE_DRAIN_TIMEOUT", 30.0, float),
        help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled",
    )
    add_server_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from target_service.engine import build_engine
    from target_service.server import TargetServer

    cfg = config_from_args(args)
    server = TargetServer(args.host, args.port, server_security_from_args(args))
    server.start()
    print(
        f"specwire target starting on {args.host}:{server.port} (loading {cfg.model})",
        file=sys.stderr,
        flush=True,
    )
    try:
        engine = build_engine(cfg)
    except BaseException:
        server.stop(0)
        raise
    server.attach(engine)
    if args.metrics_port:
        engine.executor.metrics.serve(args.metrics_port, args.host)
    print(
        f"specwire target listening on {args.host}:{server.port} "
        f"(model={cfg.model} drafter={cfg.drafter} K={engine.executor.max_draft_len} "
        f"device={cfg.device} graphs={engine.runner.graphs is not None} "
        f"security={server.security.describe()})",
        flush=True,
    )
    stopped = threading.Event()

    def _stop(*_):
        stopped.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The supervisor: a dead executor turns health NOT_SERVING (in `attach`) and ends the
    # process with a non-zero code, so an orchestrator restarts it.
    engine.executor.on_death = lambda exc: (server.mark_dead(exc), stopped.set())
    if engine.executor.death is not None:  # died before the hook was set
        stopped.set()
    stopped.wait()
    death = engine.executor.death
    if death is not None:
        server.stop(0)
        print(f"specwire: error: the executor stopped: {death!r}", file=sys.stderr, flush=True)
        return 1
    print(f"specwire target draining (up to {args.drain_timeout:g}s)", file=sys.stderr, flush=True)
    server.drain(args.drain_timeout)
    return 0
