"""Target service configuration: one frozen dataclass, built once from flags/environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import UserError

if TYPE_CHECKING:  # torch loads when a config is built, not when the CLI reads this class
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes


@dataclass(frozen=True)
class TargetConfig:
    model: str = "smollm2-135m"
    drafter: str = "ngram"  # none | ngram | module:Class | grpc://HOST:PORT
    max_draft_len: int = 4
    max_ngram: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True
    max_batch_size: int = 16
    max_num_tokens: int = 1024
    max_context_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = enough for max_batch_size full contexts
    drafter_mode: str = "stream"  # stream | unary (remote drafters)
    drafter_deadline_ms: float = 50.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_draft_len < 0:
            raise UserError(f"--max-draft-len must be >= 0, got {self.max_draft_len}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        import torch

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA GPU is available")
        if self.max_batch_size < 1:
            raise UserError("--max-batch-size must be >= 1")
        if self.max_context_len < 2:
            raise UserError("--max-context-len must be >= 2")
        if self.max_num_tokens < 1 + self.max_draft_len:
            raise UserError("--max-num-tokens must be at least 1 + --max-draft-len")
        if self.drafter_mode not in ("stream", "unary"):
            raise UserError(f"--drafter-mode must be stream or unary, got {self.drafter_mode!r}")
        if self.drafter_deadline_ms <= 0:
            raise UserError("--drafter-deadline-ms must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_context_len // self.block_size)
