"""User drafters loaded from `module:Class`, resolved once (specwire/common/plugins.py).

Two contracts are accepted:
- the session contract (specwire/common/drafting.py `SessionDrafter`, also what the drafter service
  runs): the class has `new_state`/`extend`/`propose`, is built as `Class()` and runs through
  `SessionDrafterAdapter`, which keeps one session per request;
- the older in-process contract (`specwire.target_service.drafters.base.Drafter`): the class has
  `prepare_draft_tokens(requests, resources)`, is built as `Class(max_draft_len=K)`, and its
  resource manager is its `spec_resource_manager` attribute (None when absent).
"""

from __future__ import annotations

from specwire.common.drafters.plugin import instantiate, is_session_drafter_class
from specwire.common.errors import UserError
from specwire.common.plugins import load_class
from specwire.target_service.drafters.session import SessionDrafterAdapter


def load_plugin_drafter(spec: str, max_draft_len: int):
    cls = load_class(spec)
    if not callable(getattr(cls, "prepare_draft_tokens", None)) and is_session_drafter_class(cls):
        return SessionDrafterAdapter(instantiate(cls, spec), max_draft_len)
    try:
        drafter = cls(max_draft_len=max_draft_len)
    except Exception as exc:  # a user's constructor can fail in any way
        raise UserError(f"drafter {spec!r} failed to start: {exc}") from exc
    if not callable(getattr(drafter, "prepare_draft_tokens", None)):
        raise UserError(
            f"drafter {spec!r} has neither prepare_draft_tokens(requests, resources) nor "
            "new_state(), extend() and propose()"
        )
    if not hasattr(drafter, "spec_resource_manager"):
        drafter.spec_resource_manager = None
    if not hasattr(drafter, "max_draft_len"):
        drafter.max_draft_len = max_draft_len
    return drafter
