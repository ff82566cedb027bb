"""Resource managers: each owns one resource, states its invariant and can check it.

The executor builds them before the drafter (a drafter may use one) and drives them through a
`ResourceRegistry`: `prepare` and `update` run in registration order, `free` in reverse.
"""

from __future__ import annotations

import logging
from abc import ABC
from collections.abc import Sequence

from specwire.target_service.request import Request

log = logging.getLogger(__name__)


class ResourceManager(ABC):
    """Base class; every hook is optional."""

    name: str = "resource"

    def prepare(self, batch: Sequence[Request]) -> None:
        """Before drafting and forward: reserve what the step needs."""

    def update(self, batch: Sequence[Request], accepted: dict[str, int]) -> None:
        """After verification: `accepted[request_id]` real drafts were accepted."""

    def free(self, request: Request) -> None:
        """The request finished, was cancelled or failed: release everything it holds."""

    def check_integrity(self) -> None:
        """Raise AssertionError if the manager's invariant does not hold."""


class ResourceRegistry:
    """Ordered set of resource managers, looked up by name."""

    def __init__(self) -> None:
        self._managers: dict[str, ResourceManager] = {}

    def add(self, manager: ResourceManager) -> None:
        if manager.name in self._managers:
            raise ValueError(f"resource manager {manager.name!r} registered twice")
        self._managers[manager.name] = manager

    def get(self, name: str) -> ResourceManager | None:
        return self._managers.get(name)

    def __getitem__(self, name: str) -> ResourceManager:
        return self._managers[name]

    def __iter__(self):
        return iter(self._managers.values())

    def prepare(self, batch: Sequence[Request]) -> None:
        for m in self._managers.values():
            m.prepare(batch)

    def update(self, batch: Sequence[Request], accepted: dict[str, int]) -> None:
        for m in self._managers.values():
            m.update(batch, accepted)

    def free(self, request: Request) -> None:
        """Every manager frees the request, even when one before it raises (a plugin bug must
        not leak KV blocks); errors are logged, never raised."""
        for m in reversed(list(self._managers.values())):
            try:
                m.free(request)
            except Exception:
                log.exception("resource manager %r failed to free %s", m.name, request.request_id)

    def check_integrity(self) -> None:
        for m in self._managers.values():
            m.check_integrity()
