"""The gateway's configuration: one frozen dataclass, built once from the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specwire.common.errors import UserError


@dataclass(frozen=True)
class GatewayConfig:
    target: str = "127.0.0.1:50051"  # HOST:PORT of the target's gRPC API
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    model_name: str | None = None  # None: the target's model name (GetModelInfo)
    api_key_file: str | None = None  # when set, requests must send `Authorization: Bearer KEY`
    timeout_s: float = 600.0  # per gRPC call

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise UserError(f"--target must be HOST:PORT, got {self.target!r}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key_file is not None and not Path(self.api_key_file).is_file():
            raise UserError(f"--api-key-file {self.api_key_file}: no such file")

    def api_key(self) -> str | None:
        """The key read from --api-key-file (surrounding whitespace stripped), or None."""
        if self.api_key_file is None:
            return None
        key = Path(self.api_key_file).read_text().strip()
        if not key:
            raise UserError(f"--api-key-file {self.api_key_file} is empty")
        return key
