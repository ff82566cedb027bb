"""`--drafter ngram --draft-on-device`: the n-gram drafter's lookup runs on the device, inside
the step (`runner.device_drafts`). On the host it only asks for as many drafts as each row's
budget: placeholders the runner fills before the model runs; the real drafts replace them
when the step is read. The proposals are those of the in-process n-gram drafter."""

from __future__ import annotations

from collections.abc import Sequence

from specwire.target_service.drafters.base import Drafter
from specwire.target_service.request import Request
from specwire.target_service.resources.base import ResourceRegistry

PLACEHOLDER = 0  # any id inside the vocabulary: overwritten on the device before it is read


class DeviceNGramDrafter(Drafter):
    name = "ngram"
    on_device = True  # DraftIntake marks its rows `Row.on_device`

    def prepare_draft_tokens(
        self, requests: Sequence[Request], resources: ResourceRegistry
    ) -> None:
        for req in requests:
            req.draft_tokens = [PLACEHOLDER] * req.draft_budget
