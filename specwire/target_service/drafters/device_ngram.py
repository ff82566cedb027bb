"""`--drafter ngram --draft-on-device`: the n-gram drafter's lookup runs on the device, inside
the step (`runner.device_drafts`). On the host it only asks for as many drafts as each row's
budget: placeholders the runner fills before the model runs; the real drafts replace them
when the step is read. The proposals are those of the in-process n-gram drafter.

A row gets placeholders only where the lookup will find a match, which the host knows
exactly: the index proposes something iff the sequence's last token occurred before it (a
1-token suffix then matches, with a token after it). Elsewhere the row goes without drafts,
a 1-token row, as with the host drafter; placeholders there were a whole budget of tokens
verified for nothing (bench/RESULTS.md, round 49). `SeenTokens` keeps each request's tokens
but the last as a set, grown as tokens are committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from specwire.target_service.drafters.base import Drafter
from specwire.target_service.request import PENDING, Request
from specwire.target_service.resources.base import ResourceManager, ResourceRegistry

PLACEHOLDER = 0  # any id inside the vocabulary: overwritten on the device before it is read


class SeenTokens(ResourceManager):
    """Per request, the set of its committed tokens but the last (freed with the request)."""

    name = "device_ngram_seen"

    def __init__(self) -> None:
        self._seen: dict[str, tuple[set[int], int]] = {}  # request id -> (tokens[:n], n)

    def repeats_last(self, req: Request) -> bool:
        """Whether the request's last committed token occurred before it; True when it is
        not known yet (a pipelined step in flight computes it: `PENDING`)."""
        total = req.num_tokens
        seen, n = self._seen.get(req.request_id, (set(), 0))
        if n < total - 1:
            seen.update(req.tokens_between(n, total - 1))
            n = total - 1
        self._seen[req.request_id] = (seen, n)
        last = req.token_at(total - 1)
        return total >= 2 and (last == PENDING or last in seen)

    def free(self, request: Request) -> None:
        self._seen.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._seen)


class DeviceNGramDrafter(Drafter):
    name = "ngram"
    on_device = True  # DraftIntake marks its rows `Row.on_device`

    def __init__(self, max_draft_len: int) -> None:
        super().__init__(max_draft_len)
        self.spec_resource_manager = SeenTokens()

    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        seen = self.spec_resource_manager
        for req in requests:
            budget = req.draft_budget if seen.repeats_last(req) else 0
            req.draft_tokens = [PLACEHOLDER] * budget
