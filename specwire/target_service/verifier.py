"""Verification: which drafts the target accepts, and the token that follows them.

Greedy rows accept the longest draft prefix equal to the target's argmax, then add the
target's own next token (the bonus token when every draft matched): the output is token for
token what plain greedy decoding gives. Sampled rows use rejection sampling, which preserves
the target distribution exactly: a draft without probabilities is a point mass (accept x with
probability p(x), on rejection sample from p with x removed); with draft distribution q, accept
with min(1, p(x)/q(x)) and resample from max(0, p - q). Only real drafts are looked at; the
executor's padding never is. Random numbers come from each request's own generator.

For requests that ask (`SamplingConfig.logprobs`), the verifier also reports each committed
token's log-probability under the target's raw distribution (log_softmax of the logits at the
position that produced it, before temperature/top-k/top-p), plus the top alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specwire.target_service.request import Request, SamplingConfig
from specwire.target_service.runner.model_runner import StepLogits
from specwire.target_service.scheduler import Row


def sampling_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[n, V] logits -> [n, V] fp32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen).item())


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen).item())


def rejection_sample(
    probs: torch.Tensor,  # [n_real + 1, V] target probabilities (CPU)
    drafts: list[int],
    draft_probs: list[tuple[list[int], list[float]]] | None,
    gen: torch.Generator | None,
) -> list[int]:
    """Accepted drafts followed by one resampled or bonus token."""
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = probs[i]
        if draft_probs is not None:
            ids, qs = draft_probs[i]
            q = torch.zeros_like(p)
            q[torch.tensor(ids, dtype=torch.long)] = torch.tensor(qs, dtype=p.dtype)
            q = q / q.sum().clamp_min(1e-30)
        else:
            q = torch.zeros_like(p)
            q[x] = 1.0
        qx = float(q[x])
        if qx > 0 and _uniform(gen) < min(1.0, float(p[x]) / qx):
            out.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        out.append(_sample(residual / total if total > 0 else p, gen))
        return out
    out.append(_sample(probs[len(drafts)], gen))
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability and the `top` most likely (id, logprob) there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(
    logits: torch.Tensor,  # [N, V] the step's logits
    rows: list[tuple[int, list[int], int]],  # per row: (logit offset, committed tokens, top-k)
) -> list[list[TokenLogprob]]:
    """Logprobs of each row's committed tokens: token j was chosen at logits[offset + j].

    One log_softmax (and one top-k) over just these rows' positions, batched for the step."""
    index = [off + j for off, toks, _k in rows for j in range(len(toks))]
    if not index:
        return [[] for _ in rows]
    at = torch.tensor(index, device=logits.device)
    logp = torch.log_softmax(logits[at].float(), dim=-1)  # [P, V]
    chosen = torch.tensor([t for _o, toks, _k in rows for t in toks], device=logits.device)
    picked = logp.gather(1, chosen[:, None])[:, 0].tolist()  # [P]
    k_max = max(k for _o, _t, k in rows)
    top_lp: list[list[float]] = [[] for _ in index]
    top_id: list[list[int]] = [[] for _ in index]
    if k_max:
        top = torch.topk(logp, k_max, dim=-1)
        top_lp, top_id = top.values.tolist(), top.indices.tolist()
    out: list[list[TokenLogprob]] = []
    p = 0
    for _off, toks, k in rows:
        row = []
        for t in toks:
            row.append(
                TokenLogprob(t, picked[p], list(zip(top_id[p][:k], top_lp[p][:k], strict=True)))
            )
            p += 1
        out.append(row)
    return out


class Verified(NamedTuple):
    """verify()'s result, per decode row: committed tokens, and logprobs when asked for."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]


class Verifier:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def verify(self, rows: list[Row], step: StepLogits) -> Verified:
        """New committed tokens for each decode row (same order as `step.spans`), and their
        logprobs for the requests that asked (None for the others)."""
        requests = [row.request for row in rows]
        greedy = [r.sampling.greedy for r in requests]
        argmax: list[int] = []
        if any(greedy):
            argmax = step.tokens()
        results: list[list[int]] = []
        for row, (off, _n) in zip(rows, step.spans, strict=False):
            req, drafts = row.request, row.drafts
            if req.sampling.greedy:
                targets = argmax[off : off + len(drafts) + 1]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                    accepted += 1
                results.append(drafts[:accepted] + [targets[accepted]])
            else:
                rows = step.logits[off : off + len(drafts) + 1]
                probs = sampling_probs(rows, req.sampling).cpu()
                results.append(rejection_sample(probs, drafts, row.draft_probs, req.generator))
        return Verified(results, self._logprobs(requests, step, results))

    def _logprobs(
        self, requests: list[Request], step: StepLogits, tokens: list[list[int]]
    ) -> list[list[TokenLogprob] | None]:
        asked = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(requests)
        if not asked:
            return out
        rows = [(step.spans[i][0], tokens[i], requests[i].sampling.logprobs or 0) for i in asked]
        for i, lps in zip(asked, token_logprobs(step.logits, rows), strict=True):
            out[i] = lps
        return out
