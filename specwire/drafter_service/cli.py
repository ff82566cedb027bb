"""`specwire drafter`: run the drafter service.

Every flag can also come from an environment variable (for docker compose); a flag on the
command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse

from specwire.common.cli_env import Flag, add_config_flags, add_env_flag, config_kwargs
from specwire.common.security import add_server_flags, server_security_from_args
from specwire.drafter_service.config import DRAFTER_KINDS, DrafterServiceConfig

# The DrafterServiceConfig fields a user sets; type and default come from the field. The
# service's own host/port/device/... variables carry DRAFTER so one environment can hold both
# services' settings.
FLAGS = {
    "host": Flag("address to listen on", env="SPECWIRE_DRAFTER_HOST"),
    "port": Flag("port to listen on (0 = any free port)", env="SPECWIRE_DRAFTER_PORT"),
    "drafter": Flag(DRAFTER_KINDS),
    "max_draft_len": Flag("most draft tokens per sequence per reply (drafts + look-ahead)"),
    "max_ngram": Flag("ngram: longest n-gram matched"),
    "ngram_vote": Flag("ngram: earlier occurrences of the match whose next token votes"),
    "prefer": Flag(
        "ngram: which earlier matches vote first and win a tie",
        env="SPECWIRE_NGRAM_PREFER",
        choices=("latest", "oldest"),
    ),
    "device": Flag("model drafters: cpu | cuda[:N]", env="SPECWIRE_DRAFTER_DEVICE"),
    "dtype": Flag(
        "model drafters: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | ...",
        env="SPECWIRE_DRAFTER_DTYPE",
    ),
    "kv_blocks": Flag(
        "model drafters: KV cache blocks shared by all sessions", env="SPECWIRE_DRAFTER_KV_BLOCKS"
    ),
    "draft_probs_top_n": Flag(
        "model drafters: 0 = greedy, no draft probabilities; N > 0 = sample each draft token "
        "from the top-N softmax and send that distribution (for rejection sampling)"
    ),
    "seed": Flag("seed for sampling drafters", env="SPECWIRE_DRAFTER_SEED"),
    "session_ttl_s": Flag(
        "seconds an idle session is kept", flag="--session-ttl", env="SPECWIRE_SESSION_TTL"
    ),
    "delay_ms": Flag(
        "injected delay per draft call, for tests and benchmarks", env="SPECWIRE_DRAFTER_DELAY_MS"
    ),
    "max_sessions": Flag("sessions held at once"),
    "max_session_tokens": Flag("tokens one session may hold"),
    "max_streams_per_peer": Flag(
        "concurrent DraftStreams per caller (token, client certificate or IP address)"
    ),
    "socket": Flag(
        "also serve DraftStream on this unix socket (mode 0600), for a target on this host"
        " in socket mode: no gRPC on the round trip",
        env="SPECWIRE_DRAFTER_SOCKET",
    ),
    "spin_ms": Flag(
        "after each event, poll this long before sleeping, so a target's question finds the"
        " service awake (a shorter round trip, mostly on the socket; a core stays busy while"
        " targets draft); 0 (or -1, a target's auto): only as socket connections ask",
        env="SPECWIRE_DRAFTER_SPIN_MS",
    ),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drafter",
        help="run the drafter service",
        description="Serve draft tokens over gRPC (specwire.v1.DrafterService).",
    )
    add_config_flags(p, DrafterServiceConfig, FLAGS)
    add_server_flags(p, prefix="SPECWIRE_DRAFTER")
    add_env_flag(
        p,
        "--drain-timeout",
        "SPECWIRE_DRAIN_TIMEOUT",
        30.0,
        "on SIGTERM, seconds open calls get to finish",
        float,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwire.common.transport import StopSignal
    from specwire.drafter_service.server import serve

    config = DrafterServiceConfig(
        **config_kwargs(args, FLAGS), security=server_security_from_args(args)
    )
    running = serve(config)
    stop = StopSignal()  # before the listening line: whoever waits for it may signal at once
    also = f" and {config.socket}" if config.socket else ""
    print(
        f"specwire drafter listening on {config.host}:{running.port}{also} "
        f"(drafter={running.engine.drafter.name} security={config.security.describe()})",
        flush=True,
    )
    stop.wait()
    running.drain(args.drain_timeout)
    return 0
