"""User-provided drafters, loaded from `module:Class`.

The class is constructed as `Class(max_draft_len=K)` and must provide
`prepare_draft_tokens(requests, resources)` (see `target_service.drafters.base.Drafter`; it need
not subclass it). Its resource manager defaults to its `spec_resource_manager` attribute.
"""

from __future__ import annotations

from common.errors import UserError
from common.plugins import load_class


def load_plugin_drafter(spec: str, max_draft_len: int):
    cls = load_class(spec)
    try:
        drafter = cls(max_draft_len=max_draft_len)
    except Exception as exc:  # a user's constructor can fail in any way
        raise UserError(f"drafter {spec!r} failed to start: {exc}") from exc
    if not callable(getattr(drafter, "prepare_draft_tokens", None)):
        raise UserError(f"drafter {spec!r} has no prepare_draft_tokens(requests, resources)")
    if not hasattr(drafter, "spec_resource_manager"):
        drafter.spec_resource_manager = None
    if not hasattr(drafter, "max_draft_len"):
        drafter.max_draft_len = max_draft_len
    return drafter
