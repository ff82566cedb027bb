"""Transport security settings for servers and clients: TLS, mutual TLS and bearer tokens.

Servers: `ServerSecurity` (certificate, key, optional client CA = mTLS, accepted tokens).
Clients: `ClientSecurity` (CA to trust, optional client certificate, token to send).
`specwire/common/transport.py` turns them into a gRPC server or channel; this module also holds the
server-side token check (`AuthInterceptor`) and `peer_identity`, the name a caller is known by
(its token, its certificate, or failing both its connection).

Tokens are compared with `hmac.compare_digest` (constant time). Health checks are exempt from
the token check so orchestrators can probe without secrets (they reveal only SERVING or not);
TLS, when on, still applies to them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specwire.common.cli_env import add_env_flag
from specwire.common.errors import UserError

TOKEN_ENV = "SPECWIRE_AUTH_TOKEN"  # servers: the accepted token (or use --auth-token-file)
CLIENT_TOKEN_ENV = "SPECWIRE_TOKEN"  # clients: the token to send
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"{what} {path!r}: {exc.strerror}") from None


def read_tokens(path: str | None) -> tuple[str, ...]:
    """Tokens in a file: one per line; blank lines and lines starting with # are ignored."""
    data = _read(path, "--auth-token-file")
    if data is None:
        return ()
    lines = (line.strip() for line in data.decode().splitlines())
    tokens = tuple(t for t in lines if t and not t.startswith("#"))
    if not tokens:
        raise UserError(f"--auth-token-file {path!r} holds no token")
    return tokens


def token_identity(token: str) -> str:
    """A caller's name derived from its token (never the token itself: names reach logs)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSecurity:
    """How a service accepts connections. Empty = plaintext without auth (loopback only unless
    `insecure`)."""

    cert: bytes | None = None  # PEM server certificate chain
    key: bytes | None = field(default=None, repr=False)  # PEM private key
    client_ca: bytes | None = None  # PEM CA: clients must present a certificate it signed
    tokens: tuple[str, ...] = field(default=(), repr=False)  # accepted bearer tokens
    insecure: bool = False  # allow plaintext on a non-loopback address

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise UserError("--tls-cert and --tls-key go together")
        if self.client_ca is not None and self.cert is None:
            raise UserError("--tls-ca (client certificates) needs --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return self.cert is not None

    def check_bind(self, host: str) -> None:
        """Refuse plaintext on a non-loopback address unless --insecure was given."""
        if not self.tls and not self.insecure and not is_loopback(host):
            raise UserError(
                f"refusing to serve plaintext on {host}: give --tls-cert/--tls-key, "
                "or --insecure to accept unencrypted connections"
            )

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        assert self.key is not None and self.cert is not None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def describe(self) -> str:
        parts = ["mtls" if self.client_ca else "tls" if self.tls else "plaintext"]
        if self.tokens:
            parts.append("token")
        return "+".join(parts)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects. Empty = plaintext, no token."""

    ca: bytes | None = None  # PEM CA that signed the server's certificate; set = use TLS
    cert: bytes | None = None  # PEM client certificate (mTLS)
    key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    server_name: str | None = None  # override the name checked against the certificate

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise UserError("client certificate and key go together")
        if self.cert is not None and self.ca is None:
            raise UserError("a client certificate needs the server's CA too (TLS)")

    @property
    def tls(self) -> bool:
        return self.ca is not None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer <token>` (UNAUTHENTICATED).

    Health checks pass without a token (see the module docstring)."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self._tokens = tokens

    def valid(self, metadata) -> bool:
        return token_valid(bearer_token(metadata), self._tokens)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX) or self.valid(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return _deny(handler)


def token_valid(given: str | None, tokens: tuple[str, ...]) -> bool:
    """`given` is one of `tokens`, compared against every one (no early exit) so that timing
    says nothing about which."""
    if not isinstance(given, str):
        return False
    raw = given.encode()
    return sum(hmac.compare_digest(raw, t.encode()) for t in tokens) > 0


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip()
    return None


_DENIED = "missing or invalid bearer token (send 'authorization: Bearer <token>')"


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary:
        return handler._replace(unary_unary=unary)
    if handler.unary_stream:
        return handler._replace(unary_stream=streaming)
    if handler.stream_unary:
        return handler._replace(stream_unary=unary)
    return handler._replace(stream_stream=streaming)


def peer_identity(context) -> str:
    """Who is calling: its token, else its TLS client certificate, else its connection."""
    token = bearer_token(context.invocation_metadata())
    if token is not None:
        return token_identity(token)  # the interceptor already checked it when auth is on
    auth = context.auth_context() or {}
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        names = auth.get(key)
        if names:
            return "cert:" + b",".join(sorted(names)).decode(errors="replace")
    return "peer:" + context.peer()


# -- flags ---------------------------------------------------------------------------------------
def add_server_flags(p, prefix: str = "SPECWIRE") -> None:
    """--tls-cert --tls-key --tls-ca --auth-token-file --insecure (+ {prefix}_* variables)."""
    flags = (
        ("--tls-cert", "TLS_CERT", "PEM server certificate (turns TLS on)"),
        ("--tls-key", "TLS_KEY", "PEM private key of the TLS certificate"),
        ("--tls-ca", "TLS_CA", "PEM CA of client certificates: clients must show one (mTLS)"),
        (
            "--auth-token-file",
            "AUTH_TOKEN_FILE",
            f"accepted bearer tokens, one a line ({TOKEN_ENV})",
        ),
    )
    for flag, var, text in flags:
        add_env_flag(p, flag, f"{prefix}_{var}", None, text)
    add_env_flag(
        p,
        "--insecure",
        f"{prefix}_INSECURE",
        False,
        "allow plaintext on a non-loopback address",
        bool,
    )


def server_security_from_args(args) -> ServerSecurity:
    tokens = read_tokens(args.auth_token_file)
    if not tokens and os.environ.get(TOKEN_ENV):
        tokens = (os.environ[TOKEN_ENV].strip(),)
    return ServerSecurity(
        cert=_read(args.tls_cert, "--tls-cert"),
        key=_read(args.tls_key, "--tls-key"),
        client_ca=_read(args.tls_ca, "--tls-ca"),
        tokens=tokens,
        insecure=args.insecure,
    )


def add_client_flags(p, flag: str = "", env: str = "SPECWIRE") -> None:
    """--{flag}tls-ca --{flag}tls-cert --{flag}tls-key --{flag}token-file."""
    flags = (
        ("tls-ca", "TLS_CA", "PEM CA of the server's certificate (turns TLS on)"),
        ("tls-cert", "TLS_CERT", "PEM client certificate (mutual TLS)"),
        ("tls-key", "TLS_KEY", "PEM private key of the client certificate"),
        ("token-file", "TOKEN_FILE", "file holding the bearer token to send"),
    )
    for name, var, text in flags:
        add_env_flag(p, f"--{flag}{name}", f"{env}_{var}", None, text)


def client_security_from_args(args, flag: str = "", token_env: str = CLIENT_TOKEN_ENV):
    dest = flag.replace("-", "_")
    tokens = read_tokens(getattr(args, f"{dest}token_file"))
    token = tokens[0] if tokens else (os.environ.get(token_env) or None)
    return ClientSecurity(
        ca=_read(getattr(args, f"{dest}tls_ca"), f"--{flag}tls-ca"),
        cert=_read(getattr(args, f"{dest}tls_cert"), f"--{flag}tls-cert"),
        key=_read(getattr(args, f"{dest}tls_key"), f"--{flag}tls-key"),
        token=token.strip() if token else None,
    )
