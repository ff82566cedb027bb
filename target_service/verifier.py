"""Verification: which drafts the target accepts, and the token that follows them.

Greedy rows accept the longest draft prefix equal to the target's argmax, then add the
target's own next token (the bonus token when every draft matched): the output is token for
token what plain greedy decoding gives. Sampled rows use rejection sampling, which preserves
the target distribution exactly: a draft without probabilities is a point mass (accept x with
probability p(x), on rejection sample from p with x removed); with draft distribution q, accept
with min(1, p(x)/q(x)) and resample from max(0, p - q). Only real drafts are looked at; the
executor's padding never is. Random numbers come from each request's own generator.
"""

from __future__ import annotations

import torch

from target_service.request import Request, SamplingConfig
from target_service.runner.model_runner import StepLogits


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


class Verifier:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def verify(self, requests: list[Request], step: StepLogits) -> list[list[int]]:
        """New committed tokens for each decode request (same order as `step.spans`)."""
        greedy = [r.sampling.greedy for r in requests]
        argmax: list[int] = []
        if any(greedy):
            argmax = step.logits.argmax(dim=-1).tolist()  # one device sync for the whole step
        results: list[list[int]] = []
        for req, (off, _n) in zip(requests, step.spans, strict=False):
            drafts = req.draft_tokens[: req.num_real_drafts]
            if req.sampling.greedy:
                targets = argmax[off : off + len(drafts) + 1]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                    accepted += 1
                results.append(drafts[:accepted] + [targets[accepted]])
            else:
                rows = step.logits[off : off + len(drafts) + 1]
                probs = sampling_probs(rows, req.sampling).cpu()
                results.append(rejection_sample(probs, drafts, req.draft_probs, req.generator))
        return results
