"""Drafter sessions: what each target request has committed, plus the drafter's state for it.

A session is keyed by the target's request id. Updates are deltas: `base_len` says how many
tokens the target believes the session holds. If it holds a different number (the service
restarted, the session expired, a message was lost), the update is refused and the target
resends the full prefix (`base_len == 0`), which starts the session afresh. Nothing is lost.

Idle sessions (a target that died, a `finished` message that never arrived) expire after a TTL;
expiry is swept lazily on each call, so an idle service holds memory but burns no CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafter_service.drafters.base import SessionDrafter


@dataclass
class Session:
    request_id: str
    tokens: list[int]  # committed tokens, prompt first
    state: Any  # the drafter's per-session state
    last_used: float


class SessionStore:
    """Thread-safe map request_id -> Session. `lock` is public so a caller can hold it across a
    whole batch (apply all updates, then propose) while the drafter runs."""

    def __init__(
        self,
        drafter: SessionDrafter,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.drafter = drafter
        self.ttl_s = ttl_s
        self.clock = clock
        self.lock = threading.RLock()
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    def get(self, request_id: str) -> Session | None:
        return self._sessions.get(request_id)

    def apply(self, request_id: str, base_len: int, new_tokens: list[int]) -> Session | None:
        """Append a delta. None means "resync": the session does not hold `base_len` tokens.

        `base_len == 0` (re)starts the session with `new_tokens` as the full prefix. Raises
        ValueError (after dropping the session) when the drafter cannot hold the tokens.
        """
        with self.lock:
            if base_len == 0:
                self._drop(request_id)
                session = Session(request_id, [], self.drafter.new_state(), self.clock())
                self._sessions[request_id] = session
            else:
                session = self._sessions.get(request_id)
                if session is None or len(session.tokens) != base_len:
                    return None
            if new_tokens:
                try:
                    self.drafter.extend(session.state, new_tokens)
                except ValueError:
                    self._drop(request_id)
                    raise
                session.tokens.extend(new_tokens)
            session.last_used = self.clock()
            return session

    def finish(self, request_id: str) -> bool:
        """The request finished: free its session. False if there was none."""
        with self.lock:
            return self._drop(request_id)

    def expire(self) -> list[str]:
        """Drop sessions idle for longer than the TTL; return their ids."""
        with self.lock:
            cutoff = self.clock() - self.ttl_s
            old = [rid for rid, s in self._sessions.items() if s.last_used < cutoff]
            for rid in old:
                self._drop(rid)
            return old

    def clear(self) -> None:
        with self.lock:
            for rid in list(self._sessions):
                self._drop(rid)

    def check_integrity(self) -> None:
        """Every session is keyed by its own id, and the drafter's resources are consistent."""
        with self.lock:
            for rid, s in self._sessions.items():
                assert s.request_id == rid, f"session {s.request_id!r} stored under {rid!r}"
            self.drafter.check_integrity([s.state for s in self._sessions.values()])

    def _drop(self, request_id: str) -> bool:
        session = self._sessions.pop(request_id, None)
        if session is None:
            return False
        self.drafter.release(session.state)
        return True
