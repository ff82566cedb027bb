"""Prompt-lookup / n-gram drafting: one implementation for the in-process and remote drafters.

Pool semantics. Each sequence has its own pool (no cross-request leakage, freed with the
request). A query takes the longest suffix of the sequence (max_ngram tokens down to 1) that
occurred before and looks at up to VOTE of its earlier occurrences, the most recent first
(`prefer="latest"`, the default: it suits editing and repetitive code) or the first first
(`prefer="oldest"`). The token most of them went on with wins (a tie goes to the one seen
first), and the draft is what followed the first of those occurrences, up to the budget; a
continuation that runs into the end of the sequence continues periodically (copy with
overlap), so repetitive text gets full-length drafts. In a replay of SmolLM2's greedy
HumanEval outputs (40 prompts, and 40 others held out), max_ngram 8 with the vote took 3.6-3.7 %
fewer steps than max_ngram 3 with the latest occurrence alone (bench/RESULTS.md, round 10).
The pool is implicit: the tokens are also kept as a string, one code point per token, and a
query searches it (str.rfind / find: C speed, and a match can only start at a token, so no
pattern of ids, however chosen, makes a search step through false matches) instead of
maintaining a dict of every n-gram. Appending costs little per token in Python (a join in C;
ids from 0xD800 on are shifted one by one), and the new text joins the string only at the next
query, which matters when a request drafts only now and then (the adaptive policy) and its
tokens would otherwise all be indexed at once; a query is a few memory scans of the sequence
(and one copy of it, when tokens came since the last). Ids must lie in [0, MAX_TOKEN_ID): every
vocabulary's do.

`alternatives` serves the remote target's branches: at each position of a proposal, the other
tokens that followed earlier occurrences of the suffix there (longest n-gram first, latest
occurrence first), each with what followed it.
"""

from __future__ import annotations

_SURROGATES = 0xD800  # code points 0xD800..0xDFFF cannot stand alone in a str: ids from
_SHIFT = 0x800  # here on are stored 0x800 higher
MAX_TOKEN_ID = 0x110000 - _SHIFT  # 1,112,064
_SCAN = 8  # earlier occurrences looked at per n-gram when collecting alternatives
VOTE = 8  # earlier occurrences of the matched suffix whose next tokens vote for the draft
DEFAULT_MAX_NGRAM = 8


def _encode(tokens: list[int]) -> str:
    """One code point per token id; ValueError for an id outside [0, MAX_TOKEN_ID)."""
    if len(tokens) == 0:
        return ""
    lo, hi = min(tokens), max(tokens)
    if hi < _SURROGATES and lo >= 0:
        return "".join(map(chr, tokens))
    if lo < 0 or hi >= MAX_TOKEN_ID:
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}), got {lo if lo < 0 else hi}")
    return "".join([chr(int(t) + _SHIFT if t >= _SURROGATES else t) for t in tokens])


class NGramIndex:
    """The n-gram pool of one sequence."""

    def __init__(
        self, max_ngram: int = DEFAULT_MAX_NGRAM, prefer: str = "latest", vote: int = VOTE
    ) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        if vote < 1:
            raise ValueError(f"vote must be >= 1, got {vote}")
        if prefer not in ("latest", "oldest"):
            raise ValueError(f"prefer must be 'latest' or 'oldest', got {prefer!r}")
        self.max_ngram = max_ngram
        self.prefer_latest = prefer == "latest"
        self.vote = vote  # occurrences that vote (1: the preferred one alone, as in round 9)
        self.tokens: list[int] = []
        self._joined = ""  # the tokens, one code point each (`_encode`), up to the last query
        self._pending: list[str] = []  # what came since

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append committed tokens. ValueError for an id outside [0, MAX_TOKEN_ID) (nothing
        appended)."""
        new_tokens = list(new_tokens)
        text = _encode(new_tokens)
        self.tokens.extend(new_tokens)
        self._pending.append(text)

    @property
    def _text(self) -> str:
        """All the tokens as one string (joined here, at a query, not at every append)."""
        if self._pending:
            self._joined += "".join(self._pending)
            self._pending.clear()
        return self._joined

    def _start(self, text: str, pattern: str, first: int) -> int:
        """Where the tokens after the chosen earlier occurrence of `pattern` (the last n
        tokens) begin, given `first`, the preferred one's start (an occurrence must end before
        the last token): of the first `vote` occurrences in the preferred order, the first
        whose next token most of them share."""
        n, toks = len(pattern), self.tokens
        if self.vote == 1:
            return first + n
        starts = [first + n]
        if self.prefer_latest:
            i = text.rfind(pattern, 0, first + n - 1)
            while i >= 0 and len(starts) < self.vote:
                starts.append(i + n)
                i = text.rfind(pattern, 0, i + n - 1)
        else:
            end = len(text) - 1
            i = text.find(pattern, first + 1, end)
            while i >= 0 and len(starts) < self.vote:
                starts.append(i + n)
                i = text.find(pattern, i + 1, end)
        if len(starts) == 1:
            return starts[0]
        nexts = [toks[s] for s in starts]
        best = max(nexts, key=nexts.count)  # ties: the first in the preferred order
        return starts[nexts.index(best)]

    def _longest(self, text: str, tail: str, end: int) -> tuple[int, int]:
        """(n, i): how many of `tail`'s last tokens occurred before, ending before `end`, and
        where the latest such occurrence starts (-1 if none). The whole tail first (a copy
        in progress matches it, most steps); otherwise bisection, since if the last n did,
        so did the last n - 1 (a miss scans the whole sequence, so this saves most of them
        when max_ngram is large)."""
        hi = len(tail)
        at = text.rfind(tail, 0, end)
        if at >= 0:
            return hi, at
        lo, hi = 0, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            i = text.rfind(tail[len(tail) - mid :], 0, end)
            if i >= 0:
                lo, at = mid, i
            else:
                hi = mid - 1
        return lo, at  # `at` is from the last probe that hit, the one at lo

    def propose(self, budget: int) -> list[int]:
        """Up to `budget` tokens continuing the longest earlier match of the suffix (the
        occurrence the vote picks; see the module docstring)."""
        toks = self.tokens
        n_tok = len(toks)
        if budget <= 0 or n_tok < 2:
            return []
        text = self._text
        tail = text[-min(self.max_ngram, n_tok - 1) :]  # the suffix, copied once
        n, at = self._longest(text, tail, n_tok - 1)
        if not n:
            return []
        if not self.prefer_latest:
            at = text.find(tail[len(tail) - n :], 0, n_tok - 1)
        start = self._start(text, tail[len(tail) - n :], at)
        out = toks[start : start + budget]
        if len(out) < budget:
            # Copy with overlap (like LZ77): a match close to the end continues into the draft
            # itself, so periodic text ("abcabc...") gets full-length drafts.
            out = (out * (budget // len(out) + 1))[:budget]
        return out

    def alternatives(
        self, proposal: list[int], positions: int, per_position: int, horizon: int
    ) -> list[tuple[int, int, list[int]]]:
        """(position, token, continuation) for the first `positions` positions of `proposal`
        (a draft continuing this sequence; position p: after its first p tokens): up to
        `per_position` tokens other than the proposal's own that followed an earlier
        occurrence of the suffix there, each with up to `horizon - p - 1` tokens that
        followed it (near the end continued periodically over the sequence as it would then
        be, like `propose`)."""
        toks, text = self.tokens, self._text
        if len(toks) < 2 or per_position <= 0:
            return []
        end = len(text) - 1  # an occurrence must end before the last token (it needs a follower)
        out: list[tuple[int, int, list[int]]] = []
        last = min(positions, len(proposal) + 1, horizon)
        held = min(self.max_ngram, len(toks))
        # The sequence's last tokens, then the proposal's: position p's suffixes end at p.
        ctx = text[len(text) - held :] + _encode(proposal[: last - 1])
        for p in range(last):
            own = proposal[p] if p < len(proposal) else None
            found: dict[int, int] = {}  # token -> where it follows an occurrence
            stop = held + p
            top, _ = self._longest(text, ctx[max(0, stop - self.max_ngram) : stop], end)
            for n in range(top, 0, -1):
                pattern = ctx[stop - n : stop]
                i, scanned = text.rfind(pattern, 0, end), 0
                while i >= 0 and scanned < _SCAN and len(found) < per_position:
                    scanned += 1
                    start = i + n
                    if toks[start] != own:
                        found.setdefault(toks[start], start)
                    i = text.rfind(pattern, 0, i + n - 1)
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
