"""Weights into L2 while the device would otherwise leave HBM idle (an experiment, opt-in).

A small step (a few tokens a row, a few rows) is weight-streaming: each GEMM reads its weight
once, and the kernels between the GEMMs (attention and its combine, the norms) read almost
nothing. Those kernels are ~20 µs of each Llama-3-8B layer at B=1 (bench/RESULTS.md, rounds 13
and 23), during which HBM is idle. `prefetch` starts a kernel on a side stream that reads the
next GEMM's weight (or its first `max_bytes`) into L2, keeping it there (`evict_last`), while
the main stream runs those kernels; the GEMM then finds its lines in L2. `join` makes the main
stream wait for the side stream (a graph capture must end joined). Reading a weight changes
nothing a step computes: not a bit of any output moves.

The side kernel is launched without programmatic dependent launch: it must start only when the
main-stream kernel before the fork has finished, not compete with it for bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # 8-byte words a program reads per iteration (8 KiB)
_ITERS = 4  # iterations, unrolled: 32 KiB a program in flight
_SINK = 1 << 16  # programs the first sink serves: 2 GiB of weight a prefetch


@triton.jit
def _read_into_l2(src, sink, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads words [pid * BLOCK * ITERS, +BLOCK * ITERS) of `src`, marked to stay in L2, and
    writes their xor to `sink[pid]` (so the loads are not optimised away)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(sink + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


_LANE_BYTES = 32 * 1024  # what one lane of `_bulk_into_l2` asks the copy engine for


@triton.jit
def _bulk_into_l2(src, nbytes, LANES: tl.constexpr, LANE_BYTES: tl.constexpr):
    """Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`, the TMA unit): each lane asks for
    LANE_BYTES of `src` (an int8 pointer) and moves on; no data passes through registers, so a
    few one-warp programs cover a whole weight. Sizes are multiples of 16 bytes (a tail below
    16 bytes is left out)."""
    pid = tl.program_id(0)
    off = pid.to(tl.int64) * LANES * LANE_BYTES + tl.arange(0, LANES).to(tl.int64) * LANE_BYTES
    size = tl.minimum(tl.maximum(nbytes - off, 0), LANE_BYTES).to(tl.int32) // 16 * 16
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        constraints="=r,l,r",
        args=[src + off, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


class L2Prefetcher:
    """Forks weight reads onto one side stream per device and joins them back."""

    def __init__(self, bulk: bool = False) -> None:
        self.bulk = bulk  # the copy engine's bulk prefetch instead of loads (`_bulk_into_l2`)
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._sinks: dict[torch.device, torch.Tensor] = {}
        self._forked: set[torch.device] = set()

    def prefetch(self, weight: torch.Tensor, max_bytes: int = 0) -> None:
        """Start reading `weight` (its first `max_bytes`; 0: all of it) into L2 on the side
        stream, after what the current stream has launched so far."""
        dev = weight.device
        words = weight.numel() * weight.element_size() // 8
        if max_bytes:
            words = min(words, max_bytes // 8)
        if words == 0 or not weight.is_contiguous() or weight.data_ptr() % 8:
            return
        if self.bulk:
            self._fork(dev)
            with torch.cuda.stream(self._side[dev]):
                nbytes = words * 8
                grid = triton.cdiv(nbytes, 32 * _LANE_BYTES)
                flat = weight.view(-1)[: nbytes // weight.element_size()].view(torch.int8)
                _bulk_into_l2[(grid,)](flat, nbytes, LANES=32, LANE_BYTES=_LANE_BYTES, num_warps=1)
            return
        grid = triton.cdiv(words, _BLOCK * _ITERS)
        sink = self._sinks.get(dev)
        if sink is None or sink.numel() < grid:
            # Never allocated inside a capture (the graph's pool could outlive or predecease
            # it): an eager step (every kernel runs eagerly once before capture) allocates.
            if torch.cuda.is_current_stream_capturing():
                return
            sink = self._sinks[dev] = torch.empty(max(grid, _SINK), dtype=torch.int64, device=dev)
        self._fork(dev)
        with torch.cuda.stream(self._side[dev]):
            flat = weight.view(-1)[: words * 8 // weight.element_size()].view(torch.int64)
            _read_into_l2[(grid,)](flat, sink, words, BLOCK=_BLOCK, ITERS=_ITERS)

    def _fork(self, dev: torch.device) -> None:
        """The side stream waits for what the current stream has launched so far."""
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        self._forked.add(dev)

    def join(self) -> None:
        """The current stream waits for every prefetch forked since the last join."""
        for dev in self._forked:
            torch.cuda.current_stream(dev).wait_stream(self._side[dev])
        self._forked.clear()
