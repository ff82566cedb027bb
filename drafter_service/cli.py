"""`specwire drafter`: run the drafter service.

Every flag can also come from an environment variable (for docker compose); a flag on the
command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import signal
import threading

from common.cli_env import env_default
from common.security import add_server_flags, server_security_from_args
from drafter_service.config import DRAFTER_KINDS, DrafterServiceConfig

_DEFAULTS = DrafterServiceConfig()

# (flag, environment variable, type, config field, help)
_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--host", "SPECWIRE_DRAFTER_HOST", str, "host", "address to listen on"),
    ("--port", "SPECWIRE_DRAFTER_PORT", int, "port", "port to listen on (0 = any free port)"),
    ("--drafter", "SPECWIRE_DRAFTER", str, "drafter", DRAFTER_KINDS),
    (
        "--max-draft-len",
        "SPECWIRE_MAX_DRAFT_LEN",
        int,
        "max_draft_len",
        "most draft tokens per sequence per step",
    ),
    ("--max-ngram", "SPECWIRE_MAX_NGRAM", int, "max_ngram", "ngram: longest n-gram matched"),
    (
        "--prefer",
        "SPECWIRE_NGRAM_PREFER",
        str,
        "prefer",
        "ngram: which earlier match wins (latest | oldest)",
    ),
    ("--device", "SPECWIRE_DRAFTER_DEVICE", str, "device", "model drafters: cpu | cuda[:N]"),
    (
        "--dtype",
        "SPECWIRE_DRAFTER_DTYPE",
        str,
        "dtype",
        "model drafters: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | ...",
    ),
    (
        "--kv-blocks",
        "SPECWIRE_DRAFTER_KV_BLOCKS",
        int,
        "kv_blocks",
        "model drafters: KV cache blocks shared by all sessions",
    ),
    (
        "--draft-probs-top-n",
        "SPECWIRE_DRAFT_PROBS_TOP_N",
        int,
        "draft_probs_top_n",
        "model drafters: 0 = greedy, no draft probabilities (default); N > 0 = sample each draft "
        "token from the top-N softmax and send that distribution (for rejection sampling)",
    ),
    ("--seed", "SPECWIRE_DRAFTER_SEED", int, "seed", "seed for sampling drafters"),
    (
        "--session-ttl",
        "SPECWIRE_SESSION_TTL",
        float,
        "session_ttl_s",
        "seconds an idle session is kept",
    ),
    (
        "--delay-ms",
        "SPECWIRE_DRAFTER_DELAY_MS",
        float,
        "delay_ms",
        "injected delay per draft call, for tests and benchmarks",
    ),
    ("--max-sessions", "SPECWIRE_MAX_SESSIONS", int, "max_sessions", "sessions held at once"),
    (
        "--max-session-tokens",
        "SPECWIRE_MAX_SESSION_TOKENS",
        int,
        "max_session_tokens",
        "tokens one session may hold",
    ),
    (
        "--max-streams-per-peer",
        "SPECWIRE_MAX_STREAMS_PER_PEER",
        int,
        "max_streams_per_peer",
        "concurrent DraftStreams per caller (token, client certificate or IP address)",
    ),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drafter",
        help="run the drafter service",
        description="Serve draft tokens over gRPC (specwire.v1.Drafter).",
    )
    for flag, env, typ, fieldname, text in _FLAGS:
        default = env_default(env, getattr(_DEFAULTS, fieldname), typ)
        p.add_argument(
            flag,
            type=typ,
            default=default,
            dest=fieldname,
            help=f"{text} [env {env}; default %(default)s]",
        )
    add_server_flags(p, prefix="SPECWIRE_DRAFTER")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=env_default("SPECWIRE_DRAIN_TIMEOUT", 30.0, float),
        help="on SIGTERM, seconds open calls get to finish [env SPECWIRE_DRAIN_TIMEOUT]",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from drafter_service.server import serve

    config = DrafterServiceConfig(
        **{f[3]: getattr(args, f[3]) for f in _FLAGS}, security=server_security_from_args(args)
    )
    running = serve(config)
    print(
        f"specwire drafter listening on {config.host}:{running.port} "
        f"(drafter={running.engine.drafter.name} security={config.security.describe()})",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.drain(args.drain_timeout)
    return 0
