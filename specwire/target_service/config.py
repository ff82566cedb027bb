"""Target service configuration: one frozen dataclass, built once from flags/environment."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specwire.common.drafting import MAX_BRANCHES
from specwire.common.errors import UserError
from specwire.common.model.paged import blocks_for
from specwire.common.ngram import DEFAULT_MAX_NGRAM, VOTE
from specwire.common.security import ClientSecurity
from specwire.target_service.drafters.remote_channel import (
    ASK_AT,
    AUTO_SPIN_MS,
    BRANCHES_AT,
    DEFAULT_WAIT_S,
    MAX_INFLIGHT,
    MODES,
    WAIT_RULES,
    check_socket,
    check_spin,
    check_wait,
)

if TYPE_CHECKING:  # torch loads when a config is built, not when the CLI reads this class
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
PIPELINE_CHOICES = ("auto", "measured", "always")
# --max-draft-len auto (-1): on a CUDA device with graphs and the adaptive policy, which picks
# each step's k up to K from measured costs and acceptance (on an H100, K=8 ran SmolLM2 at one
# stream 2-6 % faster than K=4 and stayed >= 0.98x of no drafter at 8-64 streams:
# bench/RESULTS.md, round 37); elsewhere the static policy verifies K drafts
# every step, and K=4 keeps that step short.
AUTO_DRAFT_LEN_GPU = 8
AUTO_DRAFT_LEN = 4


@dataclass(frozen=True)
class TargetConfig:
    model: str = "smollm2-135m"
    drafter: str = "ngram"  # none | ngram | model:NAME | module:Class | grpc://HOST:PORT
    # K, the most drafts a step verifies per sequence; -1 = auto: AUTO_DRAFT_LEN_GPU where the
    # adaptive policy picks each step's k from measured costs (a CUDA device with graphs),
    # else AUTO_DRAFT_LEN (the static policy verifies K every step).
    max_draft_len: int = -1
    max_ngram: int = DEFAULT_MAX_NGRAM
    ngram_vote: int = VOTE  # n-gram: occurrences whose next token votes (1: the latest alone)
    # n-gram: the lookup runs on the device, inside the step. None = auto: on for the n-gram
    # drafter on CUDA (with Triton), off elsewhere (`_resolve_auto_drafting`).
    draft_on_device: bool | None = None
    # Drafting steps overlap as plain ones do (the next step is launched before this one is
    # read, and shifted on the device by what it accepted): with draft_on_device or a remote
    # drafter. None = auto: on CUDA with graphs (not --attention sdpa) wherever
    # draft_on_device resolved on (and overlap is on, and no --two-batch-rows); a remote
    # drafter's stays opt-in.
    pipeline_drafts: bool | None = None
    # With pipeline_drafts and the adaptive policy: "measured" runs each speculative window's
    # drafting steps pipelined or synchronous, whichever measured faster at its load
    # (pipeline_choice.py); "always" pipelines every one. auto: measured for a remote
    # drafter (which mode won flipped with the load on the H100: bench/RESULTS.md, round
    # 56), always for the device lookup (pipelined won at 1-64 streams: rounds 51 and 53).
    pipeline_choice: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True
    overlap: bool = True  # launch plain greedy steps before the previous one is read
    # Speculative steps alternate two halves of the batch when at least this many requests
    # are running or waiting (up to max_batch_size): one half is prepared and committed while
    # the device runs the other (greedy requests). 0 = never (until measured on a GPU).
    two_batch_rows: int = 0
    attention: str = "auto"  # auto (triton on CUDA, sdpa on CPU) | triton | sdpa
    # Batch-invariant GEMMs, so bf16 speculation is token-exact (GPU): on | off | auto (on for
    # bf16/fp16 models whose GEMM shapes are of a model it was measured to cost <= 10 % on:
    # `triton_backend.resolve_exact`).
    exact: str = "auto"
    fused: bool = False  # experimental: norms and SiLU·up folded into Triton GEMMs (GPU)
    draft_policy: str = "adaptive"  # adaptive (needs CUDA graphs' cost table) | static
    max_batch_size: int = 16
    max_num_tokens: int = 1024
    max_context_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = enough for max_batch_size full contexts
    # auto | stream | relay | socket | unary (remote_channel.MODES); auto resolves at once to
    # socket when a socket path is given, else stream.
    drafter_mode: str = "auto"
    drafter_socket: str = ""  # socket mode: the drafter service's unix socket
    # Socket mode: a step waiting for a reply polls this long first, and the drafter is asked
    # to poll as long (RemoteDrafterConfig); -1 = auto: AUTO_SPIN_MS on a CUDA device, else 0.
    drafter_spin_ms: float = -1.0
    drafter_deadline_ms: float = 50.0
    # Remote drafters, at start-up: how long to wait for a drafter that is not up yet (a pod
    # or container started before its drafter, a model drafter still loading) before refusing
    # to start. Once started, a drafter that goes away only costs drafts (fail-open).
    drafter_wait_s: float = DEFAULT_WAIT_S
    # Remote drafters: how long a step waits for the drafts asked for as the previous step
    # committed before going without them (a later reply is kept for the steps after);
    # -1 = auto: only if due within 30 % of a drafting step, at most that long (the
    # deadline until a step and a round trip were timed).
    drafter_patience_ms: float = -1.0
    drafter_lookahead: int = -1  # remote drafters: tokens asked past a step's drafts; -1 = auto
    # Remote drafters with the "branches" capability: alternatives asked per draft position;
    # -1 = auto (4 while a message carries at most 8 sequences, else none).
    drafter_branches: int = -1
    # Remote drafters, stream modes: the branches in a reply of their own after the drafts
    # (later), or in the drafts' reply (reply).
    drafter_branches_at: str = "later"
    # Remote drafters, auto patience: when the next step would not wait for the reply, the
    # question asked as a step commits goes out once that step is launched (auto) or at the
    # commit (commit).
    drafter_ask_at: str = "auto"
    # Remote drafters, auto patience: wait for a reply on its way at most a share of a
    # drafting step (share), or as long as its drafts pay for the wait by the policy (gain).
    drafter_wait_rule: str = "share"
    # Remote drafters, stream mode: questions in flight at once (the stream answers in order;
    # 2: a commit asks again while the previous question is unanswered).
    drafter_max_inflight: int = 2
    progress: bool = True
    drafter_security: ClientSecurity = field(default_factory=ClientSecurity)  # grpc:// drafters
    # Admission limits (checked by the servicer before any work; see docs/security.md).
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of a prompt or of all chat contents
    max_stop_strings: int = 16
    max_stop_len: int = 256  # characters per stop string
    max_queue: int = 256  # requests admitted beyond max_batch_size; more -> RESOURCE_EXHAUSTED
    stream_interval: int = 1  # steps per streamed chunk (the first and the last never wait)

    def __post_init__(self) -> None:
        if self.max_draft_len == -1:
            object.__setattr__(self, "max_draft_len", self._auto_draft_len())
        if self.max_draft_len < 0:
            raise UserError(f"--max-draft-len must be >= 0 (or -1: auto), got {self.max_draft_len}")
        for flag, value in (("--max-ngram", self.max_ngram), ("--ngram-vote", self.ngram_vote)):
            if value < 1:
                raise UserError(f"{flag} must be >= 1, got {value}")
        self._resolve_auto_drafting()
        if self.draft_on_device and self.drafter != "ngram":
            raise UserError(
                f"--draft-on-device drafts with the n-gram lookup; it needs --drafter ngram, "
                f"got --drafter {self.drafter}"
            )
        remote = self.drafter.startswith("grpc://")
        if self.pipeline_drafts and not ((self.draft_on_device or remote) and self.overlap):
            raise UserError(
                "--pipeline-drafts overlaps drafting steps; it needs --draft-on-device or a"
                " remote drafter (grpc://), and overlap on (not --no-overlap)"
            )
        if self.pipeline_choice not in PIPELINE_CHOICES:
            raise UserError(
                f"--pipeline-choice must be one of {', '.join(PIPELINE_CHOICES)}, got "
                f"{self.pipeline_choice!r}"
            )
        if self.pipeline_choice == "auto":
            choice = "measured" if remote else "always"
            object.__setattr__(self, "pipeline_choice", choice)
        if self.pipeline_drafts and self.two_batch_rows:
            raise UserError("--pipeline-drafts and --two-batch-rows cannot be combined")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        import torch

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA GPU is available")
        if self.max_batch_size < 1:
            raise UserError("--max-batch-size must be >= 1")
        if self.two_batch_rows < 0:
            raise UserError(f"--two-batch-rows must be >= 0, got {self.two_batch_rows}")
        if self.max_context_len < 2:
            raise UserError("--max-context-len must be >= 2")
        if self.max_num_tokens < 1 + self.max_draft_len:
            raise UserError("--max-num-tokens must be at least 1 + --max-draft-len")
        if self.attention not in ("auto", "triton", "sdpa"):
            raise UserError(f"--attention must be auto, triton or sdpa, got {self.attention!r}")
        if self.exact not in ("auto", "on", "off"):
            raise UserError(f"--exact must be auto, on or off, got {self.exact!r}")
        if self.draft_policy not in ("adaptive", "static"):
            raise UserError(f"--draft-policy must be adaptive or static, got {self.draft_policy!r}")
        if self.drafter_mode == "auto":
            object.__setattr__(self, "drafter_mode", "socket" if self.drafter_socket else "stream")
        if self.drafter_mode not in MODES:
            raise UserError(
                f"--drafter-mode must be auto or one of {', '.join(MODES)},"
                f" got {self.drafter_mode!r}"
            )
        check_socket(self.drafter_mode, self.drafter_socket)
        if self.drafter_spin_ms == -1:
            gpu = self.device.startswith("cuda") and self.drafter_mode == "socket"
            object.__setattr__(self, "drafter_spin_ms", AUTO_SPIN_MS if gpu else 0.0)
        check_spin(self.drafter_spin_ms)
        if self.drafter_deadline_ms <= 0:
            raise UserError("--drafter-deadline-ms must be > 0")
        check_wait(self.drafter_wait_s)
        if self.drafter_patience_ms != -1 and not (
            0 <= self.drafter_patience_ms <= self.drafter_deadline_ms
        ):
            raise UserError(
                "--drafter-patience-ms must be between 0 and --drafter-deadline-ms "
                f"({self.drafter_deadline_ms:g}), or -1 (auto); "
                f"got {self.drafter_patience_ms:g}"
            )
        if self.drafter_ask_at not in ASK_AT:
            raise UserError(
                f"--drafter-ask-at must be one of {', '.join(ASK_AT)}, got {self.drafter_ask_at!r}"
            )
        if self.drafter_branches_at not in BRANCHES_AT:
            raise UserError(
                f"--drafter-branches-at must be one of {', '.join(BRANCHES_AT)}, "
                f"got {self.drafter_branches_at!r}"
            )
        if self.drafter_wait_rule not in WAIT_RULES:
            raise UserError(
                f"--drafter-wait-rule must be one of {', '.join(WAIT_RULES)}, "
                f"got {self.drafter_wait_rule!r}"
            )
        if not 1 <= self.drafter_max_inflight <= MAX_INFLIGHT:
            raise UserError(
                f"--drafter-max-inflight must be between 1 and {MAX_INFLIGHT}, "
                f"got {self.drafter_max_inflight}"
            )
        if self.drafter_lookahead < -1:
            raise UserError(
                f"--drafter-lookahead must be >= 0 (or -1: auto), got {self.drafter_lookahead}"
            )
        if not -1 <= self.drafter_branches <= MAX_BRANCHES:
            raise UserError(
                f"--drafter-branches must be between 0 and {MAX_BRANCHES} (or -1: auto), "
                f"got {self.drafter_branches}"
            )
        for flag, value in (
            ("--max-prompt-bytes", self.max_prompt_bytes),
            ("--max-stop-len", self.max_stop_len),
            ("--stream-interval", self.stream_interval),
        ):
            if value < 1:
                raise UserError(f"{flag} must be >= 1, got {value}")
        if self.max_stop_strings < 0 or self.max_queue < 0:
            raise UserError("--max-stop-strings and --max-queue must be >= 0")

    def _resolve_auto_drafting(self) -> None:
        """`draft_on_device` and `pipeline_drafts` left at None (auto) become bools. On the
        H100 the device lookup with pipelined steps ran 0.99-1.23x the host n-gram drafter at
        1-64 streams, and on the H200 1.2-2.0x no drafter (bench/RESULTS.md, rounds 51 and 53);
        on the CPU there is no device to hide the host behind, so it stays off there."""
        if self.draft_on_device is None:
            on = (
                self.drafter == "ngram"
                and self.max_draft_len != 0
                and self.device.startswith("cuda")
                and importlib.util.find_spec("triton") is not None
            )
            object.__setattr__(self, "draft_on_device", on)
        if self.pipeline_drafts is None:
            # Measured with CUDA graphs only: eagerly, each pipelined step waits for the
            # device to read its shifts (`ModelRunner`), so there it stays opt-in. The sdpa
            # backend has no graphs either (`AttentionBackend.graphs`).
            cuda = self.device.startswith("cuda") and self.cuda_graphs and self.attention != "sdpa"
            on = cuda and self.draft_on_device and self.overlap and not self.two_batch_rows
            object.__setattr__(self, "pipeline_drafts", bool(on))

    def _auto_draft_len(self) -> int:
        """`max_draft_len` -1: a longer K where the adaptive policy chooses each step's k (it
        drafts fewer, or none, where longer drafts do not pay), the shorter one elsewhere."""
        adaptive = (
            self.device.startswith("cuda") and self.cuda_graphs and self.draft_policy == "adaptive"
        )
        return AUTO_DRAFT_LEN_GPU if adaptive else AUTO_DRAFT_LEN

    @property
    def max_in_flight(self) -> int:
        """Generate calls admitted at once: running plus queued."""
        return self.max_batch_size + self.max_queue

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def blocks_per_seq(self) -> int:
        return blocks_for(self.max_context_len, self.block_size)

    @property
    def kv_pool_blocks(self) -> int:
        """KV blocks of the target's pool: --num-kv-blocks, or max_batch_size full contexts
        plus the dummy block."""
        return self.num_kv_blocks or (self.max_batch_size * self.blocks_per_seq + 1)
