"""What every Triton kernel module of ours shares: programmatic dependent launch (PDL) and the
math helpers that round as PyTorch's CUDA kernels do, in the compiler and in Triton's
interpreter alike.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# CUDA's expf/rsqrtf (what PyTorch's kernels call) are libdevice's; Triton's own tl.exp/tl.rsqrt
# are faster approximations that would round differently. The interpreter has no libdevice.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def _gdc_supported() -> bool:
    """Whether kernels may carry Hopper's grid dependency control (`griddepcontrol`, sm_90+)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


# Programmatic dependent launch (PDL). Every kernel of ours calls `_grid_sync` (a GEMM:
# `_grid_wait`, and `_grid_release` after its K loop) before it touches memory the kernel
# before it may write: it waits until that kernel has finished and its writes are visible,
# then lets the kernel after it launch. Launched with PDL (`launch_opts`), a kernel's programs
# are placed on the SMs while the previous kernel still runs and only wait at that point, so
# in a graph of ~250 small kernels the launch latency between kernels is hidden. A kernel's
# bits do not depend on it: the same instructions run after the wait. `set_pdl(False)`
# launches without it (for side-by-side benchmarks); the wait is then a no-op.
_GDC = tl.constexpr(_gdc_supported())
_LAUNCH: dict[str, bool] = {"launch_pdl": True} if _GDC else {}
# Early loads: what a kernel reads before its PDL wait, while the kernel before it still runs.
# Only memory no kernel of the step writes qualifies: the norms' weights, and the attention's
# metadata (query offsets, lengths, block table: copied in by the host before the step's first
# kernel). Writes always follow the wait: a fresh buffer may reuse memory the previous kernel
# still reads. Each GEMM program's first weight tile loaded early too was measured slower on
# the H200 (SmolLM2 B=1 q=1 0.82 against 0.79 ms; Llama-3-8B level; round 16) and removed.
_EARLY = {"on": True}


def set_pdl(on: bool, early: bool = True) -> None:
    """Launch our kernels with PDL (the default on sm_90+) or without, with the `early` loads
    before the wait or after it. Graphs keep the choice made when they were captured. Neither
    changes a bit: the same instructions compute the same values; only where the loads sit
    around the wait moves."""
    _LAUNCH.clear()
    if on and _GDC:
        _LAUNCH["launch_pdl"] = True
    _EARLY["on"] = early


def pdl_enabled() -> bool:
    return bool(_LAUNCH)


def launch_opts() -> dict[str, bool]:
    """Keyword arguments for every launch of a kernel that begins with `_grid_sync`."""
    return _LAUNCH


def early_loads() -> bool:
    """The `EARLY` constexpr of the kernels that load before their PDL wait (`set_pdl`)."""
    return _EARLY["on"]


@triton.jit
def _grid_wait():
    """PDL: wait until the previous kernel in the stream has finished and its writes are
    visible. Must run before a kernel reads or writes memory another kernel touches."""
    if _GDC:
        gdc_wait()


@triton.jit
def _grid_release():
    """PDL: let the next kernel's programs be placed once every program of this one has got
    here (or exited). GEMMs call it after their K loop, not at their start: placed early, the
    next kernel's programs pile onto the SMs that free first and stream their weights unevenly
    (H200, Llama-3-8B B=1: 5.22 ms a step against 4.85 without PDL)."""
    if _GDC:
        gdc_launch_dependents()


@triton.jit
def _grid_sync():
    """`_grid_wait`, then `_grid_release`: the start of a kernel that is one small wave."""
    _grid_wait()
    _grid_release()


@triton.jit
def _exp(x):
    return tl.exp(x) if _INTERPRET else libdevice.exp(x)


@triton.jit
def _exp2(x):
    """`tl.exp2` of fp32 x (the GPU's ex2). The interpreter's, numpy's, can differ in the last
    bit with an element's place in the array (vector and scalar paths): there in fp64."""
    if _INTERPRET:
        return tl.exp2(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.exp2(x)


@triton.jit
def _rsqrt(x):
    return tl.rsqrt(x) if _INTERPRET else libdevice.rsqrt(x)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even (the GPU's cvt.rn). The interpreter truncates
    fp32 -> bf16, so there it gets the same rounding from bit arithmetic."""
    if _INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _f32(x):
    return x.to(tl.float32)


@triton.jit
def _index(x):
    """A loop bound. The interpreter hands a nested call's int arguments over as 1-element
    arrays, which `range` refuses; compiled, this is the identity."""
    if _INTERPRET:
        return int(x.handle.data.reshape(-1)[0])  # plain Python: interpreted only
    else:
        return x
