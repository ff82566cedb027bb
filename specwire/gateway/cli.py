"""`specwire gateway`: serve the OpenAI-compatible HTTP API in front of a target."""

from __future__ import annotations

import argparse
import socket

from specwire.common.cli_env import env_default as env
from specwire.common.errors import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "gateway", help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"
    )
    p.add_argument(
        "--target",
        default=env("SPECWIRE_TARGET", "127.0.0.1:50051"),
        help="HOST:PORT of the target's gRPC API",
    )
    p.add_argument("--host", default=env("SPECWIRE_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument(
        "--port",
        type=int,
        default=env("SPECWIRE_GATEWAY_PORT", 8000, int),
        help="0 picks a free port",
    )
    p.add_argument(
        "--model-name",
        default=env("SPECWIRE_MODEL_NAME", None),
        help="model id the API reports (default: the target's model, from GetModelInfo)",
    )
    p.add_argument(
        "--api-key-file",
        default=env("SPECWIRE_API_KEY_FILE", None),
        help="require `Authorization: Bearer KEY` with the key in this file",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specwire.gateway.app import create_app
    from specwire.gateway.config import GatewayConfig

    cfg = GatewayConfig(
        target=args.target,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        api_key_file=args.api_key_file,
    )
    app = create_app(cfg)
    # Listen first, so that port 0 works and the printed address is the real one.
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
        sock.listen(2048)  # connections made as soon as the line below is printed wait here
    except OSError as exc:
        raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from exc
    port = sock.getsockname()[1]
    print(
        f"specwire gateway listening on {cfg.host}:{port} (target {cfg.target})",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
    return 0
