"""`specwire generate` (client of a running target) and `specwire demo` (all in one)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from specwire.common.cli_env import add_env_flag
from specwire.common.errors import UserError
from specwire.common.security import ClientSecurity, add_client_flags, client_security_from_args


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate from a running target")
    add_env_flag(g, "--target", "SPECWIRE_TARGET", "127.0.0.1:50051", "HOST:PORT of the target")
    # --tls-ca, --tls-cert, --tls-key, --token-file (or env SPECWIRE_TOKEN)
    add_client_flags(g, env="SPECWIRE_CLIENT")
    _add_request_flags(g)
    g.set_defaults(func=run_generate)

    d = sub.add_parser(
        "demo",
        help="start a target with the default model and the n-gram "
        "drafter, generate, and show the text and acceptance statistics",
    )
    from specwire.target_service.cli import add_engine_flags

    add_engine_flags(d)
    d.add_argument("--port", type=int, default=0)
    _add_request_flags(d, default_prompt=DEMO_PROMPT)
    d.add_argument(
        "--raw-prompt",
        dest="chat",
        action="store_false",
        help="send the prompt as plain text instead of a chat message",
    )
    d.set_defaults(func=run_demo, chat=True)


DEMO_PROMPT = (
    "Rewrite this function so that it uses a list comprehension:\n\n"
    "def squares(numbers):\n    result = []\n    for n in numbers:\n"
    "        result.append(n * n)\n    return result\n"
)


def _add_request_flags(p: argparse.ArgumentParser, default_prompt: str | None = None) -> None:
    source = p.add_mutually_exclusive_group(required=default_prompt is None)
    source.add_argument(
        "--prompt",
        default=default_prompt,
        help="the prompt, sent exactly as given (no escape processing: use $'...' in the "
        "shell or --prompt-file for real newlines)",
    )
    source.add_argument(
        "--prompt-file",
        metavar="PATH",
        help="read the prompt from this UTF-8 file, byte for byte ('-' = standard input)",
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-speculation", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def read_prompt_file(path: str) -> str:
    """The file's (or stdin's, for '-') UTF-8 text exactly: no newline translation."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
        return raw.decode("utf-8")
    except OSError as exc:
        raise UserError(f"--prompt-file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompt-file {path}: not UTF-8 text ({exc.reason})") from exc


def _request_kwargs(args) -> dict:
    prompt = args.prompt if args.prompt_file is None else read_prompt_file(args.prompt_file)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        speculate=not args.no_speculation,
    )
    if args.chat:
        kw["chat"] = [{"role": "user", "content": prompt}]
        return kw
    return {"prompt": prompt, **kw}


def _print_stats(spec: dict, finish: str, out) -> None:
    print(
        f"\n--- finish: {finish}; decode steps {spec['steps']}, drafted "
        f"{spec['draft_tokens']}, accepted {spec['accepted_tokens']} "
        f"(acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
        f"{spec['mean_accepted_length']:.2f} tokens/step), histogram {spec['histogram']}",
        file=out,
    )


def generate_to_console(address: str, args, security: ClientSecurity | None = None) -> int:
    from specwire.common.client import (
        FINISH_NAMES,
        GenerationClient,
        build_request,
        spec_stats_dict,
    )

    kwargs = _request_kwargs(args)
    with GenerationClient(address, security=security) as client:
        try:
            if args.json:
                res = client.generate(**kwargs)
                print(json.dumps(res.to_json()))
                return 0
            for resp in client.stream(build_request(**kwargs)):
                kind = resp.WhichOneof("response")
                if kind == "chunk":
                    sys.stdout.write(resp.chunk.text)
                    sys.stdout.flush()
                elif kind == "error":
                    raise UserError(f"generation failed: {resp.error.message}")
                else:
                    c = resp.complete
                    _print_stats(
                        spec_stats_dict(c.speculation),
                        FINISH_NAMES.get(c.finish_reason, "?"),
                        sys.stdout,
                    )
            return 0
        except grpc.RpcError as exc:
            raise UserError(f"{address}: {exc.code().name}: {exc.details()}") from None


def run_generate(args) -> int:
    return generate_to_console(args.target, args, client_security_from_args(args))


def run_demo(args) -> int:
    from specwire.target_service.cli import config_from_args
    from specwire.target_service.engine import build_engine
    from specwire.target_service.server import TargetServer

    cfg = config_from_args(args)
    server = TargetServer("127.0.0.1", args.port)
    server.start()
    try:
        print(
            f"loading {cfg.model} (drafter {cfg.drafter}, K={cfg.max_draft_len}) ...",
            file=sys.stderr,
            flush=True,
        )
        server.attach(build_engine(cfg))
        address = f"127.0.0.1:{server.port}"
        print(f"target serving on {address}; prompt:\n{args.prompt}\n--- output:", flush=True)
        if args.max_new_tokens is None:
            args.max_new_tokens = 96
        return generate_to_console(address, args)
    finally:
        server.stop(0)
