"""The `specwire` command. Each subsystem contributes its subcommands:

    specwire target    ...   target service (specwire/target_service/cli.py)
    specwire drafter   ...   drafter service (specwire/drafter_service/cli.py)
    specwire generate  ...   a client call to a running target (specwire/common/client_cli.py)
    specwire demo      ...   start a target, generate, print text and speculation stats
    specwire gateway   ...   OpenAI-compatible HTTP API in front of a target (specwire/gateway/)

Errors a user can fix (bad model name, bad flag, unreachable server) print one line to stderr
and exit non-zero; no traceback wall. Logs go to stderr as text or, with `--log-format json`
(SPECWIRE_LOG_FORMAT=json), one JSON object per line.
"""

from __future__ import annotations

import os

# gRPC core logs (e.g. "chttp2_transport.cc ... GOAWAY") go straight to stderr from C++; keep
# only its errors unless the user asked for more. Set before anything imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("GRPC_TRACE", "")

import argparse  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from importlib import metadata  # noqa: E402

from specwire.common.cli_env import add_env_flag  # noqa: E402
from specwire.common.errors import UserError  # noqa: E402

# (module, what it adds). Each module has `register(subparsers)` which adds parsers whose
# `func` default is called with the parsed args and returns an exit code.
_SUBCOMMAND_MODULES = (
    "specwire.target_service.cli",
    "specwire.drafter_service.cli",
    "specwire.common.client_cli",
    "specwire.gateway.cli",
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def version() -> str:
    try:
        return metadata.version("specwire")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwire", description="Speculative decoding served as two gRPC microservices."
    )
    parser.add_argument("--version", action="version", version=f"specwire {version()}")
    add_env_flag(
        parser,
        "--log-level",
        "SPECWIRE_LOG_LEVEL",
        "WARNING",
        "python logging level",
        str.upper,
        choices=LOG_LEVELS,
    )
    add_env_flag(
        parser,
        "--log-format",
        "SPECWIRE_LOG_FORMAT",
        "text",
        "text | json (one JSON object per line)",
        choices=("text", "json"),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except UserError as exc:  # e.g. a bad SPECWIRE_* environment value
        print(f"specwire: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"specwire: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
