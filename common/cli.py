"""The `specwire` command. Each subsystem contributes its subcommands:

    specwire target    ...   target service (target_service/cli.py)
    specwire drafter   ...   drafter service (drafter_service/cli.py)
    specwire generate  ...   a client call to a running target (common/client_cli.py)
    specwire demo      ...   start a target, generate, print text and speculation stats
    specwire gateway   ...   OpenAI-compatible HTTP API in front of a target (gateway/)

Errors a user can fix (bad model name, bad flag, unreachable server) print one line to stderr
and exit non-zero; no traceback wall.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from common.errors import UserError

# (module, what it adds). Each module has `register(subparsers)` which adds parsers whose
# `func` default is called with the parsed args and returns an exit code.
_SUBCOMMAND_MODULES = (
    "target_service.cli",
    "drafter_service.cli",
    "common.client_cli",
    "gateway.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwire", description="Speculative decoding served as two gRPC microservices."
    )
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UserError as exc:  # e.g. a bad SPECWIRE_* environment value
        print(f"specwire: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"specwire: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
