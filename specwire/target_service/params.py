"""What a client asks for, before normalisation: the one request shape gRPC and HTTP share.

`Engine.normalize(GenerationParams)` turns it into validated `Request`s (tokenised, chat template
applied, sampling config built, limits checked, n completions fanned out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_N = 16


@dataclass(frozen=True)
class GenerationParams:
    """Exactly one input: `prompt` (text), `prompt_token_ids` or `chat` (role/content dicts)."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    chat: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    max_new_tokens: int | None = None  # None: until EOS or the context is full
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculate: bool = True
    max_draft_len: int | None = None  # None: the server's max
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    request_id: str = ""  # n > 1: completion i runs as "<request_id>/<i>"
