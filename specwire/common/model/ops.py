"""The decoder's elementwise and matrix ops, as one swappable object per model.

- `TorchOps`: plain PyTorch (the CPU and the reference).
- `TritonOps`: our Triton kernels (`triton_ops.py`) for the small ops a layer is made of —
  RMSNorm with the residual add fused in, RoPE in place on the fused q/k buffer, SiLU·up — so a
  layer is ~11 kernels instead of ~25. GEMMs stay on cuBLAS, except in steps of at most 16
  tokens (16-bit) for weight shapes with measured tiles (`triton_tiles._TUNED`: the SmolLM2 and
  Llama-3-8B projections), where our GEMM is level with cuBLAS or faster, and in wider 16-bit
  steps for the shapes and row ranges where measured tiles beat cuBLAS (`triton_tiles._WIDE`)
  (`small_gemms="narrow"` keeps cuBLAS above 16 tokens, `"cublas"` everywhere, to compare)...
- ...unless `exact=True`: then every GEMM (projections and LM head) is our batch-invariant
  Triton GEMM, whose rows are bitwise independent of how many rows the step has. With the
  Triton attention (numerics a function of the row only) and per-row norms, a position's logits
  are the same whether it is decoded alone or verified in a 1+K row in any batch: greedy bf16
  with speculation equals greedy bf16 without it. Steps wider than 16 rows (16-bit) run it on
  larger row tiles (`triton_tiles.exact_wide_config`: wgmma where Triton picks it) over the
  same K order, which gives every row the same bits (GPU test `test_gpu_block_m_keeps_bits`)
  at a fraction of the cost of 64-row mma.sync tiles (`small_gemms="narrow"` keeps those).
  Where the exact GEMM does not split K, cuBLAS gives its bits too whenever cuBLAS does not
  split K either: both chain 16-wide MMAs over K in order into one fp32 accumulator. A step
  wider than `triton_tiles.exact_cublas_rows` (64 rows, or as measured per weight shape) runs
  such a GEMM on cuBLAS once a check has found its output bitwise equal to the exact GEMM's
  for that shape and row count (`_cublas_exact`), and on our tiles otherwise.
- Bit-exact fusions (`fuse_small=True`, the default; `False` gives the previous kernel sequence,
  for benchmarks): where a GEMM runs on our GEMM without a K split (steps of at most 16 tokens,
  see above; exact mode too), SiLU·up rides in the gate_up GEMM's epilogue
  (`triton_ops.gate_up_silu`) and RoPE with the KV-cache store in the qkv GEMM's
  (`triton_fused.qkv_rope_store`); in other steps the attention backend rotates q/k while it
  stores k/v (`triton_fused.rope_store_kv`). Each computes exactly the arithmetic of the kernels
  it replaces, so not a bit changes, in exact mode neither: a small step's layer is 8 kernels
  instead of 11 (norm, qkv + RoPE + store, attention, its combine, o_proj, norm,
  gate_up + SiLU·up, down). Where the GEMM's tiles run the norm kernel's warp count
  (`triton_ops.norm_fuses`: SmolLM2's, not Llama-3-8B's), the two RMSNorms (with their
  residual adds) can ride in the qkv and gate_up GEMMs' prologues too, again bit for bit: 6
  kernels a layer (`fuse_norm=True`). It is off by default: on the H200 the prologue made
  SmolLM2's small steps slower (B=1 q=5 1.08 vs 0.84 ms, bench/RESULTS.md round 15).
- Programmatic dependent launch (`pdl=True`, the default; sm_90+): each of our kernels is
  launched while the one before it still runs, and waits for it (`triton_base._grid_sync`)
  before it touches memory that kernel may write, so the gaps between a graph's ~250 small
  launches are hidden. What no kernel writes is read before the wait (`pdl_early`,
  `triton_base.set_pdl`): the norms' weights and the attention's metadata. Not a bit changes.
- Fused (`fused=True`, opt-in with `specwire target --fused`, never with `exact`; measured SLOWER on
  the H200 for now — the fused GEMMs run too few programs, see bench/RESULTS.md): steps of at most
  `triton_fused.MAX_TOKENS` tokens fold the norm into the qkv and gate_up GEMMs and SiLU·up
  into the down GEMM (`triton_fused.py`), and let the Triton attention rotate q/k while it
  stores k/v: ~7 kernels a layer. These GEMMs accumulate in their own K order: close to the
  unfused path, not bitwise.

The layer calls composite ops (`add_norm_linear`, `mlp`); `TorchOps` composes them from its
single ops, so a subclass can fuse them. Where `rope_in_qkv` says so (never for `TorchOps`),
the layer calls `add_norm_qkv_rope_store` instead of `add_norm_linear`, and its attention
backend only attends. Every single op keeps the rounding order of the PyTorch formula it
replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    name = "torch"
    exact = False
    # Whether the attention backend may apply RoPE itself (`AttentionShape.fused_rope`): only
    # for ops whose `rope` the backend's fused kernel reproduces bit for bit.
    fuse_rope = False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual), x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # qk: [T, heads, D]; cos, sin: [T, 1, D] (rotate-half convention, like HF)
        half = qk.shape[-1] // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        return qk * cos + rotated * sin

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def linear(x, weight, bias=None, out_dtype=None, defer=False):
        """x @ weight.T + bias. `defer`: the caller hands the result only to these ops'
        `add_norm*`/`add_rms_norm` (or `mlp`) as `x`, so the ops may return it in a form only
        they read (`TritonOps`: a K-split GEMM's partials, summed inside the norm's launch)."""
        out = F.linear(x, weight, bias)
        return out if out_dtype is None else out.to(out_dtype)

    def add_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual), x + residual); without a residual (the first layer),
        (rms_norm(x), x). x, residual: [T, K]."""
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        return self.add_rms_norm(x, residual, weight, eps)

    def add_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        """(linear(rms_norm(x + residual), weight, bias), x + residual), as `add_norm`."""
        h, residual = self.add_norm(x, residual, norm_weight, eps)
        return self.linear(h, weight, bias), residual

    def silu_linear(self, gate_up, weight, defer=False):
        """linear(silu(gate) * up, weight) for gate_up [T, 2I] -> [T, N] (`defer`: `linear`'s)."""
        return self.linear(self.silu_mul(gate_up), weight, defer=defer)

    def rope_in_qkv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `add_norm_qkv_rope_store` takes a step of x [T, hidden] with this qkv weight
        (a function of shapes only: the same choice at graph capture and replay). Never here:
        the plain ops leave RoPE and the KV store to the layer and its attention backend."""
        return False

    def add_norm_qkv_rope_store(
        self, x, residual, norm_weight, eps, weight, bias, cos, sin, kv_cache, slot_mapping, heads
    ):
        """(qkv, x + residual) as `add_norm_linear`, with q and k rotated (`rope`), and k and v
        written to their slots of the paged `kv_cache` [2, NB, BS, KVH, D] (slot -1: nowhere)
        as an attention backend's store would: all the layer needs before `attend`. Only for
        ops whose `rope_in_qkv` says so."""
        raise NotImplementedError(f"{self.name} ops leave RoPE and the KV store to the backend")

    def mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, defer=False):
        """The layer's second half: (linear(silu(gate) * up, down_weight), x + residual) where
        gate, up = linear(rms_norm(x + residual), gate_up_weight).chunk(2, -1).
        x, residual: [T, hidden]; gate_up_weight [2I, hidden]; down_weight [hidden, I].
        `defer`: the down GEMM's, as `linear`'s (x may be a deferred output too)."""
        gate_up, residual = self.add_norm_linear(x, residual, norm_weight, eps, gate_up_weight)
        return self.silu_linear(gate_up, down_weight, defer=defer), residual


class TritonOps(TorchOps):
    name = "triton"
    # Exact mode: steps wider than `triton_tiles.exact_cublas_rows` run a GEMM on cuBLAS where
    # cuBLAS gives the exact GEMM's bits (`_cublas_exact`); False keeps every exact GEMM on our
    # tiles (`bench/verify_step.py --no-exact-cublas`).
    exact_cublas = True
    # `linear(..., defer=True)` may return a K-split GEMM's partials for the next norm to sum
    # (`triton_ops.SplitPartials`); False sums them in their own launch, as before
    # (`bench/verify_step.py --no-defer-splits`). Not a bit changes.
    defer_splits = True

    def __init__(
        self,
        exact: bool = False,
        fused: bool = False,
        small_gemms: str = "triton",
        fuse_small: bool = True,
        pdl: bool = True,
        fuse_norm: bool = False,
        pdl_early: bool = True,
    ) -> None:
        # imports triton: GPU machines only
        from specwire.common.model import triton_base, triton_fused, triton_ops, triton_tiles

        self._k = triton_ops
        self._tiles = triton_tiles  # the GEMM's tile configs
        self._kf = triton_fused  # its bit-exact `qkv_rope_store`, in every mode
        self.exact = exact
        # Exact mode keeps the unfused path: its rows must come from the batch-invariant GEMM.
        self._fused = triton_fused if fused and not exact else None
        # The bit-exact fusions (module docstring); False: the kernels they replace, to compare.
        self._fuse_small = fuse_small
        # ...and the RMSNorm in those GEMMs' prologues, where their tiles allow it bit for bit
        # (`triton_ops.norm_fuses`); off by default (measured slower), True to compare.
        self._fuse_norm = fuse_small and fuse_norm
        self.fuse_rope = self._fused is not None or fuse_small
        if small_gemms not in ("triton", "narrow", "cublas"):
            raise ValueError(f"small_gemms must be triton, narrow or cublas, not {small_gemms!r}")
        # Steps of at most BLOCK_M tokens run the projections with measured tiles on our GEMM,
        # which is level with or faster than cuBLAS there (`triton_tiles._TUNED`); wider steps
        # too where measured tiles beat cuBLAS (`_WIDE`), and the exact mode's on larger row
        # tiles (`exact_wide_config`), unless "narrow".
        self._small_on_triton = small_gemms != "cublas"
        self._wide = small_gemms == "triton"
        # Exact mode: (N, K, M, bias, out dtype, dtype) -> whether that GEMM runs on cuBLAS
        # (`_cublas_exact`); "narrow" never asks.
        self._cublas_ok: dict[tuple, bool] = {}
        if exact:
            self.name = "triton-exact"
        elif fused:
            self.name = "triton-fused"
        if not exact and small_gemms == "cublas":
            self.name += "-cublas"
        if small_gemms == "narrow":
            self.name += "-narrow"
        if self._fused is None and not fuse_small:
            self.name += "-nofuse"
        # Programmatic dependent launch for every kernel of ours (sm_90+; `triton_base.set_pdl`):
        # a process-wide launch option, captured into each graph. Bits do not depend on it.
        triton_base.set_pdl(pdl, pdl_early)
        if not pdl:
            self.name += "-nopdl"
        elif not pdl_early:
            self.name += "-pdllate"
        if self._fuse_norm and self._fused is None:
            self.name += "-norm"

    def rms_norm(self, x, weight, eps):
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._k.add_rms_norm(x, residual, weight, eps)

    def rope(self, qk, cos, sin):
        return self._k.rope(qk, cos, sin, inplace=True)

    def silu_mul(self, gate_up):
        return self._k.silu_mul(gate_up)

    def linear(self, x, weight, bias=None, out_dtype=None, defer=False):
        m = x.shape[0]
        wide = self._wide and x.dtype != torch.float32 and m > self._tiles.BLOCK_M
        defer = defer and self.defer_splits
        if self.exact:
            if wide and self._cublas_exact(x, weight, bias, out_dtype):
                return self._cublas(x, weight, bias, out_dtype)
            if wide:  # the same K order on larger row tiles: the same bits (module docstring)
                cfg = self._tiles.exact_wide_config(*weight.shape, m)
                return self._k.linear_wide(x, weight, bias, out_dtype, cfg, defer)
            # Row tiles of 16, 32 or 64 rows give every row the same bits (the same mma.sync
            # chain per row; GPU test test_gpu_block_m_keeps_bits); 64 re-reads the weight far
            # less for wide steps (H200: 1.5-1.7x faster at M >= 40).
            block_m = 16 if m <= 16 else 64
            return self._k.linear(x, weight, bias, out_dtype, block_m=block_m, defer=defer)
        if self._small_gemm(x, weight):
            return self._k.linear(x, weight, bias, out_dtype=out_dtype, defer=defer)
        if wide and (cfg := self._tiles.wide_config(*weight.shape, m)) is not None:
            return self._k.linear_wide(x, weight, bias, out_dtype, cfg, defer)
        return super().linear(x, weight, bias, out_dtype)

    @staticmethod
    def _cublas(x, weight, bias, out_dtype):
        if out_dtype in (None, x.dtype):
            return F.linear(x, weight, bias)
        return torch.mm(x, weight.t(), out_dtype=out_dtype)  # no bias here: `_cublas_exact`

    def _cublas_exact(self, x, weight, bias, out_dtype) -> bool:
        """Whether this exact wide GEMM runs on cuBLAS: a step wider than `exact_cublas_rows`,
        and cuBLAS's bits for this (weight shape, row count, bias, output dtype) were found
        equal to the exact GEMM's, on random rows of its layout, at the first call outside a
        graph capture (an algorithm is a function of the shapes and layout, so the check stands
        for every call of that key). Never where the exact GEMM splits K (cuBLAS cannot match
        its split order) or for a layout the check did not see; during a capture, an unchecked
        key takes our tiles and stays unchecked."""
        n, k = weight.shape
        if not self.exact_cublas or x.shape[0] <= self._tiles.exact_cublas_rows(n, k):
            return False
        if x.device.type != "cuda":  # Triton's interpreter on the CPU (tests)
            return False
        if self._tiles.linear_config(n, k).split_k != 1:
            return False
        if bias is not None and out_dtype not in (None, x.dtype):
            return False
        if x.stride(0) != k or x.data_ptr() % 16 or weight.stride(0) != k:
            return False
        key = (n, k, x.shape[0], bias is not None, out_dtype, x.dtype)
        verdict = self._cublas_ok.get(key)
        if verdict is None:
            if torch.cuda.is_current_stream_capturing():
                return False
            gen = torch.Generator(device=x.device).manual_seed(0)
            rows = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
            ours = self._k.linear(rows, weight, bias, out_dtype=out_dtype)  # 16-row tiles
            try:
                verdict = torch.equal(self._cublas(rows, weight, bias, out_dtype), ours)
            except (RuntimeError, TypeError):  # e.g. a torch without mm's out_dtype
                verdict = False
            self._cublas_ok[key] = verdict
        return verdict

    def gemm_note(self) -> str | None:
        """Where the exact mode's wide GEMMs run (for the log once graphs are captured): how
        many (weight shape, rows) keys were checked, and how many run on cuBLAS."""
        if not self.exact or not self._cublas_ok:
            return None
        on = sum(self._cublas_ok.values())
        return (
            f"exact wide GEMMs: {on} of {len(self._cublas_ok)} "
            "(weight shape, rows) on cuBLAS, where its bits equal ours, the rest on our tiles"
        )

    def _small_gemm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the (non-exact) `linear` runs on our GEMM with measured tiles. A function of
        the shapes only: the same choice at graph capture and at every replay."""
        return (
            self._small_on_triton
            and x.dtype != torch.float32  # the tiles were measured in bf16
            and x.shape[0] <= self._tiles.BLOCK_M
            and self._tiles.tuned(*weight.shape)
        )

    def _epilogue_ok(self, h: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether an elementwise epilogue may ride in the GEMM `linear(h, weight)` bit for bit
        (`triton_ops.gate_up_silu`, `triton_fused.qkv_rope_store`): where it is our GEMM with
        BLOCK_M-row tiles (exact mode's tiles for at most 16 rows) and no K split, and the
        `--fused` kernels do not take the step. Shapes only, as above."""
        if not self._fuse_small or self._fuses(h) or h.shape[0] > self._tiles.BLOCK_M:
            return False
        if not (self.exact or self._small_gemm(h, weight)):
            return False
        return self._tiles.linear_config(*weight.shape).split_k == 1

    def _fuses(self, x: torch.Tensor) -> bool:
        # A function of the shape only: the same choice at graph capture and at every replay.
        return self._fused is not None and x.shape[0] <= self._fused.MAX_TOKENS

    def add_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        if not self._fuses(x):
            return super().add_norm_linear(x, residual, norm_weight, eps, weight, bias)
        x = self._k.dense(x)
        return self._fused.add_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_linear(self, gate_up, weight, defer=False):
        if not self._fuses(gate_up):
            return super().silu_linear(gate_up, weight, defer)
        return self._fused.silu_linear(gate_up, weight)

    def mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, defer=False):
        # Fused steps (`--fused`) fold the norm and SiLU·up into GEMMs of their own K order.
        if not self._epilogue_ok(x, gate_up_weight):
            return super().mlp(x, residual, norm_weight, eps, gate_up_weight, down_weight, defer)
        if self._norm_in_gemm(x, gate_up_weight):
            act, residual = self._k.add_norm_gate_up_silu(
                self._k.dense(x), residual, norm_weight, eps, gate_up_weight
            )
        else:
            h, residual = self.add_norm(x, residual, norm_weight, eps)
            act = self._k.gate_up_silu(h, gate_up_weight)
        return self.linear(act, down_weight, defer=defer), residual

    def _norm_in_gemm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the RMSNorm before an epilogue GEMM (`_epilogue_ok`) rides in its prologue.
        Shapes only, as above."""
        k = x.shape[1]
        return self._fuse_norm and self._k.norm_fuses(
            k, self._tiles.linear_config(weight.shape[0], k)
        )

    def rope_in_qkv(self, x, weight):
        return self._epilogue_ok(x, weight)

    def add_norm_qkv_rope_store(
        self, x, residual, norm_weight, eps, weight, bias, cos, sin, kv_cache, slot_mapping, heads
    ):
        if self._norm_in_gemm(x, weight):
            return self._kf.add_norm_qkv_rope_store(
                self._k.dense(x),
                residual,
                norm_weight,
                eps,
                weight,
                bias,
                cos,
                sin,
                kv_cache,
                slot_mapping,
                heads,
            )
        h, residual = self.add_norm(x, residual, norm_weight, eps)
        qkv = self._kf.qkv_rope_store(h, weight, bias, cos, sin, kv_cache, slot_mapping, heads)
        return qkv, residual
