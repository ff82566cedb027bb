"""The in-graph greedy argmax (`triton_argmax.copy_argmax`) against torch.argmax: the first index
of each row's maximum, ties across and within chunks, all -inf rows, a vocabulary that is not a
whole number of chunks; and the copy it makes of the logits.

Runs on a GPU, or on the CPU under Triton's interpreter:
  TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton dir> python -m pytest -q tests/test_triton_argmax.py
"""

from __future__ import annotations

import pytest
import torch
from triton_env import kernel_device

DEVICE = kernel_device()  # (skips this module where the kernels cannot run)

from specwire.common.model import triton_argmax  # noqa: E402 (triton is known to be there)


def _run(logits: torch.Tensor):
    dst = torch.full(logits.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    out = torch.full((logits.shape[0],), -1, dtype=torch.long, device=DEVICE)
    triton_argmax.copy_argmax(logits.to(DEVICE), dst, out)
    return dst.cpu(), out.cpu()


@pytest.mark.parametrize("vocab", [49152, 5 * triton_argmax.CHUNK + 77, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_index_of_the_maximum_like_torch(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g).to(dtype)
    last = vocab - 1
    logits[1, [3, last]] = 50.0  # a tie, first and last chunk (one chunk at 100): first wins
    logits[2, [last - 1, last]] = 50.0  # a tie inside the last, partial chunk
    logits[3] = float("-inf")  # nothing finite: index 0, as torch gives
    logits[4, last] = 60.0  # the maximum at the very end, in the last (partial) chunk
    logits[5] = 1.0  # all equal
    logits[6, vocab // 2 :] = 9.0  # a tie spanning chunks, from the middle on
    dst, out = _run(logits)
    assert torch.equal(out, logits.float().argmax(-1))
    assert out[1] == 3 and out[3] == 0 and out[4] == last and out[6] == vocab // 2
    assert torch.equal(dst, logits.float())


def test_nan_ranks_as_the_largest():
    logits = torch.zeros(2, 300)
    logits[0, 40] = float("nan")
    logits[1, [7, 9]] = float("nan")
    dst, out = _run(logits)
    assert out.tolist() == [40, 7]
    assert dst.isnan().sum() == 3  # copied as NaN, not as the +inf it ranks as
