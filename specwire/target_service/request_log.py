"""The request log: one INFO line per finished request, DEBUG lines when one is admitted and
when its client cancels it.

Every line carries the client's `request_id` (a request's n completions log `id/0`, `id/1`, ...)
and its numbers as `extra=` fields, so `--log-format json` writes them as JSON keys; the text
format repeats them in the message. The logger is `specwire.target_service.requests`, so the
request log
can be turned up or down on its own.
"""

from __future__ import annotations

import logging

from specwire.target_service.request import Request

log = logging.getLogger("specwire.target_service.requests")


def admitted(req: Request) -> None:
    log.debug(
        "request %s admitted: prompt_tokens=%d max_new_tokens=%d",
        req.client_id,
        len(req.prompt_ids),
        req.max_new_tokens,
        extra={
            "request_id": req.client_id,
            "internal_id": req.request_id,
            "prompt_tokens": len(req.prompt_ids),
            "max_new_tokens": req.max_new_tokens,
        },
    )


def cancelled(req: Request) -> None:
    log.debug(
        "request %s cancelled by the client after %d tokens",
        req.client_id,
        len(req.output_ids),
        extra={
            "request_id": req.client_id,
            "internal_id": req.request_id,
            "completion_tokens": len(req.output_ids),
        },
    )


def finished(
    req: Request, reason: str, completion_tokens: int, ttft_s: float | None, total_s: float
) -> None:
    """`ttft_s` is None when the request ended before its first token."""
    s = req.stats
    log.info(
        "request %s finished: reason=%s prompt_tokens=%d completion_tokens=%d ttft=%s "
        "total=%.3fs drafted=%d accepted=%d acceptance=%.2f",
        req.client_id,
        reason,
        len(req.prompt_ids),
        completion_tokens,
        "-" if ttft_s is None else f"{ttft_s:.3f}s",
        total_s,
        s.draft_tokens,
        s.accepted_tokens,
        s.acceptance_rate,
        extra={
            "request_id": req.client_id,
            "internal_id": req.request_id,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": completion_tokens,
            "ttft_s": ttft_s,
            "total_s": total_s,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
        },
    )
