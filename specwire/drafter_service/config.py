"""The drafter service's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.common.errors import UserError
from specwire.common.ngram import DEFAULT_MAX_NGRAM, VOTE
from specwire.common.security import ServerSecurity
from specwire.drafter_service.frames import check_socket_path

DRAFTER_KINDS = "ngram, model:NAME or module:Class"


@dataclass(frozen=True)
class DrafterServiceConfig:
    """Everything `specwire drafter` needs; built from flags/environment by cli.py."""

    drafter: str = "ngram"  # ngram | model:NAME | module:Class
    # Most tokens per proposal: a step's drafts + the look-ahead (a GPU target's auto K=8 asks
    # 8 + 4 x 9 = 44: target_service.config.AUTO_DRAFT_LEN_GPU, remote.LOOKAHEAD_STEPS).
    max_draft_len: int = 48
    host: str = "127.0.0.1"  # loopback unless told otherwise (compose sets 0.0.0.0)
    port: int = 50152  # 0 = pick a free port (tests)
    max_ngram: int = DEFAULT_MAX_NGRAM
    ngram_vote: int = VOTE  # occurrences whose next token votes (1: the latest alone)
    prefer: str = "latest"  # n-gram match preference: latest | oldest
    device: str = "cpu"
    dtype: str = "auto"  # model drafters: auto (float32 on CPU, bfloat16 on CUDA) | float32 | ...
    kv_blocks: int = 512  # model drafters: KV blocks for all sessions together
    draft_probs_top_n: int = 0  # model drafters: >0 samples from top-N and sends q (see model.py)
    seed: int = 0
    session_ttl_s: float = 300.0
    delay_ms: float = 0.0  # injected latency per Draft call / stream message (tests, benchmarks)
    max_workers: int = 8  # threads running draft steps (calls wait as coroutines, not threads)
    max_sessions: int = 4096  # sessions held at once; more -> RESOURCE_EXHAUSTED
    max_session_tokens: int = 1 << 17  # tokens one session may hold
    max_streams_per_peer: int = 16  # concurrent DraftStreams per caller (token/cert/IP)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # Also serve DraftStream as frames on this unix socket, for a target on the same host
    # (frames.py); "" = no socket.
    socket: str = ""
    # After each event the service's event loop polls this long before it sleeps, so that a
    # question finds it awake (transport.SpinSelector): a shorter round trip, a busy core.
    # -1 (a target's auto, the two sharing SPECWIRE_DRAFTER_SPIN_MS) is 0 here: the service
    # polls only as its socket's connections ask.
    spin_ms: float = 0.0

    def __post_init__(self) -> None:
        kind, _, arg = self.drafter.partition(":")
        if not (self.drafter == "ngram" or (kind and arg)):
            raise UserError(f"--drafter {self.drafter!r}: expected {DRAFTER_KINDS}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be in 0..65535, got {self.port}")
        checks = {
            "--max-draft-len": (self.max_draft_len, 1),
            "--max-ngram": (self.max_ngram, 1),
            "--ngram-vote": (self.ngram_vote, 1),
            "--kv-blocks": (self.kv_blocks, 1),
            "--draft-probs-top-n": (self.draft_probs_top_n, 0),
            "--delay-ms": (self.delay_ms, 0),
            "--spin-ms": (self.spin_ms, -1),
            "max_workers": (self.max_workers, 1),
            "--max-sessions": (self.max_sessions, 1),
            "--max-session-tokens": (self.max_session_tokens, 1),
            "--max-streams-per-peer": (self.max_streams_per_peer, 1),
        }
        for flag, (value, low) in checks.items():
            if value < low:
                raise UserError(f"{flag} must be >= {low}, got {value}")
        if self.session_ttl_s <= 0:
            raise UserError(f"--session-ttl must be > 0, got {self.session_ttl_s}")
        if self.socket:
            check_socket_path(self.socket)
        if self.prefer not in ("latest", "oldest"):
            raise UserError(f"--prefer must be latest or oldest, got {self.prefer!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UserError(f"--device must be cpu or cuda[:N], got {self.device!r}")
