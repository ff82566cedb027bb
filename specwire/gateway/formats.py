"""The two OpenAI response shapes (completions and chat), streaming and not.

A `Format` turns Generate's messages into OpenAI objects: `delta(chunk)` is one streaming chunk,
`finished(complete)` the chunk that closes a choice, `response(...)` the whole non-streaming
answer. Per choice it keeps what a format needs across chunks (text offsets, the role header).
"""

from __future__ import annotations

import time

from specwire.common.protogen import generation_pb2 as pb
from specwire.gateway import convert


class Format:
    object_chunk: str
    object_full: str

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        self.id = response_id
        self.model = model
        self.logprobs = logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def delta(self, chunk: pb.GenerateChunk) -> dict | None:
        raise NotImplementedError

    def finished(self, complete: pb.GenerateComplete) -> dict:
        raise NotImplementedError

    def choice(self, index: int, chunks: list[pb.GenerateChunk], c: pb.GenerateComplete) -> dict:
        raise NotImplementedError

    def usage_chunk(self, completes: list[pb.GenerateComplete]) -> dict:
        return {**self._envelope(self.object_chunk, []), "usage": convert.usage(completes)}

    def response(
        self, chunks: dict[int, list[pb.GenerateChunk]], completes: list[pb.GenerateComplete]
    ) -> dict:
        ordered = sorted(completes, key=lambda c: c.index)
        choices = [self.choice(c.index, chunks.get(c.index, []), c) for c in ordered]
        return {
            **self._envelope(self.object_full, choices),
            "usage": convert.usage(ordered),
            "speculation": convert.speculation(ordered),
        }


class CompletionFormat(Format):
    object_chunk = object_full = "text_completion"

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        self.offsets: dict[int, int] = {}  # per choice: text offset of the next token

    def _logprobs(self, index: int, items) -> dict | None:
        if not self.logprobs:
            return None
        start = self.offsets.get(index, 0)
        self.offsets[index] = start + sum(len(lp.token) for lp in items)
        return convert.completion_logprobs(list(items), start)

    def delta(self, chunk: pb.GenerateChunk) -> dict | None:
        if not chunk.text and not chunk.logprobs:
            return None
        choice = {
            "index": chunk.index,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.index, chunk.logprobs),
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def finished(self, complete: pb.GenerateComplete) -> dict:
        choice = {
            "index": complete.index,
            "text": "",
            "logprobs": None,
            "finish_reason": convert.finish_reason(complete),
            "speculation": convert.speculation([complete]),
        }
        return self._envelope(self.object_chunk, [choice])

    def choice(self, index: int, chunks: list[pb.GenerateChunk], c: pb.GenerateComplete) -> dict:
        items = [lp for ch in chunks for lp in ch.logprobs]
        return {
            "index": index,
            "text": c.text,
            "logprobs": convert.completion_logprobs(items, 0) if self.logprobs else None,
            "finish_reason": convert.finish_reason(c),
            "speculation": convert.speculation([c]),
        }


class ChatFormat(Format):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        self.started: set[int] = set()  # choices whose first delta (with the role) went out

    def _delta(self, index: int, content: str | None) -> dict:
        delta: dict = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        return delta

    def delta(self, chunk: pb.GenerateChunk) -> dict | None:
        if not chunk.text and not chunk.logprobs and chunk.index in self.started:
            return None
        logprobs = (
            {"content": convert.chat_logprobs(list(chunk.logprobs))} if self.logprobs else None
        )
        choice = {
            "index": chunk.index,
            "delta": self._delta(chunk.index, chunk.text),
            "logprobs": logprobs,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def finished(self, complete: pb.GenerateComplete) -> dict:
        choice = {
            "index": complete.index,
            "delta": self._delta(complete.index, None),
            "logprobs": None,
            "finish_reason": convert.finish_reason(complete),
            "speculation": convert.speculation([complete]),
        }
        return self._envelope(self.object_chunk, [choice])

    def choice(self, index: int, chunks: list[pb.GenerateChunk], c: pb.GenerateComplete) -> dict:
        items = [lp for ch in chunks for lp in ch.logprobs]
        return {
            "index": index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": convert.chat_logprobs(items)} if self.logprobs else None,
            "finish_reason": convert.finish_reason(c),
            "speculation": convert.speculation([c]),
        }
