"""Where the remote drafter's round trip goes: per-message timestamps at each hop, for diagnosis.

Off unless `SPECWIRE_HOP_TRACE=DIR` is set in the environment of the target and the drafter
service. Then each process appends `hop<TAB>step<TAB>time.monotonic()` rows to
`DIR/<side>-<pid>.tsv` (CLOCK_MONOTONIC is one clock for every process on a Linux host, so the
two sides' rows compare directly). The hops of one question on the DraftStream:

    target  send    the executor queues the message (`DraftStreamCall.send`)
    target  taken   gRPC's request-iterator thread takes it off the queue (then serialises it)
    drafter in      the drafter's handler has the parsed message
    drafter out     the drafter's reply is built, about to be written
    target  recv    the target's reader thread has the reply message (before parsing it)
    target  handed  the parsed reply is handed to the waiting step

With `--drafter-mode relay` the relay process (drafters/remote_relay.py) marks "taken" (it read
the question off its pipe) and "recv" (it has the reply), and the executor marks "send" and
"handed" (it read the reply off the pipe when a step looked for it).

`bench/hop_trace.py DIR` joins the rows by step and prints each hop's share of the round trip.
Rows are written in blocks of FLUSH_ROWS (and by `flush`), from whichever thread marks: a
process killed without `flush` loses at most its last block.
"""

from __future__ import annotations

import collections
import os
import threading
import time

ENV = "SPECWIRE_HOP_TRACE"
FLUSH_ROWS = 2048


class HopTrace:
    """One process side's rows (`mark` is a no-op while the environment variable is unset)."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.dir = os.environ.get(ENV) or None
        self._rows: collections.deque[tuple[str, int, float]] = collections.deque()
        self._lock = threading.Lock()  # one writer of the file at a time

    def mark(self, hop: str, step: int) -> None:
        if self.dir is None:
            return
        self._rows.append((hop, step, time.monotonic()))  # thread-safe, as popleft is
        if len(self._rows) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.dir is None:
            return
        with self._lock:
            rows = [self._rows.popleft() for _ in range(len(self._rows))]  # none lost
            if not rows:
                return
            os.makedirs(self.dir, exist_ok=True)
            path = os.path.join(self.dir, f"{self.side}-{os.getpid()}.tsv")
            with open(path, "a", encoding="ascii") as f:
                f.writelines(f"{h}\t{s}\t{t:.7f}\n" for h, s, t in rows)


TARGET = HopTrace("target")
DRAFTER = HopTrace("drafter")
