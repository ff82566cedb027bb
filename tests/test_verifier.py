"""The verifier preserves the target distribution (chi-square) and greedy is exact."""

import random

import pytest
import torch
from scipy.stats import chisquare

from specwire.target_service.request import SamplingConfig
from specwire.target_service.verifier import rejection_sample, sampling_probs

V = 6
P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])  # a deliberately bad draft model
N = 20000


def _first_tokens(draw) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    probs = torch.stack([P, P])  # position 0 verifies the draft, position 1 is the bonus
    return [draw(probs, gen, rng)[0] for _ in range(N)]


def _assert_matches_p(tokens: list[int]) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    stat, pvalue = chisquare(counts.numpy(), (P.double() * N).numpy())
    assert pvalue > 1e-3, f"output distribution differs from p: chi2={stat:.1f} p={pvalue:.2e}"


def test_point_mass_drafts_preserve_distribution():
    # Drafts come from Q but without probabilities: the verifier treats them as point masses.
    def draw(probs, gen, rng):
        x = rng.choices(range(V), weights=Q.tolist())[0]
        return rejection_sample(probs, [x], None, gen)

    _assert_matches_p(_first_tokens(draw))


def test_drafts_with_probabilities_preserve_distribution():
    ids = list(range(V))

    def draw(probs, gen, rng):
        x = rng.choices(range(V), weights=Q.tolist())[0]
        return rejection_sample(probs, [x], [(ids, Q.tolist())], gen)

    _assert_matches_p(_first_tokens(draw))


def test_sparse_draft_distribution_preserves_distribution():
    # q's support is a subset of the vocabulary (a top-k drafter).
    ids, qs = [1, 2, 4], [0.2, 0.5, 0.3]

    def draw(probs, gen, rng):
        x = rng.choices(ids, weights=qs)[0]
        return rejection_sample(probs, [x], [(ids, qs)], gen)

    _assert_matches_p(_first_tokens(draw))


def test_bad_drafts_are_still_exact_and_accepting_good_ones_is_likely():
    gen = torch.Generator().manual_seed(0)
    probs = torch.stack([torch.tensor([0.0, 1.0, 0, 0, 0, 0])] * 3)
    # p is a point mass on 1: a draft of 1 is always accepted, a draft of 3 never is.
    assert rejection_sample(probs, [1, 1], None, gen) == [1, 1, 1]
    assert rejection_sample(probs, [3, 1], None, gen) == [1]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 1.0), (0, 0.6), (3, 0.7)])
def test_sampling_probs_truncation(top_k, top_p):
    logits = torch.log(P)[None]
    probs = sampling_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p))[0]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    kept = (probs > 0).sum().item()
    if top_k:
        assert kept <= top_k
    if top_p < 1.0:
        # The smallest prefix of the sorted (top-k renormalised) distribution reaching top_p.
        base = P[: top_k or V] / P[: top_k or V].sum()
        need = int((torch.cumsum(base, 0) < top_p).sum().item()) + 1
        assert kept == need
    if not top_k and top_p == 1.0:
        assert torch.allclose(probs, P, atol=1e-6)


def test_invalid_sampling_params_are_refused():
    for kwargs in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingConfig(**kwargs)


def test_plain_rows_recorded_at_once_equal_one_at_a_time() -> None:
    """The overlapped step records its draft-free rows in one call (SpecStats.record_plain)."""
    from specwire.target_service.request import SpecStats

    for before in ([], [(3, 2), (4, 0)]):
        one, many = SpecStats(), SpecStats()
        for d, a in before:
            one.record(d, a)
            many.record(d, a)
        for _ in range(5):
            one.record(0, 0)
        many.record_plain(5)
        many.record_plain(0)
        assert one == many
    empty = SpecStats()
    empty.record_plain(0)
    assert empty == SpecStats() and empty.histogram == []  # nothing verified: nothing recorded


def test_a_steps_rows_recorded_at_once_equal_one_at_a_time() -> None:
    """The synchronous step records its rows' (drafted, accepted) in one call
    (SpecStats.record_many), growing the histogram as `record` does."""
    import random

    from specwire.target_service.request import SpecStats

    rng = random.Random(3)
    for _ in range(50):
        one, many = SpecStats(), SpecStats()
        for _ in range(rng.randint(0, 4)):
            rows = [(d, rng.randint(0, d)) for d in rng.choices(range(9), k=rng.randint(0, 6))]
            for d, a in rows:
                one.record(d, a)
            many.record_many(rows)
        assert one == many
