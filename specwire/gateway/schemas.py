"""OpenAI request bodies (the subset specwire serves), validated by pydantic.

Only types are checked here; values (temperature >= 0, n <= 16, prompt length, ...) are checked
once, by the target's `Engine.normalize`, and come back as gRPC INVALID_ARGUMENT -> HTTP 400.
Fields OpenAI defines that specwire cannot honour are refused when set to a non-default value,
never silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None  # OpenAI's default is 1.0
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Not OpenAI, but what vLLM and SGLang accept as extensions.
    top_k: int | None = None
    ignore_eos: bool = False
    # Refused unless left at their defaults.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # number of alternatives per token (0..20); None: no logprobs
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, 1, self.n):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: until EOS or the context is full
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        return bad
