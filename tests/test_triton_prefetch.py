"""Reading weights into L2 on a side stream (`triton_prefetch`, `TritonOps.l2_prefetch`): the
kernel reads every word it is given, and a step with prefetches forked and joined (eagerly and
inside a CUDA graph) computes the same bits as without them.

The kernel runs on a GPU or under Triton's interpreter; the side stream needs a GPU:
  TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/test_triton_prefetch.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from specwire.common.model import triton_prefetch as pf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@pytest.mark.parametrize("words", [1, 1000, pf._BLOCK * pf._ITERS, 3 * pf._BLOCK * pf._ITERS + 17])
def test_every_word_is_read(words):
    """Each program xors the words it read into its sink slot: the xor of the sinks is the xor
    of the whole range, so a word skipped or read twice shows (random 64-bit words)."""
    g = torch.Generator().manual_seed(words)
    src = torch.randint(-(2**62), 2**62, (words + 5,), generator=g, dtype=torch.int64)
    src = src.to(DEVICE)
    grid = -(-words // (pf._BLOCK * pf._ITERS))
    sink = torch.zeros(grid, dtype=torch.int64, device=DEVICE)
    pf._read_into_l2[(grid,)](src, sink, words, BLOCK=pf._BLOCK, ITERS=pf._ITERS)
    expect, got = 0, 0
    for v in src[:words].tolist():
        expect ^= v
    for v in sink.tolist():
        got ^= v
    assert got == expect


on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="side streams need a GPU")


def _two_gemms(ops, x, w1, w2):
    h = ops.linear(x, w1)
    ops.prefetch("o_proj", w2, x.shape[0])
    out = ops.linear(h, w2)
    ops.join_prefetch()
    return out


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_gpu_prefetch_keeps_the_bits_eager_and_in_a_graph(rows, monkeypatch):
    """Llama-3-8B's qkv then o_proj shapes: the prefetch of o_proj's weight forked after the
    first GEMM and joined at the end leaves the output bitwise as without it, eagerly and
    replayed from a CUDA graph (whose capture must end with the side stream joined); steps of
    more than 16 tokens do not prefetch."""
    from specwire.common.model.ops import TritonOps

    g = torch.Generator(device="cuda").manual_seed(rows)
    w1 = (torch.randn(4096, 4096, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(4096, 4096, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
    plain = TritonOps()
    monkeypatch.setattr(TritonOps, "l2_prefetch", {"o_proj": 0})
    fetching = TritonOps()
    ref = _two_gemms(plain, x, w1, w2)
    assert torch.equal(_two_gemms(fetching, x, w1, w2), ref)
    assert bool(fetching._prefetcher._sinks) == (rows <= 16)  # launched only for small steps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _two_gemms(fetching, x, w1, w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
