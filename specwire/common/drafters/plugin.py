"""User drafters loaded by import path: `--drafter mypkg.mymodule:MyDrafter`, on either service.

The class is instantiated with no arguments and must provide the `SessionDrafter` methods
(subclassing `specwire.common.drafting.SessionDrafter` is the easy way, but duck typing works too):

    new_state() -> state                    a fresh per-session state
    extend(state, tokens: list[int])        committed tokens, appended in order
    propose(state, budget: int, want_probs: bool = False)
        -> (tokens: list[int], probs: list[(ids, probs)] | None)

Optional: `propose_batch`, `alternatives` (with the "branches" capability), `release(state)`,
`check_integrity(states)`, `close()`, and the attributes `name`, `vocab_size` (0 = any),
`tokenizer_fingerprint` ("" = any), `capabilities`.
Missing optional parts get the `SessionDrafter` defaults.
"""

from __future__ import annotations

from typing import Any

from specwire.common.drafting import Branch, Proposal, SessionDrafter
from specwire.common.errors import UserError
from specwire.common.plugins import load_class

_REQUIRED = ("new_state", "extend", "propose")


def is_session_drafter_class(cls: type) -> bool:
    """Does `cls` follow this contract (rather than the target's older `Drafter` one)?"""
    return all(callable(getattr(cls, m, None)) for m in _REQUIRED)


def load_plugin(spec: str) -> SessionDrafter:
    """Import `module:Class`, instantiate it and adapt it to `SessionDrafter`."""
    try:
        cls = load_class(spec)
    except UserError as exc:
        raise UserError(f"--drafter {spec!r}: {exc}") from exc
    return instantiate(cls, spec)


def instantiate(cls: type, spec: str) -> SessionDrafter:
    """`cls()` adapted to `SessionDrafter`; UserError (one line) when that is impossible."""
    class_name = spec.partition(":")[2]
    try:
        obj = cls()
    except Exception as exc:
        raise UserError(f"--drafter {spec!r}: {class_name}() failed: {exc}") from exc
    if isinstance(obj, SessionDrafter):
        return obj
    missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise UserError(f"--drafter {spec!r}: {class_name} lacks {', '.join(missing)}()")
    return _DuckDrafter(obj, default_name=spec)


class _DuckDrafter(SessionDrafter):
    """Adapts a duck-typed plugin object, filling in the optional parts."""

    def __init__(self, obj: Any, default_name: str) -> None:
        self._obj = obj
        self.name = str(getattr(obj, "name", default_name))
        self.vocab_size = int(getattr(obj, "vocab_size", 0))
        self.tokenizer_fingerprint = str(getattr(obj, "tokenizer_fingerprint", ""))
        self.capabilities = tuple(getattr(obj, "capabilities", ()))

    def new_state(self) -> Any:
        return self._obj.new_state()

    def extend(self, state: Any, tokens: list[int]) -> None:
        self._obj.extend(state, tokens)

    def propose(self, state: Any, budget: int, want_probs: bool = False) -> Proposal:
        return self._obj.propose(state, budget, want_probs)

    def propose_batch(self, states, budgets, want_probs=False) -> list[Proposal]:
        if callable(getattr(self._obj, "propose_batch", None)):
            return list(self._obj.propose_batch(states, budgets, want_probs))
        return super().propose_batch(states, budgets, want_probs)

    def alternatives(self, state, proposal, positions, per_position, horizon) -> list[Branch]:
        if callable(getattr(self._obj, "alternatives", None)):
            found = self._obj.alternatives(state, proposal, positions, per_position, horizon)
            return [Branch(*b) for b in found]
        return []

    def release(self, state: Any) -> None:
        if callable(getattr(self._obj, "release", None)):
            self._obj.release(state)

    def check_integrity(self, live_states) -> None:
        if callable(getattr(self._obj, "check_integrity", None)):
            self._obj.check_integrity(live_states)

    def close(self) -> None:
        if callable(getattr(self._obj, "close", None)):
            self._obj.close()
