"""The pipelined steps' Triton launches (`triton_pipeline`) against their PyTorch reference
(`runner/pipeline.py`): the same shifted positions, slots, context lengths, feed sources and
lookup lengths, and the same accepted counts, on random steps with sentinel rows, padding
tokens, rows that drafted on the device without a match, and more rows than one block.

Runs on a GPU, or on the CPU under Triton's interpreter:
  TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton dir> python -m pytest -q tests/test_triton_pipeline.py
"""

from __future__ import annotations

import pytest
import torch
from triton_env import kernel_device

DEVICE = kernel_device()  # (skips this module where the kernels cannot run)

from specwire.common.model import triton_pipeline  # noqa: E402 (triton is known to be there)
from specwire.target_service.runner import pipeline  # noqa: E402

BS = 16


def _step(g: torch.Generator, rows: int, max_rows: int, tokens: int):
    """A random staged step: per-row shift sources (some none), each token's row (padding at
    the end), the feed entries' rows, block tables whose blocks are distinct."""
    acc = torch.randint(0, 5, (max_rows + 1,), generator=g)
    acc[max_rows] = 0
    src = torch.randint(0, max_rows, (max_rows + 1,), generator=g)
    src[torch.rand(max_rows + 1, generator=g) < 0.3] = max_rows
    src[rows:] = max_rows
    real = tokens - 5
    tok_row = torch.sort(torch.randint(0, rows, (real,), generator=g)).values
    tok_row = torch.cat([tok_row, torch.full((5,), max_rows)])
    feed_row = torch.randint(0, rows, (max_rows,), generator=g)
    feed_row[rows // 2 :] = max_rows
    width = 40
    tables = torch.randperm(rows * width, generator=g).view(rows, width).int() + 1
    pos = torch.randint(0, (width - 5) * BS, (tokens,), generator=g)
    slots = torch.randint(0, 10_000, (tokens,), generator=g)
    slots[real:] = -1
    seq_lens = torch.randint(1, 500, (rows,), generator=g).int()
    feed_src = torch.randint(0, 100, (max_rows,), generator=g)
    lookup = torch.randint(1, 500, (rows,), generator=g)
    return acc, src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, lookup


@pytest.mark.parametrize(("rows", "max_rows", "tokens"), [(3, 8, 12), (70, 300, 600)])
@pytest.mark.parametrize("lookup", [True, False])
def test_shift_rows_in_one_launch_is_the_reference(rows, max_rows, tokens, lookup):
    g = torch.Generator().manual_seed(rows + tokens)
    ref = list(_step(g, rows, max_rows, tokens))
    got = [t.clone().to(DEVICE) for t in ref]
    if not lookup:
        ref[-1] = got[-1] = None
    pipeline.shift_rows(*ref, BS)
    triton_pipeline.shift_rows_triton(*got, BS)
    names = ("pos", "slots", "seq_lens", "feed_src")
    for name, want, have in zip(names, ref[4:8], got[4:8], strict=True):
        assert torch.equal(want, have.cpu()), name
    if lookup:
        assert torch.equal(ref[-1], got[-1].cpu())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_step_that_moves_no_row_leaves_its_stale_rows_unread(impl):
    """A pipelined step after one without drafts stages every shift source as none and leaves
    the token and feed rows as an earlier step staged them (`TokenGraphs._stage_pipeline`):
    every shift is then 0 whatever those rows say, so nothing moves."""
    g = torch.Generator().manual_seed(7)
    step = list(_step(g, 40, 64, 200))
    step[0][:] = torch.randint(1, 5, step[0].shape, generator=g)  # counts from a drafting step
    step[0][64] = 0
    step[1][:] = 64  # every source none
    before = [t.clone() for t in step[4:]]
    if impl == "reference":
        pipeline.shift_rows(*step, BS)
    else:
        step = [t.to(DEVICE) for t in step]
        triton_pipeline.shift_rows_triton(*step, BS)
    names = ("pos", "slots", "seq_lens", "feed_src", "tables", "lookup")
    for name, want, have in zip(names, before, step[4:], strict=True):
        assert torch.equal(want, have.cpu()), name


@pytest.mark.parametrize(("rows", "k"), [(5, 4), (130, 8), (9, 1)])
@pytest.mark.parametrize("with_found", [True, False])
def test_accepted_counts_in_one_launch_are_the_reference(rows, k, with_found):
    g = torch.Generator().manual_seed(rows * k)
    n_ids, n_logits = rows * (k + 1) + 1, rows * (k + 1)
    ids = torch.randint(0, 3, (n_ids,), generator=g)  # few values: long accepted prefixes
    argmax = torch.randint(0, 3, (n_logits,), generator=g)
    first = torch.arange(rows) * (k + 1) + 1
    logit = torch.arange(rows) * (k + 1)
    drafts = torch.randint(0, k + 1, (rows,), generator=g)
    cap = torch.randint(0, 2, (rows,), generator=g) * drafts
    found = torch.rand(rows, generator=g) < 0.5
    kidx = torch.arange(k)
    want_drafts = torch.where((cap > 0) & ~found, 0, drafts) if with_found else drafts
    want = pipeline.accepted_counts(ids, argmax, first, logit, want_drafts, kidx)
    assert want.max() > 0
    out = torch.full((rows + 1,), -7, dtype=torch.long, device=DEVICE)
    on = [t.to(DEVICE) for t in (ids, argmax, first, logit, drafts, cap, found)]
    extra = (on[5], on[6]) if with_found else ()
    triton_pipeline.accepted_counts_triton(*on[:5], k, out, *extra)
    assert torch.equal(out[:rows].cpu(), want)
    assert out[rows].item() == -7  # nothing past the rows
