"""The n-gram pool: proposals equal a brute-force reading of its definition (longest suffix
with an earlier occurrence that has a token after it, latest or oldest, copy with overlap)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from specwire.common.ngram import MAX_TOKEN_ID, VOTE, NGramIndex


def reference(tokens: list[int], max_ngram: int, latest: bool, budget: int) -> list[int]:
    n_tok = len(tokens)
    if budget <= 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n, n_tok) if tokens[e - n : e] == suffix]
        if ends:
            # The first VOTE occurrences in the preferred order vote with their next token;
            # the first of the winners (a tie: the one seen first) is continued.
            seen = sorted(ends, reverse=latest)[:VOTE]
            votes = Counter(tokens[e] for e in seen)
            start = next(e for e in seen if votes[tokens[e]] == max(votes.values()))
            out: list[int] = []
            for j in range(budget):
                i = start + j
                out.append(tokens[i] if i < n_tok else out[i - n_tok])
            return out
    return []


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(
        st.lists(
            st.integers(0, 6) | st.integers(0xD7FE, 0xE001) | st.integers(0, MAX_TOKEN_ID - 1),
            max_size=12,
        ),
        max_size=8,
    ),
    max_ngram=st.integers(1, 4),
    latest=st.booleans(),
    budget=st.integers(0, 6),
)
def test_proposals_match_the_definition(chunks, max_ngram, latest, budget):
    """Small alphabets make many overlapping matches; ids around the surrogate range are
    stored shifted; huge ids cover the rest of what the pool holds."""
    index = NGramIndex(max_ngram, "latest" if latest else "oldest")
    seen: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        seen += chunk
        assert index.propose(budget) == reference(seen, max_ngram, latest, budget)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=9), st.booleans()), min_size=1, max_size=30
    ),
    max_ngram=st.integers(1, 8),
    latest=st.booleans(),
)
def test_a_growing_index_asked_now_and_then_matches_the_definition(steps, max_ngram, latest):
    """Queries now and then while the sequence grows by chunks of any size (new text joins
    the searched string only at a query): every proposal is the definition's."""
    index = NGramIndex(max_ngram, "latest" if latest else "oldest")
    seen: list[int] = []
    for chunk, ask in steps:
        index.extend(chunk)
        seen += chunk
        if ask:
            assert index.propose(4) == reference(seen, max_ngram, latest, 4)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=2, max_size=60),
    max_ngram=st.integers(1, 8),
    latest=st.booleans(),
)
def test_the_vote_on_a_tiny_alphabet(tokens, max_ngram, latest):
    """Three ids: suffixes recur often, with different next tokens, so the vote decides."""
    index = NGramIndex(max_ngram, "latest" if latest else "oldest")
    index.extend(tokens)
    assert index.propose(5) == reference(tokens, max_ngram, latest, 5)


def test_the_next_token_most_recent_occurrences_share_wins():
    index = NGramIndex(1)
    index.extend([1, 3, 1, 3, 1, 2, 1])  # after "1": 2 once (the latest), 3 twice
    assert index.propose(2) == [3, 1]
    index = NGramIndex(1)
    index.extend([1, 2, 1, 3, 1, 3, 1, 2, 1])  # 2 and 3 twice each: the latest wins the tie
    assert index.propose(2) == [2, 1]


def test_a_match_straddling_two_tokens_is_not_a_match():
    # 256 = bytes 00 01 00.., so the byte pattern of [1, 0] appears inside [256, 0] shifted.
    index = NGramIndex(2)
    index.extend([256, 0, 0, 7, 1])
    assert index.propose(3) == reference([256, 0, 0, 7, 1], 2, True, 3)


def test_periodic_text_gets_full_length_drafts():
    index = NGramIndex(3)
    index.extend([1, 2, 3, 1, 2, 3, 1, 2])
    assert index.propose(5) == [3, 1, 2, 3, 1]


def test_an_id_the_pool_cannot_hold_is_refused_whole():
    """The pool holds ids in [0, MAX_TOKEN_ID) (every vocabulary's); another is a ValueError
    (the drafter contract's "cannot hold") and nothing of that update is kept."""
    import pytest

    index = NGramIndex(2)
    index.extend([1, 2, 1])
    for bad in (1 << 40, MAX_TOKEN_ID, -1):
        with pytest.raises(ValueError, match="token ids must lie in"):
            index.extend([2, bad])
    assert len(index) == 3 and index.propose(2) == reference([1, 2, 1], 2, True, 2)


def test_ids_past_the_surrogate_range_and_patterns_that_straddle_ids():
    """Ids around 0xD800 (stored shifted) match only themselves; ids whose byte patterns
    would line up across neighbours (256 = 00 01 00 00) match only whole ids, and a long run
    of them is searched in one scan."""
    index = NGramIndex(2)
    seq = [55295, 55296, 57343, 57344, 100000, 55295, 55296, 57343]
    index.extend(seq)
    assert index.propose(2) == reference(seq, 2, True, 2) == [57344, 100000]
    index = NGramIndex(3)
    seq = [256] * 50_000 + [1, 7, 256, 1]
    index.extend(seq)
    assert index.propose(3) == reference(seq, 3, True, 3)
