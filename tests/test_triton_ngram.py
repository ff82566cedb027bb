"""The device n-gram lookup (`triton_ngram.ngram_drafts`) against the host path of
`runner.device_drafts.DeviceDrafts` (which runs `NGramIndex` on the token cache): the same
drafts and `found`, the drafts written into the step's ids at each row's offset and into the
token cache at their slots (never where the slot is -1), rows with cap 0 untouched.

Runs on a GPU, or on the CPU under Triton's interpreter:
  TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton dir> python -m pytest -q tests/test_triton_ngram.py
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_env import kernel_device

DEVICE = kernel_device()  # (skips this module where the kernels cannot run)

from specwire.common.model.triton_ngram import ngram_drafts  # noqa: E402
from specwire.target_service.runner.device_drafts import DeviceDrafts  # noqa: E402

BS, KMAX = 4, 5


def _case(seed: int):
    """A token cache of shuffled 4-slot blocks holding rows of small-vocabulary sequences, each
    with a step of fed tokens and draft positions after them (some slots -1)."""
    rng = random.Random(seed)
    rows, per_row = 6, 12
    blocks = list(range(rows * per_row))
    rng.shuffle(blocks)
    tables = torch.tensor([blocks[r * per_row : (r + 1) * per_row] for r in range(rows)])
    cache = torch.full((rows * per_row * BS + 1,), 99, dtype=torch.long)
    lengths, caps, offsets, ids, slots = [], [], [], [], []
    for r in range(rows):
        n = rng.randrange(0, 30)
        seq = [rng.randrange(rng.choice([2, 3, 9])) for _ in range(n)]
        for p, t in enumerate(seq):
            cache[tables[r, p // BS] * BS + p % BS] = t
        cap = rng.choice([0, 1, 3, KMAX])
        lengths.append(n)
        caps.append(cap)
        offsets.append(len(ids))
        for j in range(cap):
            ids.append(-7)
            p = n + j
            slots.append(-1 if rng.random() < 0.2 else int(tables[r, p // BS] * BS + p % BS))
        ids.append(-8)  # a token between rows that no row's drafts may touch
        slots.append(-1)
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return cache, tables.to(torch.int32), as_long(lengths), as_long(caps), as_long(offsets), \
        as_long(ids), as_long(slots)  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_kernel_drafts_and_writes_what_the_host_path_does(seed):
    cache, tables, lengths, caps, offsets, ids, slots = _case(seed)
    rows = tables.shape[0]
    host = DeviceDrafts(len(cache) - 1, BS, KMAX, 8, 8, torch.device("cpu"))
    host.cache.copy_(cache)
    want_ids, want_d = ids.clone(), torch.zeros(rows, KMAX, dtype=torch.long)
    want_f = torch.zeros(rows, dtype=torch.bool)
    host.draft(want_ids, slots, tables, lengths, caps, offsets, want_d, want_f)

    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got_cache, got_ids = dev(cache.clone()), dev(ids.clone())
    got_d = torch.full((rows, KMAX), -5, dtype=torch.long, device=DEVICE)
    got_f = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    ngram_drafts(
        got_cache, dev(tables), dev(lengths), dev(caps), dev(offsets), got_ids, dev(slots),
        got_d, got_f, block_size=BS, max_ngram=8, vote=8, block=8,
    )  # fmt: skip
    assert got_f.cpu().tolist() == want_f.tolist()
    assert want_f.any() and not want_f.all()  # both kinds of row are exercised
    for r in range(rows):
        if want_f[r]:
            cap = int(caps[r])
            assert got_d[r, :cap].cpu().tolist() == want_d[r, :cap].tolist()
    assert got_ids.cpu().tolist() == want_ids.tolist()
    assert torch.equal(got_cache.cpu(), host.cache)
