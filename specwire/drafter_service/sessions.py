"""Drafter sessions: what each target request has committed, plus the drafter's state for it.

A session is keyed by the target's request id. Updates are deltas: `base_len` says how many
tokens the target believes the session holds. If it holds a different number (the service
restarted, the session expired, a message was lost), the update is refused and the target
resends the full prefix (`base_len == 0`), which starts the session afresh. Nothing is lost.

Idle sessions (a target that died, a `finished` message that never arrived) expire after a TTL;
expiry is swept lazily, at most once per TTL/8 while messages arrive (`expire_due`: a session
may outlive its TTL by that much), so an idle service holds memory but burns no CPU.

Sessions belong to the caller that created them (`owner`: its token, TLS certificate or
connection; see specwire/common/security.py `peer_identity`). They are keyed by (owner, request
id), so
another caller using the same request id sees, resets and finishes only its own sessions. The
store is bounded: at most `max_sessions` sessions and `max_tokens` tokens per session; beyond
that `apply` raises `SessionLimit` (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specwire.common.drafting import SessionDrafter
from specwire.common.errors import UserError

Key = tuple[str, str]  # (owner, request_id)


class SessionLimit(UserError):
    code = "RESOURCE_EXHAUSTED"


@dataclass
class Session:
    request_id: str
    owner: str
    tokens: list[int]  # committed tokens, prompt first
    state: Any  # the drafter's per-session state
    last_used: float


class SessionStore:
    """Thread-safe map (owner, request_id) -> Session. `lock` is public so a caller can hold it
    across a whole batch (apply all updates, then propose) while the drafter runs.

    Methods take `owner`; `get`, `finish` and `in` with owner None match any owner (tests and
    operators)."""

    def __init__(
        self,
        drafter: SessionDrafter,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = 4096,
        max_tokens: int = 1 << 17,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.drafter = drafter
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.lock = threading.RLock()
        self._sessions: dict[Key, Session] = {}
        self._next_expiry = float("-inf")  # `expire_due` scans no earlier than this

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: str) -> bool:
        return self._find(request_id, None) is not None

    def _find(self, request_id: str, owner: str | None) -> Key | None:
        if owner is not None:
            return (owner, request_id) if (owner, request_id) in self._sessions else None
        return next((k for k in self._sessions if k[1] == request_id), None)

    def get(self, request_id: str, owner: str | None = None) -> Session | None:
        key = self._find(request_id, owner)
        return None if key is None else self._sessions[key]

    def apply(
        self, request_id: str, base_len: int, new_tokens: list[int], owner: str = ""
    ) -> Session | None:
        """Append a delta. None means "resync": the session does not hold `base_len` tokens.

        `base_len == 0` (re)starts the session with `new_tokens` as the full prefix. Raises
        ValueError (after dropping the session) when the drafter cannot hold the tokens, and
        SessionLimit when the store is full or the session would grow past `max_tokens`.
        """
        key = (owner, request_id)
        with self.lock:
            if base_len == 0:
                self._drop(key)
                if len(self._sessions) >= self.max_sessions:
                    self.expire()
                if len(self._sessions) >= self.max_sessions:
                    raise SessionLimit(
                        f"the drafter holds {len(self._sessions)} sessions (--max-sessions); "
                        "finish some or retry later"
                    )
                session = Session(request_id, owner, [], self.drafter.new_state(), self.clock())
                self._sessions[key] = session
            else:
                session = self._sessions.get(key)
                if session is None or len(session.tokens) != base_len:
                    return None
            if len(session.tokens) + len(new_tokens) > self.max_tokens:
                self._drop(key)
                raise SessionLimit(
                    f"session {request_id!r} would hold {len(session.tokens) + len(new_tokens)} "
                    f"tokens; the limit is {self.max_tokens} (--max-session-tokens)"
                )
            if new_tokens:
                try:
                    self.drafter.extend(session.state, new_tokens)
                except ValueError:
                    self._drop(key)
                    raise
                session.tokens.extend(new_tokens)
            session.last_used = self.clock()
            return session

    def finish(self, request_id: str, owner: str | None = None) -> bool:
        """The request finished: free its session. False if there was none."""
        with self.lock:
            key = self._find(request_id, owner)
            return key is not None and self._drop(key)

    def drop_owner(self, owner: str) -> int:
        """Free every session of `owner` (its connection is gone); how many there were."""
        with self.lock:
            keys = [key for key in self._sessions if key[0] == owner]
            for key in keys:
                self._drop(key)
            return len(keys)

    def expire(self) -> list[str]:
        """Drop sessions idle for longer than the TTL; return their request ids."""
        with self.lock:
            cutoff = self.clock() - self.ttl_s
            old = [key for key, s in self._sessions.items() if s.last_used < cutoff]
            for key in old:
                self._drop(key)
            return [rid for _, rid in old]

    def expire_due(self) -> None:
        """`expire`, at most once per eighth of the TTL (a session outlives its TTL by at most
        that): a scan of every session for every message would cost a loaded service more
        than the messages' own sequences."""
        now = self.clock()
        if now >= self._next_expiry:
            self._next_expiry = now + self.ttl_s / 8
            self.expire()

    def clear(self) -> None:
        with self.lock:
            for key in list(self._sessions):
                self._drop(key)

    def check_integrity(self) -> None:
        """Every session is keyed by its own owner and id, and the drafter's resources are
        consistent."""
        with self.lock:
            for key, s in self._sessions.items():
                assert key == (s.owner, s.request_id), f"session {s.request_id!r} under {key!r}"
            self.drafter.check_integrity([s.state for s in self._sessions.values()])

    def _drop(self, key: Key) -> bool:
        session = self._sessions.pop(key, None)
        if session is None:
            return False
        self.drafter.release(session.state)
        return True
