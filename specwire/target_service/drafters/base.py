"""The drafter interface (in-process). Remote drafters implement it too.

A drafter proposes UNPADDED drafts: for each request it sets `request.draft_tokens` to 0..
`request.draft_budget` tokens (maybe none) and may set `request.draft_probs` — the contract's
mailbox, which the executor empties into the step's rows (checked, and padded where a backend
needs it). It never pads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceManager, ResourceRegistry


class Drafter(ABC):
    """Base class for drafters.

    `spec_resource_manager`, when not None, is registered with the executor's resource registry
    before the drafter is used; it receives prepare/update/free for every request (e.g. the
    n-gram pool, or the remote drafter's session bookkeeping).
    """

    name: str = "drafter"
    spec_resource_manager: ResourceManager | None = None
    # Set by the executor before each `prepare_draft_tokens` and `submit`: another step runs on
    # the device meanwhile (the two-batch overlap; an overlapped plain step's submit), so
    # waiting for drafts costs little (the remote drafter then waits for its reply rather than
    # going without) and a question sent now is already off the critical path.
    device_busy: bool = False
    # Set by the executor before each `prepare_draft_tokens`: how long this step may wait for
    # its drafts and still beat running without them, by the draft-length policy's cost model
    # (`DraftLengthPolicy.wait_worth_s`; None when nothing prices it). The remote drafter's
    # `--drafter-wait-rule gain` waits for a reply on its way at most this long.
    wait_worth_s: float | None = None
    # Set by the executor before each `prepare_draft_tokens`: for a pipelined step, staged while
    # the step before still runs, whether that step is done (`ModelRunner.ready`, never
    # blocks); None otherwise. The remote drafter's auto patience waits for a reply on its way
    # only while it is not (waiting then delays nothing).
    device_step_done: Callable[[], bool] | None = None

    def __init__(self, max_draft_len: int) -> None:
        if max_draft_len < 0:
            raise ValueError(f"max_draft_len must be >= 0, got {max_draft_len}")
        self.max_draft_len = max_draft_len

    @abstractmethod
    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        """Set `draft_tokens` (0..draft_budget tokens, unpadded) on each decoding request."""

    def arrived(self, requests: Sequence[Request]) -> None:
        """Requests the executor has just admitted during a speculative step (once it is
        launched, and again once the device has run it, before its commit); their prompt is all
        they hold, and their first drafts will be asked for at the step that ends their
        prefill. A drafter that drafts off the critical path (the remote one) may ask for
        those drafts now. Default: nothing."""

    def launched(self) -> None:
        """The executor has just launched a step on the device (called after every launch,
        before it waits). A drafter that drafts off the critical path (the remote one) may
        send here the question it held back at the previous step's `submit`, while the device
        runs. Default: nothing."""

    def device_running(self, done: Callable[[], bool]) -> None:
        """The executor is about to wait for the step it launched (`done()`: has it finished,
        without blocking). A drafter with replies on their way may take them meanwhile, off
        the critical path, returning once `done()` or nothing is left to take; it must not
        keep the executor past the device by more than a few µs. Default: nothing."""

    def close(self) -> None:
        """Release connections/threads (called at executor shutdown)."""
