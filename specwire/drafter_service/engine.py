"""The drafter service's domain layer: one batched step in, one batched answer out.

The servicer converts protobuf to `SeqUpdate`s, calls `DraftEngine.draft` once, and converts
the `SeqDraft`s back. Problems with the request as a whole (empty or duplicate request ids,
negative lengths) raise `UserError` (-> INVALID_ARGUMENT); a problem with one sequence's tokens,
or a drafter failure, costs only the drafts it concerns.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from specwire.common.drafting import MAX_BRANCHES, Branch, SessionDrafter, SparseDist
from specwire.common.errors import UserError
from specwire.drafter_service.sessions import SessionStore

log = logging.getLogger(__name__)


_INT32 = 1 << 31
_INT_ONLY = {int}


def token_ids(values, limit: int) -> list[int]:
    """The first `limit` of `values` as token ids that fit the wire (integers in int32);
    an exception for anything else."""
    ids = values[:limit] if type(values) is list else list(itertools.islice(values, limit))
    if not ids:
        return ids
    if set(map(type, ids)) != _INT_ONLY:  # (in C: ~3x faster than a generator per id)
        ids = [operator.index(t) for t in ids]  # numpy ints, not floats or strings
    if not (-_INT32 <= min(ids) and max(ids) < _INT32):
        raise ValueError("a token id outside int32")
    return ids


def distributions(probs, n: int) -> list[SparseDist] | None:
    """The first `n` sparse distributions (ids, probs), made to fit the wire; None when there
    are fewer than `n` (the draft is then sent as point masses); an exception for malformed
    ones (the target checks what they mean: sums, the vocabulary)."""
    out = [
        (token_ids(ids, _INT32), [float(p) for p in ps]) for ids, ps in itertools.islice(probs, n)
    ]
    if any(len(ids) != len(ps) for ids, ps in out):
        raise ValueError("a distribution with more ids than probabilities, or fewer")
    return out if len(out) == n else None


class SeqUpdate(NamedTuple):  # immutable and cheap to build: one per sequence per message
    request_id: str
    base_len: int
    new_tokens: list[int]
    max_draft_tokens: int
    finished: bool = False
    max_branches: int = 0  # alternatives per position (drafter.proto SequenceUpdate)
    branch_positions: int = 0


@dataclass(slots=True)
class SeqDraft:
    request_id: str
    base_len: int  # the length the draft continues: update.base_len + len(new_tokens)
    tokens: list[int] = field(default_factory=list)
    resync: bool = False
    probs: list[SparseDist] | None = None
    branches: list[Branch] | None = None


# A proposal's branches to find (`DraftEngine.draft`'s `later`): (its answer, the session's
# drafter state, the budget, the update).
BranchWork = tuple[SeqDraft, object, int, SeqUpdate]


def validate(updates: list[SeqUpdate]) -> None:
    """Raise UserError naming the first malformed update."""
    ids = {u.request_id for u in updates}
    if (
        len(ids) == len(updates)
        and "" not in ids
        and all(
            u.base_len >= 0
            and u.max_draft_tokens >= 0
            and 0 <= u.max_branches <= MAX_BRANCHES
            and 0 <= u.branch_positions <= u.max_draft_tokens + 1
            for u in updates
        )
    ):
        return  # well formed (every message of a healthy target): one pass, no strings
    seen: set[str] = set()
    for i, u in enumerate(updates):
        where = f"sequences[{i}]"
        if not u.request_id:
            raise UserError(f"{where}: request_id is empty")
        if u.request_id in seen:
            raise UserError(f"{where}: request_id {u.request_id!r} appears twice")
        seen.add(u.request_id)
        if u.base_len < 0:
            raise UserError(f"{where} ({u.request_id}): base_len must be >= 0, got {u.base_len}")
        if u.max_draft_tokens < 0:
            raise UserError(
                f"{where} ({u.request_id}): max_draft_tokens must be >= 0, got {u.max_draft_tokens}"
            )
        if not 0 <= u.max_branches <= MAX_BRANCHES:
            raise UserError(
                f"{where} ({u.request_id}): max_branches must be between 0 and {MAX_BRANCHES}, "
                f"got {u.max_branches}"
            )
        if not 0 <= u.branch_positions <= u.max_draft_tokens + 1:
            raise UserError(
                f"{where} ({u.request_id}): branch_positions must be between 0 and "
                f"max_draft_tokens + 1 ({u.max_draft_tokens + 1}), got {u.branch_positions}"
            )


class DraftEngine:
    """Applies a step's updates to the sessions and drafts for all of them together."""

    def __init__(
        self,
        drafter: SessionDrafter,
        store: SessionStore,
        max_draft_len: int,
        delay_ms: float = 0.0,
    ) -> None:
        self.drafter = drafter
        self.store = store
        self.max_draft_len = max_draft_len
        self.delay_s = delay_ms / 1000.0
        # Drafting on the service's event loop (no hop to a worker thread): for a cheap
        # drafter, and never with an injected delay (it sleeps).
        self.inline = drafter.cheap and not self.delay_s
        self.branches = "branches" in drafter.capabilities

    def draft(
        self,
        updates: list[SeqUpdate],
        want_probs: bool = False,
        owner: str = "",
        later: list[BranchWork] | None = None,
    ) -> list[SeqDraft]:
        """One draft (maybe empty, maybe resync) per non-finished update. Sessions are the
        `owner`'s own (see sessions.py). With `later` (a list), the branches asked for are
        not found here: what finding them takes goes into `later`, for `find_branches` once the
        drafts are on their way (a DraftStream's `branches_later`)."""
        validate(updates)
        if self.delay_s:
            time.sleep(self.delay_s)  # injected latency, outside the lock like a slow network
        with self.store.lock:  # the drafter is not thread-safe; one step at a time
            self.store.expire_due()
            out: list[SeqDraft] = []
            todo: list[BranchWork] = []
            for u in updates:
                if u.finished:
                    self.store.finish(u.request_id, owner)
                    continue
                answer = SeqDraft(u.request_id, u.base_len + len(u.new_tokens))
                out.append(answer)
                try:
                    session = self.store.apply(u.request_id, u.base_len, u.new_tokens, owner)
                except ValueError as exc:
                    log.warning("request %s: no draft: %s", u.request_id, exc)
                    continue
                if session is None:
                    answer.resync = True
                    continue
                budget = min(u.max_draft_tokens, self.max_draft_len)
                if budget > 0:
                    todo.append((answer, session.state, budget, u))
            if todo:
                self._propose(todo, want_probs, later)
            return out

    def find_branches(self, later: list[BranchWork]) -> list[SeqDraft]:
        """The branches `draft` left for later, as drafts that carry only them (request id,
        base_len, branches), for the sequences that have any. Each is found from the
        session's state as it was drafted: a stream's next question is read only after this
        (the same caller's sessions change only by its own questions)."""
        out = []
        with self.store.lock:
            for answer, state, budget, u in later:
                found = self._alternatives(state, answer.tokens, u, budget)
                if found:
                    out.append(SeqDraft(answer.request_id, answer.base_len, branches=found))
        return out

    def _propose(
        self, todo: list[BranchWork], want_probs: bool, later: list[BranchWork] | None = None
    ) -> None:
        try:
            proposals = self.drafter.propose_batch(
                [t[1] for t in todo], [t[2] for t in todo], want_probs
            )
            if len(proposals) != len(todo):
                raise ValueError(f"{len(proposals)} proposals for {len(todo)} sequences")
        except Exception:  # a drafter bug costs this step's drafts, not the service
            log.exception("drafter %s failed; answering without drafts", self.drafter.name)
            return
        for (answer, state, budget, u), proposal in zip(todo, proposals, strict=True):
            try:  # what a drafter returns is checked per sequence: one bad answer costs one draft
                tokens, probs = proposal
                answer.tokens = token_ids(tokens, budget)
            except Exception as exc:
                log.warning("drafter %s: a proposal dropped: %r", self.drafter.name, exc)
                continue
            if want_probs and probs is not None and answer.tokens:
                try:
                    answer.probs = distributions(probs, len(answer.tokens))
                except Exception as exc:  # the draft stays, as point masses
                    log.warning("drafter %s: distributions dropped: %r", self.drafter.name, exc)
            if u.max_branches and u.branch_positions and self.branches:
                if later is None:
                    answer.branches = self._alternatives(state, answer.tokens, u, budget)
                else:
                    later.append((answer, state, budget, u))

    def _alternatives(
        self, state: object, tokens: list[int], u: SeqUpdate, budget: int
    ) -> list[Branch] | None:
        """The drafter's branches for one proposal, bounded as the update asked: at a
        position asked for and not past the proposal, a token other than the proposal's own
        there, at most `max_branches` a position, 1 to `budget - position - 1` tokens each,
        each (position, token) once. A malformed branch is dropped; a drafter that fails
        costs only its branches."""
        try:
            found = self.drafter.alternatives(
                state, tokens, u.branch_positions, u.max_branches, budget
            )
            found = list(itertools.islice(found, u.branch_positions * u.max_branches * 4))
        except Exception:
            log.exception("drafter %s: alternatives failed", self.drafter.name)
            return None
        out: list[Branch] = []
        per: dict[int, int] = {}  # position -> branches kept there
        seen: set[tuple[int, int]] = set()
        for entry in found:
            try:
                position, token, rest = entry
                position, (token,) = operator.index(position), token_ids([token], 1)
                if not (0 <= position < u.branch_positions and position <= len(tokens)):
                    continue
                if position < len(tokens) and token == tokens[position]:
                    continue  # not another way: the proposal itself
                rest = token_ids(rest, max(0, budget - position - 1))
            except Exception:  # a malformed branch costs only itself
                continue
            if not rest or (position, token) in seen:
                continue  # nothing to draft from, or said already
            seen.add((position, token))
            if per.get(position, 0) < u.max_branches:
                per[position] = per.get(position, 0) + 1
                out.append(Branch(position, token, rest))
        return out

    def check_integrity(self) -> None:
        self.store.check_integrity()
