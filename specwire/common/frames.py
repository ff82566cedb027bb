"""Frames: the DraftStream's messages without gRPC, for a drafter on the same host.

Two carriers use them: the target's relay child (a pipe each way, `--drafter-mode relay`) and
a drafter service's unix socket (`specwire drafter --socket PATH`, `--drafter-mode socket`).
A question is a 4-byte little-endian length and a serialised DraftStreamRequest. A reply is
its length, a double (the sender's time.monotonic() as it sent or read it: CLOCK_MONOTONIC
is one clock for every process of a host, so the target times a reply by its arrival even
when it reads it late) and a serialised DraftStreamResponse. A reply frame whose time is
negative (`FAILED`) carries instead, as UTF-8, why the other end is ending the stream.

The socket's first frames are its setup, both ways JSON in the same frames: the target's
{"token"} (null without one), and the drafter's {"info": GetInfo's fields} or {"error"}.
"""

from __future__ import annotations

import asyncio
import struct

QUESTION = struct.Struct("<I")  # a question (and the target's setup): its length
REPLY = struct.Struct("<Id")  # a reply: its length, when it was sent (or read)
FAILED = -1.0  # a reply frame's time when it says why the stream ends instead
# GetInfo's fields the socket's setup answers with: the target checks them against its gRPC
# handshake's, so a socket of another drafter is refused.
IDENTITY = ("protocol_version", "name", "vocab_size", "tokenizer_fingerprint")
# The longest question a drafter reads: gRPC's default receive limit, so a question one wire
# takes the other takes too (a longer length ends the stream, as on gRPC).
MAX_FRAME = 4 << 20
# The most polling (ms) a socket connection's setup may ask of the drafter service ("spin_ms").
MAX_SPIN_MS = 100.0


def reply_frame(payload: bytes, at: float) -> bytes:
    return REPLY.pack(len(payload), at) + payload


def failed_frame(why: str) -> bytes:
    return reply_frame(why.encode(), FAILED)


async def read_question(reader: asyncio.StreamReader) -> bytes | None:
    """The next question frame's payload from `reader`; None at the end of the stream (also
    in the middle of a frame). Raises ValueError for a length past MAX_FRAME."""
    try:
        (n,) = QUESTION.unpack(await reader.readexactly(QUESTION.size))
        if n > MAX_FRAME:
            raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        return None
