"""A compact llama-family decoder on a paged KV cache.

RMSNorm, RoPE (with the config's scaling), grouped-query attention, SwiGLU, optional qkv bias,
tied embeddings. q/k/v and gate/up projections are fused at load time (fewer kernels per layer).
The forward takes flat tokens plus `AttentionMetadata`; logits are computed only for the rows
the caller asks for (last prompt token, verify positions).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from specwire.common.errors import UserError
from specwire.common.model.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    prepare_uniform_mask,
)
from specwire.common.model.config import ModelConfig, RopeScaling
from specwire.common.model.ops import TorchOps


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with linear or llama3 scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class Rotary(nn.Module):
    """Precomputed cos/sin table indexed by position (graph-safe: a gather, no host math)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D] (rotate-half convention, like HF)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin for the step's positions [T] -> [T, 1, D] each (once per forward)."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchOps.rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn):
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn = attn  # the model's attention backend, shared by all layers
        self.ops = TorchOps()  # the model's ops, shared by all layers (LlamaModel.set_ops)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: this layer's input delta (the embedding for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before x is added
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (output delta, residual stream) [T, hidden] each
        attn, residual = self._attention(x, residual, rope, kv_cache, meta)
        # o_proj's and down's outputs reach the residual stream only through the next norm of
        # the ops (`defer`: TritonOps sums a K-split GEMM's partials in that norm's launch).
        x = self.ops.linear(attn, self.o_proj.weight, defer=True)
        # Norm, gate_up GEMM, SiLU·up, down GEMM: SiLU·up in the gate_up GEMM with TritonOps.
        return self.ops.mlp(
            x,
            residual,
            self.post_attention_layernorm.weight,
            self.cfg.rms_norm_eps,
            self.gate_up_proj.weight,
            self.down_proj.weight,
            defer=True,
        )

    def _attention(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, q_size], the residual stream [T, hidden])
        """(Add +) norm and the qkv GEMM, RoPE on q and k, this step's k and v into the cache,
        then attention: as few launches as the ops and the backend allow, the same bits."""
        ops, eps, t = self.ops, self.cfg.rms_norm_eps, x.shape[0]
        heads, kv_heads, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        args = (x, residual, self.input_layernorm.weight, eps, self.qkv_proj.weight)
        fused_rope = ops.fuse_rope and self.attn.fused_rope
        if fused_rope and ops.rope_in_qkv(x, self.qkv_proj.weight):
            # The qkv GEMM rotates q and k and stores k and v itself (one launch for three).
            qkv, residual = ops.add_norm_qkv_rope_store(
                *args, self.qkv_proj.bias, *rope, kv_cache, meta.slot_mapping, heads
            )
            out = self.attn.attend(qkv[:, : self.q_size].view(t, heads, d), kv_cache, meta)
            return out.reshape(t, self.q_size), residual
        # Norm (the residual add inside) then a GEMM: one kernel each with fused TritonOps.
        qkv, residual = ops.add_norm_linear(*args, self.qkv_proj.bias)
        # q and k sit side by side: rotated in one go (in place with TritonOps).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, d)
        if fused_rope:
            # The backend rotates q and k as it stores k and v (one launch less).
            out = self.attn.forward_rope(qk, v, *rope, kv_cache, meta)
        else:
            qk = ops.rope(qk, *rope)
            out = self.attn.forward(qk[:, :heads], qk[:, heads:], v, kv_cache, meta)
        return out.reshape(t, self.q_size), residual


class LlamaModel(nn.Module):
    """Decoder stack + LM head. `forward` returns hidden states; `compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig, block_size: int = 16, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.attention = TorchPagedAttention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.attention) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Whole blocks of positions: padding tokens may use any position a block table covers.
        positions = max_positions or cfg.max_position_embeddings
        self.rotary = Rotary(cfg, -(-positions // block_size) * block_size)
        self.ops = TorchOps()

    def gemm_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every weight the ops multiply by: one layer's projections (all layers
        have the same) and the LM head."""
        layer = self.layers[0]  # a config has at least one
        projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        weights = [p.weight for p in projections] + [self.lm_head.weight]
        return [(w.shape[0], w.shape[1]) for w in weights]

    def set_ops(self, ops) -> None:
        """Swap the ops (`TorchOps`, `TritonOps`, `TritonOps(exact=True)`) for every layer."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops

    def set_attention(self, backend) -> None:
        """Swap the attention backend (e.g. the Triton one on a GPU) for every layer."""
        self.attention = backend
        for layer in self.layers:
            layer.attn = backend

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, 2, NB, BS, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        if not self.attention.varlen and meta.is_uniform and meta.uniform_mask is None:
            prepare_uniform_mask(meta, self.block_size, x.dtype)
        rope = self.rotary.table(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, kv_caches[i], meta)
        if residual is None:  # no layers
            return self.ops.rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        if self.ops.exact:  # fp32 straight from the accumulator, rows batch-invariant
            return self.ops.linear(hidden, self.lm_head.weight, out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, K/V, blocks, block size, KV heads, head dim]"""
        c = self.cfg
        return (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

    def allocate_kv_cache(
        self, num_blocks: int, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        p = self.embed_tokens.weight
        shape = self.kv_cache_shape(num_blocks)
        dtype, device = dtype or p.dtype, torch.device(device or p.device)
        check_kv_fits(math.prod(shape) * dtype.itemsize, device)
        if device.type == "cpu":
            return _lazy_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face's LlamaForCausalLM, fusing qkv and gate/up."""
        own = dict(self.named_parameters())
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            fused[f"layers.{i}.qkv_proj.weight"] = torch.cat(
                [tensors.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            )
            if self.cfg.attention_bias:
                fused[f"layers.{i}.qkv_proj.bias"] = torch.cat(
                    [tensors.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
                )
            fused[f"layers.{i}.o_proj.weight"] = tensors.pop(p + "self_attn.o_proj.weight")
            fused[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
                [tensors.pop(p + "mlp.gate_proj.weight"), tensors.pop(p + "mlp.up_proj.weight")]
            )
            fused[f"layers.{i}.down_proj.weight"] = tensors.pop(p + "mlp.down_proj.weight")
            for n in ("input_layernorm", "post_attention_layernorm"):
                fused[f"layers.{i}.{n}.weight"] = tensors.pop(p + f"{n}.weight")
        fused["embed_tokens.weight"] = tensors.pop("model.embed_tokens.weight")
        fused["norm.weight"] = tensors.pop("model.norm.weight")
        head = tensors.pop("lm_head.weight", None)
        if not self.cfg.tie_word_embeddings:
            if head is None:
                raise KeyError("lm_head.weight")
            fused["lm_head.weight"] = head
        for name, value in fused.items():
            param = own[name]
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"weight {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value.to(param.dtype))


ALIGN = 64  # bytes: what torch's CPU allocator gives


def check_kv_fits(nbytes: int, device: torch.device) -> None:
    """Refuse, with the flags to change, a KV pool bigger than the memory free now (the host's
    for the CPU, the GPU's for CUDA); raises UserError. `build_engine` allocates the pool before
    the block pool's free list, so an absurd `--num-kv-blocks` is refused before that too."""
    if device.type == "cpu":
        available, where = memory_available(), "memory"
    elif device.type == "cuda":
        # The driver's free memory, plus what torch's caching allocator holds unused.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        available = torch.cuda.mem_get_info(device)[0] + cached
        where = f"free memory on {device}"
    else:
        return
    if available is not None and nbytes > available:
        raise UserError(
            f"the KV cache needs {nbytes / 2**30:.2f} GiB and {available / 2**30:.2f} GiB of "
            f"{where} is available: lower --num-kv-blocks, --max-batch-size or --max-context-len"
        )


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on pages the OS zeroes when first touched (calloc), instead of
    torch.zeros's memset of the whole pool up front (1.7 s for the 1.5 GB default pool on the
    dev VM at every start, where a short run touches a few blocks). The pages are only
    promised, so the caller checks the pool against the memory available (`check_kv_fits`):
    one too big would otherwise fail later, under load, when the OS kills the process."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[skip : skip + nbytes]).view(dtype).view(shape)


def memory_available() -> int | None:
    """Bytes this process may still take: /proc/meminfo's MemAvailable, or less where a cgroup
    (v2) limit leaves less. None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
