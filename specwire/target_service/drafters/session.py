"""A `SessionDrafter` (specwire/common/drafting.py) run in-process: the executor's `Drafter` over
it.

The same drafter classes run behind the drafter service; here the target keeps the sessions
itself, one per request, in `DraftSessions` — the drafter's spec resource manager, so the
executor's resource registry releases a request's state (and a model drafter's KV blocks) when
it frees the request. Each step, every decoding request's session catches up with the request's
committed tokens and the drafter proposes for all of them in one `propose_batch` call, each
within its request's `draft_budget`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specwire.common.drafting import SessionDrafter
from specwire.target_service.drafters.base import Drafter
from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager, ResourceRegistry

log = logging.getLogger(__name__)


@dataclass
class _Session:
    state: Any  # the drafter's per-session state
    length: int = 0  # committed tokens the state holds


class DraftSessions(ResourceManager):
    """Per request, the session drafter's state and how many committed tokens it holds.

    Invariant: a session never holds more tokens than its request has committed; the drafter's
    own resources are consistent with the live states (`SessionDrafter.check_integrity`).
    Only the executor thread calls it.
    """

    name = "draft_sessions"

    def __init__(self, drafter: SessionDrafter) -> None:
        self.drafter = drafter
        self._sessions: dict[str, _Session] = {}
        self._requests: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def sync(self, request: Request) -> Any | None:
        """The request's state, caught up with its committed tokens; None when the drafter
        cannot hold them (the session is dropped and rebuilt from token 0 next time)."""
        rid = request.request_id
        session = self._sessions.get(rid)
        if session is None:
            session = self._sessions[rid] = _Session(self.drafter.new_state())
            self._requests[rid] = request
        n = request.num_tokens
        if session.length < n:
            try:
                self.drafter.extend(session.state, request.tokens_between(session.length, n))
            except ValueError as exc:
                log.warning("request %s: no drafts: %s", rid, exc)
                self.free(request)
                return None
            session.length = n
        return session.state

    def free(self, request: Request) -> None:
        session = self._sessions.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        if session is not None:
            self.drafter.release(session.state)

    def check_integrity(self) -> None:
        for rid, s in self._sessions.items():
            held = self._requests[rid].num_tokens
            assert 0 <= s.length <= held, f"session {rid} holds {s.length} of {held} tokens"
        self.drafter.check_integrity([s.state for s in self._sessions.values()])


class SessionDrafterAdapter(Drafter):
    """The executor's `Drafter`, backed by a `SessionDrafter` running in this process."""

    def __init__(self, drafter: SessionDrafter, max_draft_len: int) -> None:
        super().__init__(max_draft_len)
        self.session_drafter = drafter
        self.name = drafter.name
        self.want_probs = "draft_probs" in drafter.capabilities
        self.spec_resource_manager = self.sessions = DraftSessions(drafter)

    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        rows: list[tuple[Request, Any]] = []
        for req in requests:
            req.draft_tokens, req.draft_probs = [], None
            if req.draft_budget > 0 and (state := self.sessions.sync(req)) is not None:
                rows.append((req, state))
        if not rows:
            return
        proposals = self.session_drafter.propose_batch(
            [state for _, state in rows], [req.draft_budget for req, _ in rows], self.want_probs
        )
        if len(proposals) != len(rows):
            raise ValueError(f"{len(proposals)} proposals for {len(rows)} sequences")
        for (req, _), (tokens, probs) in zip(rows, proposals, strict=True):
            req.draft_tokens = list(tokens)  # the executor truncates and checks them
            if self.want_probs and probs is not None:
                req.draft_probs = list(probs)

    def close(self) -> None:
        self.session_drafter.close()
