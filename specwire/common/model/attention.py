"""Attention over a paged KV cache, driven by explicit per-step metadata.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, kv_heads, head_dim]`. A
sequence's tokens live in the blocks its block table lists; token t of a sequence sits in slot
`block_table[t // block_size] * block_size + t % block_size`. The runner builds the metadata,
the attention layer only reads it, so one forward can carry prefill chunks, decode rows and
multi-token verify rows together.

Two layouts of a step's flat token list:
- *ragged*: rows have different query lengths (prefill chunks mixed with decode rows). Eager only.
- *uniform*: every row has the same query length `q` (decode and verify rows, padded by the
  executor). Static shapes, no host-side branching: this is what CUDA graphs capture.

`TorchPagedAttention` is the pure-PyTorch backend (CPU and GPU). A fused GPU kernel plugs in by
implementing the same `forward` signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers.

    slot_mapping:  [T] int64   flat cache slot of each new token (padding rows: the dummy block)
    block_tables:  [B, M] int32 block ids of each row (unused entries: any valid block)
    context_lens:  [B] int32   tokens in the cache for each row after this step's writes
    query_lens:    host list of each row's new-token count (ragged layout), or None (uniform)
    context_lens_host: host list of context_lens (ragged layout only; avoids device syncs)
    uniform_q:     tokens per row in the uniform layout (0 for ragged)
    cu_seqlens_q:  [B+1] int32 row r's tokens are [cu[r], cu[r+1]) (varlen backends; padding
                   rows are empty, padding tokens sit past cu[B])
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int] | None = None
    context_lens_host: list[int] | None = None
    uniform_q: int = 0
    # Built once per step for the uniform layout by `prepare_uniform_mask` and shared by layers:
    # [B, 1, q, M*block_size] additive mask (0 where a query may attend a key, -inf elsewhere).
    uniform_mask: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None

    @property
    def is_uniform(self) -> bool:
        return self.query_lens is None


def prepare_uniform_mask(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype = torch.float32
) -> None:
    """Fill `meta.uniform_mask` from context lengths, with tensor ops only (graph-safe)."""
    q = meta.uniform_q
    max_keys = meta.block_tables.shape[1] * block_size
    device = meta.context_lens.device
    key_pos = torch.arange(max_keys, device=device)  # [K]
    # Query i of a row sits at position ctx - q + i and sees keys at positions <= its own.
    q_pos = meta.context_lens.long()[:, None] - q + torch.arange(q, device=device)[None, :]
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
    # Additive mask in the compute dtype, built once per step: SDPA then does not convert a
    # boolean mask in every layer.
    meta.uniform_mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, float("-inf")
    )


class AttentionShape:
    """What every attention backend is built from: head counts, head size, KV block size.

    Optional fused entry: a backend with `fused_rope = True` also offers
    `forward_rope(qk, v, cos, sin, kv_cache, meta)`, qk [T, H + KVH, D] the q heads then the k
    heads, cos/sin [T, 1, D]: it rotates q and k in place (as the ops' `rope` does), stores the
    rotated k and v, attends with q = qk[:, :H] and returns [T, H, D], like `ops.rope` followed
    by `forward`. The layer takes it only when its ops allow (`TorchOps.fuse_rope`). Such a
    backend also offers `attend(q, kv_cache, meta)`: `forward` without the store, for a step
    whose rotated k and v the ops' qkv GEMM already wrote (`TorchOps.rope_in_qkv`)."""

    fused_rope = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5


class TorchPagedAttention(AttentionShape):
    """Pure-PyTorch paged attention (SDPA on gathered blocks): the CPU backend and the
    reference the GPU backend is tested against.

    An attention backend is one object shared by every layer of a model, with
    `forward(q, k, v, kv_cache, meta)` (store this step's K/V, then attend) and two facts the
    runner needs: `varlen` (one launch handles rows of any lengths, so drafts need no padding
    and any step can be captured by token count) and `graphs` (CUDA-graph capturable)."""

    name = "sdpa"
    varlen = False
    graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        # Repeat K/V heads before SDPA instead of `enable_gqa`: with a mask, SDPA's GQA path can
        # fall back to the math kernel, while expanded heads can use the fused kernels.
        self.expand_kv = False

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        k_flat = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        v_flat = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if meta.is_uniform:
            return self._uniform(q, kv_cache, meta)
        return self._ragged(q, kv_cache, meta)

    def _gather(
        self, kv_cache: torch.Tensor, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        # block_table: [B, M] -> keys/values [B, KVH, M*BS, D]
        b, m = block_table.shape
        keys = kv_cache[0][block_table].view(b, m * self.block_size, self.num_kv_heads, -1)
        vals = kv_cache[1][block_table].view(b, m * self.block_size, self.num_kv_heads, -1)
        return keys.transpose(1, 2), vals.transpose(1, 2)

    def _sdpa(self, query, keys, vals, mask):
        # query: [B, H, q, D]; keys/vals: [B, KVH, K, D]; mask: broadcastable to [B, H, q, K]
        gqa = self.num_heads != self.num_kv_heads
        if gqa and self.expand_kv:
            groups = self.num_heads // self.num_kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            vals = vals.repeat_interleave(groups, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(
            query, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )

    def _uniform(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
        b = meta.block_tables.shape[0]
        qq = meta.uniform_q
        if meta.uniform_mask is None:
            prepare_uniform_mask(meta, self.block_size, q.dtype)
        keys, vals = self._gather(kv_cache, meta.block_tables)
        query = q.view(b, qq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, q, D]
        out = self._sdpa(query, keys.to(q.dtype), vals.to(q.dtype), meta.uniform_mask)
        return out.transpose(1, 2).reshape(b * qq, self.num_heads, self.head_dim)

    def _ragged(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
        assert meta.query_lens is not None and meta.context_lens_host is not None
        outs = []
        start = 0
        lens = zip(meta.query_lens, meta.context_lens_host, strict=True)
        for row, (qlen, ctx) in enumerate(lens):
            nblocks = -(-ctx // self.block_size)
            keys, vals = self._gather(kv_cache, meta.block_tables[row : row + 1, :nblocks])
            keys, vals = keys[:, :, :ctx], vals[:, :, :ctx]
            query = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
            q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            out = self._sdpa(query, keys.to(q.dtype), vals.to(q.dtype), mask)
            outs.append(out[0].transpose(0, 1))
            start += qlen
        return torch.cat(outs, dim=0)
