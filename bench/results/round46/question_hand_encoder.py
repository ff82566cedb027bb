"""Round 46, tried and dropped: a question (DraftStreamRequest) encoded by hand, varints from a
table, against protobuf's `sequences.add(...)` + `SerializeToString()`. Byte-identical, and
only ~20 % faster in a warm loop (8 rows: 9.1 against 7.4 us on the dev VM), so not built.

    python bench/results/round46/question_hand_encoder.py 8
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specwire.common.protogen import drafter_pb2  # noqa: E402


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


V = [_varint(i) for i in range(1 << 17)]


def encode(step: int, rows: list, want_probs: bool, branches_later: bool) -> bytes:
    """rows: (request_id field bytes, base_len, new_tokens, max_draft, branches, positions)."""
    parts = [b"\x08", V[step]]
    for idb, base, toks, k, nb, npos in rows:
        body = [idb]
        if base:
            body += (b"\x10", V[base])
        if toks:
            t = b"".join([V[x] for x in toks])
            body += (b"\x1a", V[len(t)], t)
        if k:
            body += (b"\x20", V[k])
        if nb:
            body += (b"\x30", V[nb], b"\x38", V[npos])
        b = b"".join(body)
        parts += (b"\x12", V[len(b)], b)
    if want_probs:
        parts.append(b"\x18\x01")
    if branches_later:
        parts.append(b"\x20\x01")
    return b"".join(parts)


def main() -> None:
    random.seed(0)
    rows = []
    for _ in range(int(sys.argv[1])):
        rid = f"req-{random.getrandbits(128):032x}"
        idb = b"\x0a" + V[len(rid)] + rid.encode()
        toks = [random.randint(0, 49151) for _ in range(random.randint(1, 9))]
        rows.append((rid, idb, random.randint(100, 900), toks, 44, 4, 2))

    def by_protobuf() -> bytes:
        m = drafter_pb2.DraftStreamRequest(step=12345, branches_later=True)
        add = m.sequences.add
        for rid, _, base, toks, k, nb, npos in rows:
            add(
                request_id=rid,
                base_len=base,
                new_tokens=toks,
                max_draft_tokens=k,
                max_branches=nb,
                branch_positions=npos,
            )
        return m.SerializeToString()

    def by_hand() -> bytes:
        return encode(12345, [r[1:] for r in rows], False, True)

    print("byte-identical:", by_protobuf() == by_hand())
    for f in (by_protobuf, by_hand, by_protobuf, by_hand):
        t0 = time.perf_counter_ns()
        for _ in range(20000):
            f()
        print(f.__name__, f"{(time.perf_counter_ns() - t0) / 20000 / 1000:.2f} us")


if __name__ == "__main__":
    main()
