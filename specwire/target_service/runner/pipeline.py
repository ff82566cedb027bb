"""Pipelined drafting steps on the device: verifying a step where it ran, and shifting the next.

With `--pipeline-drafts` (drafting on the device) step n+1 is prepared and launched before the
host has read step n. The host stages each of its rows for "step n accepted none of this
row's drafts"; what changes when it accepted `a` of them is only where the row sits: its
positions, KV slots and context length move by `a`, and so does the logit row its first token
is gathered from (step n's bonus token) and the length of its n-gram lookup. Its ids do not:
the first is gathered from step n's argmax on the device, the rest are drafted there.

So each step counts, on the device, how many drafts every row accepts (`accepted_counts`, the
greedy rule the host's verifier applies: the longest prefix of drafts equal to the argmax
before each), and the next step starts by moving its rows by those counts (`shift_rows`).
Both are fixed-shape tensor ops, captured inside the step's graph. Eager steps get the same
shifts on the host (`ModelRunner._host_shifts`): there the count is read back.
"""

from __future__ import annotations

import torch


def accepted_counts(
    ids: torch.Tensor,  # [T] the step's fed ids (drafts included)
    argmax: torch.Tensor,  # [L] the argmax of the step's logit rows
    first_draft: torch.Tensor,  # [B] flat index of each row's first draft
    first_logit: torch.Tensor,  # [B] each row's first logit row
    drafts: torch.Tensor,  # [B] each row's drafts (0: none)
    kidx: torch.Tensor,  # [K] arange(K), K >= every row's drafts
) -> torch.Tensor:
    """[B] how many of each row's drafts greedy verification accepts. A step with no logit
    row (only prefill chunks that do not end their prompts; no row has drafts) accepts none."""
    rows, k = first_draft.numel(), kidx.numel()
    if argmax.numel() == 0:
        return torch.zeros(rows, dtype=torch.long, device=ids.device)
    at = (first_draft[:, None] + kidx).clamp(max=ids.numel() - 1).flatten()
    lg = (first_logit[:, None] + kidx).clamp(max=argmax.numel() - 1).flatten()
    ok = (ids.index_select(0, at) == argmax.index_select(0, lg)).view(rows, k)
    ok &= kidx < drafts[:, None]
    return ok.long().cumprod(1).sum(1)


def shift_rows(
    acc: torch.Tensor,  # [R + 1] the step before's accepted counts; acc[R] is always 0
    shift_src: torch.Tensor,  # [R + 1] per row, its row in the step before (R: none)
    tok_row: torch.Tensor,  # [T] each token's row (R: padding)
    feed_row: torch.Tensor,  # [F] each fed entry's row (R: unused)
    pos: torch.Tensor,  # [T] positions, staged for "none accepted" (moved in place)
    slots: torch.Tensor,  # [T] KV slots (moved in place; padding's -1 stays)
    seq_lens: torch.Tensor,  # [B] context lengths (moved in place)
    feed_src: torch.Tensor,  # [F] the step before's logit rows fed (moved in place)
    tables: torch.Tensor,  # [>= B, M] block tables, covering each row's furthest shift
    lookup_lens: torch.Tensor | None,  # [B] n-gram lookup lengths (moved in place)
    block_size: int,
) -> None:
    """Move each row by its accepted count in the step before (fixed shapes: graph-safe)."""
    rows = tables.shape[0]
    shift = acc.index_select(0, shift_src)
    moved = shift.index_select(0, tok_row)
    pos.add_(moved)
    r = tok_row.clamp(max=rows - 1)
    col = torch.div(pos, block_size, rounding_mode="floor").clamp(max=tables.shape[1] - 1)
    at = tables[r, col].long() * block_size + pos % block_size
    slots.copy_(torch.where(moved > 0, at, slots))
    n = seq_lens.numel()
    seq_lens.add_(shift[:n].to(seq_lens.dtype))
    feed_src.add_(shift.index_select(0, feed_row))
    if lookup_lens is not None:
        lookup_lens.add_(shift[: lookup_lens.numel()])
