"""`model:M`: a specwire model drafting greedily, with its own paged KV cache per session.

Each session owns KV blocks from the drafter's own `BlockPool` (specwire/common/kv_blocks.py);
`release`
gives them back, so whoever ends a session (the target's resource registry freeing a request,
or the drafter service's session store) frees its blocks. The cache is lazy: nothing is
computed when tokens are committed; a propose call computes only the tokens whose K/V are not
already valid, then drafts one token per forward call. Rollback is free: the state remembers
which tokens its cache holds (`cached`: committed prefix + drafts it forwarded), and the longest
common prefix of `cached` and the committed tokens is what stays valid; K/V past it are simply
overwritten by the next forward.

Draft probabilities. A greedy draft token is a point mass, so by default none are sent (the
target then verifies with point masses, which is lossless). With `probs_top_n > 0` the drafter
instead *samples* each draft token from its renormalised top-N softmax and reports exactly that
distribution, which is what rejection sampling needs to be lossless with q != point mass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.common.drafting import Proposal, SessionDrafter, SparseDist
from specwire.common.kv_blocks import BlockPool
from specwire.common.model.attention import AttentionMetadata
from specwire.common.model.paged import blocks_for, slot_of


@dataclass
class ModelSessionState:
    tokens: list[int] = field(default_factory=list)  # committed tokens
    cached: list[int] = field(default_factory=list)  # tokens whose K/V sit in `blocks`, in order
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Row:
    index: int  # position in the propose_batch arguments
    state: ModelSessionState
    budget: int
    start: int  # first token to compute (everything before it is cached)
    drafts: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ModelDrafter(SessionDrafter):
    """Greedy (or top-N sampling) drafting with a `specwire.common.model.llama.LlamaModel`."""

    def __init__(
        self,
        model: Any,  # specwire.common.model.llama.LlamaModel
        *,
        name: str,
        vocab_size: int,
        tokenizer_fingerprint: str = "",
        num_blocks: int = 512,
        probs_top_n: int = 0,
        seed: int = 0,
    ) -> None:
        if probs_top_n < 0:
            raise ValueError(f"probs_top_n must be >= 0, got {probs_top_n}")
        self.model = model
        self.name = name
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.capabilities = ("draft_probs",) if probs_top_n else ()
        self.block_size: int = model.block_size
        self.max_positions: int = int(model.rotary.cos.shape[0])
        self.kv = model.allocate_kv_cache(num_blocks)  # [L, 2, NB, BS, KVH, D]
        self.device = self.kv.device
        self.allocator = BlockPool(num_blocks)
        self.probs_top_n = probs_top_n
        self._gen = torch.Generator(device=self.device).manual_seed(seed)

    # -- session state ------------------------------------------------------------------------

    def new_state(self) -> ModelSessionState:
        return ModelSessionState()

    def extend(self, state: ModelSessionState, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        state.tokens.extend(tokens)

    def release(self, state: ModelSessionState) -> None:
        self.allocator.free(state.blocks)
        state.blocks = []
        state.cached = []

    def check_integrity(self, live_states: Sequence[Any]) -> None:
        self.allocator.check_integrity([b for s in live_states for b in s.blocks])

    # -- drafting -----------------------------------------------------------------------------

    def propose(self, state: Any, budget: int, want_probs: bool = False) -> Proposal:
        return self.propose_batch([state], [budget], want_probs)[0]

    def propose_batch(
        self, states: Sequence[Any], budgets: Sequence[int], want_probs: bool = False
    ) -> list[Proposal]:
        out: list[Proposal] = [Proposal([]) for _ in states]
        rows: list[_Row] = []
        for i, (st, budget) in enumerate(zip(states, budgets, strict=True)):
            n = len(st.tokens)
            budget = min(budget, self.max_positions - n)  # drafts never pass the RoPE table
            # Positions 0 .. n+budget-2 are forwarded (the last draft token never is).
            if budget <= 0 or n == 0 or not self._reserve(st, n + budget - 1):
                continue
            rows.append(_Row(i, st, budget, min(_common_prefix(st.cached, st.tokens), n - 1)))
        if not rows:
            return out
        self._select(rows, self._prefill(rows))
        for k in range(1, max(r.budget for r in rows)):
            active = [r for r in rows if r.budget > k]
            self._select(active, self._decode(active, k))
        for r in rows:
            n = len(r.state.tokens)
            r.state.cached = r.state.tokens[:n] + r.drafts[:-1]
            probs = r.dists if want_probs and self.probs_top_n else None
            out[r.index] = Proposal(r.drafts, probs)
        return out

    def _reserve(self, st: ModelSessionState, num_tokens: int) -> bool:
        need = blocks_for(num_tokens, self.block_size) - len(st.blocks)
        if need <= 0:
            return True
        got = self.allocator.allocate(need)
        if got is None:
            return False  # out of KV blocks: this session drafts nothing this step
        st.blocks.extend(got)
        return True

    def _slots(self, st: ModelSessionState, positions: range) -> list[int]:
        bs = self.block_size
        return [slot_of(st.blocks, t, bs) for t in positions]

    def _block_tables(self, rows: list[_Row]) -> torch.Tensor:  # [R, M] int32
        width = max(len(r.state.blocks) for r in rows)
        table = [r.state.blocks + [0] * (width - len(r.state.blocks)) for r in rows]
        return torch.tensor(table, dtype=torch.int32, device=self.device)

    def _prefill(self, rows: list[_Row]) -> torch.Tensor:  # -> logits [R, V]
        # Ragged: each row computes its uncached tokens; logits only at each row's last token.
        ids, pos, slots, qlens, ctx = [], [], [], [], []
        for r in rows:
            n = len(r.state.tokens)
            ids += r.state.tokens[r.start : n]
            pos += range(r.start, n)
            slots += self._slots(r.state, range(r.start, n))
            qlens.append(n - r.start)
            ctx.append(n)
        meta = AttentionMetadata(
            slot_mapping=self._long(slots),
            block_tables=self._block_tables(rows),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=self.device),
            query_lens=qlens,
            context_lens_host=ctx,
        )
        hidden = self.model.forward(self._long(ids), self._long(pos), self.kv, meta)  # [T, H]
        last = torch.tensor(qlens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])

    def _decode(self, rows: list[_Row], k: int) -> torch.Tensor:  # -> logits [R, V]
        # Uniform, one token per row: draft k-1 sits at position n + k - 1.
        pos = [len(r.state.tokens) + k - 1 for r in rows]
        meta = AttentionMetadata(
            slot_mapping=self._long(
                [self._slots(r.state, range(p, p + 1))[0] for r, p in zip(rows, pos, strict=True)]
            ),
            block_tables=self._block_tables(rows),
            context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=self.device),
            uniform_q=1,
        )
        ids = self._long([r.drafts[-1] for r in rows])
        hidden = self.model.forward(ids, self._long(pos), self.kv, meta)
        return self.model.compute_logits(hidden)

    def _select(self, rows: list[_Row], logits: torch.Tensor) -> None:
        # logits: [R, V] fp32
        if not self.probs_top_n:
            for r, t in zip(rows, logits.argmax(-1).tolist(), strict=True):
                r.drafts.append(int(t))
            return
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_i = probs.topk(min(self.probs_top_n, probs.shape[-1]), dim=-1)  # [R, N]
        top_p = top_p / top_p.sum(-1, keepdim=True)
        pick = torch.multinomial(top_p, 1, generator=self._gen).squeeze(-1)  # [R]
        for r, j, ids, ps in zip(rows, pick.tolist(), top_i.tolist(), top_p.tolist(), strict=True):
            r.drafts.append(int(ids[j]))
            r.dists.append((ids, ps))

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
