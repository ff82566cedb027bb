"""Prompt-lookup / n-gram drafting: one implementation for the in-process and remote drafters.

Pool semantics. Each sequence has its own pool (no cross-request leakage, freed with the
request). The pool maps every n-gram (1 <= n <= max_ngram) of the committed tokens to the
position just after one of its occurrences. A query takes the longest suffix of the sequence
(max_ngram tokens down to 1) that occurred before, and proposes the tokens that followed that
occurrence, up to the budget; a continuation that runs into the end of the sequence continues
periodically (copy with overlap), so repetitive text gets full-length drafts. With
`prefer="latest"` (default) the most recent earlier occurrence wins, which suits editing and
repetitive code; `prefer="oldest"` keeps the first.
Indexing is incremental: each committed token is indexed once, so a step costs O(new tokens x
max_ngram), not O(sequence length).
"""

from __future__ import annotations


class NGramIndex:
    """The n-gram pool of one sequence."""

    def __init__(self, max_ngram: int = 3, prefer: str = "latest") -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        if prefer not in ("latest", "oldest"):
            raise ValueError(f"prefer must be 'latest' or 'oldest', got {prefer!r}")
        self.max_ngram = max_ngram
        self.prefer_latest = prefer == "latest"
        self.tokens: list[int] = []
        self._pool: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # continuation starts < _indexed are in the pool

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append committed tokens and index the n-grams they complete."""
        self.tokens.extend(new_tokens)
        toks = self.tokens
        # A continuation start e needs at least one token after it: index e < len(toks).
        for e in range(max(self._indexed, 1), len(toks)):
            for n in range(1, min(self.max_ngram, e) + 1):
                key = tuple(toks[e - n : e])
                if self.prefer_latest or key not in self._pool:
                    self._pool[key] = e
        self._indexed = max(self._indexed, len(toks))

    def propose(self, budget: int) -> list[int]:
        """Up to `budget` tokens continuing the longest earlier match of the suffix."""
        toks = self.tokens
        if budget <= 0 or len(toks) < 2:
            return []
        for n in range(min(self.max_ngram, len(toks) - 1), 0, -1):
            start = self._pool.get(tuple(toks[-n:]))
            if start is not None:
                # Copy with overlap (like LZ77): a match close to the end continues into the
                # draft itself, so periodic text ("abcabc...") gets full-length drafts.
                out: list[int] = []
                for j in range(budget):
                    i = start + j
                    out.append(toks[i] if i < len(toks) else out[i - len(toks)])
                return out
        return []
