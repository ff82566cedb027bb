"""Prompt-lookup / n-gram drafting: one implementation for the in-process and remote drafters.

Pool semantics. Each sequence has its own pool (no cross-request leakage, freed with the
request). The pool maps every n-gram (1 <= n <= max_ngram) of the committed tokens to the
position just after one of its occurrences. A query takes the longest suffix of the sequence
(max_ngram tokens down to 1) that occurred before, and proposes the tokens that followed that
occurrence, up to the budget; a continuation that runs into the end of the sequence continues
periodically (copy with overlap), so repetitive text gets full-length drafts. With
`prefer="latest"` (default) the most recent earlier occurrence wins, which suits editing and
repetitive code; `prefer="oldest"` keeps the first.
The pool is implicit: the tokens are kept as a byte string of fixed-width integers, and a query
searches it (bytes.rfind / find: C speed, aligned matches only) instead of maintaining a dict
of every n-gram. Appending costs nothing per token in Python, which matters when a request
drafts only now and then (the adaptive policy) and its tokens would otherwise all be indexed
at once; a query is a few memory scans of the sequence.

`alternatives` serves the remote target's branches: at each position of a proposal, the other
tokens that followed earlier occurrences of the suffix there (longest n-gram first, latest
occurrence first), each with what followed it.
"""

from __future__ import annotations

from array import array

_WIDTH = 4  # bytes per token in the search buffer (array typecode "i": token ids are int32,
# as on the wire; half the bytes of int64 to scan per query)
_SCAN = 8  # earlier occurrences looked at per n-gram when collecting alternatives


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
        self._buf = bytearray()  # the tokens as fixed-width integers

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append committed tokens. ValueError for an id outside int32 (nothing appended)."""
        try:
            packed = array("i", new_tokens).tobytes()
        except OverflowError as exc:
            raise ValueError(f"token ids must fit in int32: {exc}") from None
        self.tokens.extend(new_tokens)
        self._buf += packed

    def _start(self, tail: bytes, n: int) -> int | None:
        """Where the tokens after the chosen earlier occurrence of the last `n` tokens begin
        (`tail` holds the last few tokens, at least `n`): the latest (or oldest) occurrence
        that has at least one token after it."""
        buf, w = self._buf, _WIDTH
        pattern = tail[len(tail) - n * w :]
        end = len(buf) - w  # an occurrence must end before the last token
        if self.prefer_latest:
            i = buf.rfind(pattern, 0, end)
            while i >= 0 and i % w:  # a match straddling tokens: look further back
                i = buf.rfind(pattern, 0, i + len(pattern) - 1)
        else:
            i = buf.find(pattern, 0, end)
            while i >= 0 and i % w:
                i = buf.find(pattern, i + 1, end)
        return None if i < 0 else i // w + n

    def propose(self, budget: int) -> list[int]:
        """Up to `budget` tokens continuing the longest earlier match of the suffix."""
        toks = self.tokens
        n_tok = len(toks)
        if budget <= 0 or n_tok < 2:
            return []
        longest = min(self.max_ngram, n_tok - 1)
        tail = bytes(self._buf[-longest * _WIDTH :])  # the suffix, copied once for all n
        for n in range(longest, 0, -1):
            start = self._start(tail, n)
            if start is not None:
                out = toks[start : start + budget]
                if len(out) < budget:
                    # Copy with overlap (like LZ77): a match close to the end continues into
                    # the draft itself, so periodic text ("abcabc...") gets full-length drafts.
                    out = (out * (budget // len(out) + 1))[:budget]
                return out
        return []

    def alternatives(
        self, proposal: list[int], positions: int, per_position: int, horizon: int
    ) -> list[tuple[int, int, list[int]]]:
        """(position, token, continuation) for the first `positions` positions of `proposal`
        (a draft continuing this sequence; position p: after its first p tokens): up to
        `per_position` tokens other than the proposal's own that followed an earlier
        occurrence of the suffix there, each with up to `horizon - p - 1` tokens that
        followed it (near the end continued periodically over the sequence as it would then
        be, like `propose`)."""
        toks, buf, w = self.tokens, self._buf, _WIDTH
        if len(toks) < 2 or per_position <= 0:
            return []
        end = len(buf) - w  # an occurrence must end before the last token (it needs a follower)
        out: list[tuple[int, int, list[int]]] = []
        last = min(positions, len(proposal) + 1, horizon)
        held = min(self.max_ngram, len(toks))
        # The sequence's last tokens, then the proposal's: position p's suffixes end at p.
        ctx = bytes(buf[len(buf) - held * w :]) + array("i", proposal[: last - 1]).tobytes()
        for p in range(last):
            own = proposal[p] if p < len(proposal) else None
            found: dict[int, int] = {}  # token -> where it follows an occurrence
            stop = (held + p) * w
            for n in range(min(self.max_ngram, held + p), 0, -1):
                pattern = ctx[stop - n * w : stop]
                i, scanned = buf.rfind(pattern, 0, end), 0
                while i >= 0 and scanned < _SCAN and len(found) < per_position:
                    if not i % w:
                        scanned += 1
                        start = i // w + n
                        if toks[start] != own:
                            found.setdefault(toks[start], start)
                    i = buf.rfind(pattern, 0, i + len(pattern) - 1)
                if len(found) >= per_position:
                    break
            h = horizon - p - 1
            for token, start in found.items():
                run = toks[start + 1 : start + 1 + h]
                if len(run) < h:
                    # Copy with overlap, as `propose` does, over the sequence as it would be
                    # (its tokens, the proposal's first p, this token): period L + p - start.
                    run += proposal[:p] + [token]
                    run = (run * (h // len(run) + 1))[:h]
                out.append((p, token, run))
        return out
