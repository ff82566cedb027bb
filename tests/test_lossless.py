"""Greedy speculation is lossless: identical token ids with and without it, for every drafter.

The engine runs for real (tiny-random or SmolLM2-135M on the CPU, fp32), all prompts in flight
at once so requests join and leave the batch between steps.
"""

from __future__ import annotations

import pytest
from engine_driver import run_to_completion
from lossless_prompts import lossless_prompts

from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine

PROMPTS = lossless_prompts(50)


run_all = run_to_completion


def _engine(model, drafter, k=4, **kw):
    cfg = TargetConfig(
        model=model,
        drafter=drafter,
        max_draft_len=k,
        progress=False,
        max_batch_size=kw.pop("max_batch_size", 16),
        **kw,
    )
    return build_engine(cfg)


@pytest.fixture(scope="module")
def tiny_baseline():
    eng = _engine("tiny-random", "none")
    return [c.token_ids for c in run_all(eng, PROMPTS)]


DRAFTERS = [
    "ngram",
    "examples.python.lookup_drafter:LastOccurrenceDrafter",  # session contract, in-process
    "model:tiny-random",  # a draft model in-process, KV blocks from its own pool
    "adversarial_drafters:RandomDrafter",
    "adversarial_drafters:EmptyDrafter",
    "adversarial_drafters:OverlongDrafter",
    "adversarial_drafters:OutOfVocabDrafter",
    "adversarial_drafters:ExplodingDrafter",
]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_tiny_random_lossless_for_every_drafter(tiny_baseline, drafter):
    eng = _engine("tiny-random", drafter)
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == tiny_baseline
    total = eng.executor.stats
    if drafter in ("ngram", DRAFTERS[1], DRAFTERS[5]):
        assert total.accepted_tokens > 0, "a working drafter should get drafts accepted"
    if drafter == "model:tiny-random":  # the target's own weights: every draft is right
        assert total.accepted_tokens == total.draft_tokens > 0
    eng.resources.check_integrity()  # the drafter's sessions (and draft KV blocks) are gone
    sessions = eng.resources.get("draft_sessions")
    assert sessions is None or len(sessions) == 0
    if drafter.endswith("EmptyDrafter") or drafter.endswith("ExplodingDrafter"):
        assert total.draft_tokens == 0
    if drafter.endswith("OverlongDrafter"):
        assert total.truncated_draft_tokens > 0
    if drafter.endswith("OutOfVocabDrafter"):
        assert total.refused_draft_tokens > 0
    # Padding never counts: accepted <= drafted, and each histogram bin is a real count.
    assert total.accepted_tokens <= total.draft_tokens
    assert sum(total.histogram) == total.steps


def test_per_request_speculation_off_is_plain_decoding(tiny_baseline):
    eng = _engine("tiny-random", "ngram")
    results = run_all(eng, PROMPTS[:10], speculate=False)
    assert [c.token_ids for c in results] == tiny_baseline[:10]
    assert eng.executor.stats.draft_tokens == 0


def test_preemption_under_kv_pressure_is_lossless(tiny_baseline):
    # 40 blocks of 16 slots for 50 requests: the scheduler must queue and preempt.
    eng = _engine("tiny-random", "ngram", num_kv_blocks=40, max_num_tokens=256)
    results = run_all(eng, PROMPTS)
    assert [c.token_ids for c in results] == tiny_baseline


@pytest.mark.slow
def test_smollm2_ngram_lossless_on_50_prompts(smollm2):
    base = run_all(
        build_engine(
            TargetConfig(model="smollm2-135m", drafter="none", progress=False), loaded=smollm2
        ),
        PROMPTS,
        16,
    )
    eng = build_engine(
        TargetConfig(model="smollm2-135m", drafter="ngram", progress=False), loaded=smollm2
    )
    spec = run_all(eng, PROMPTS, 16)
    pairs = enumerate(zip(base, spec, strict=True))
    mismatched = [i for i, (a, b) in pairs if a.token_ids != b.token_ids]
    assert not mismatched, f"prompts {mismatched} differ with speculation"
    assert eng.executor.stats.accepted_tokens > 0
