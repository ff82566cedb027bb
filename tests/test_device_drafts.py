"""`--draft-on-device`: the n-gram lookup runs where the step runs (runner.device_drafts), from a
token cache beside the KV cache. The drafts must be exactly the host drafter's — so the same
steps, the same acceptance — and the output that of plain greedy decoding. On the CPU the
lookup is `NGramIndex` over the token cache (the plumbing: cache, offsets, the real drafts
replacing the placeholders); on a GPU (marked `gpu`) the Triton kernel inside the graphs."""

from __future__ import annotations

import pytest
import torch
from engine_driver import counter, run_to_completion
from lossless_prompts import lossless_prompts

from specwire.common.errors import UserError
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine

PROMPTS = lossless_prompts(50)


def _engine(drafter: str, **kw):
    kw.setdefault("max_batch_size", 16)
    return build_engine(
        TargetConfig(model="tiny-random", drafter=drafter, max_draft_len=4, progress=False, **kw)
    )


def _run(eng):
    out = [c.token_ids for c in run_to_completion(eng, PROMPTS)]
    stats = eng.executor.stats
    eng.resources.check_integrity()
    return out, (stats.steps, stats.draft_tokens, stats.accepted_tokens, list(stats.histogram))


@pytest.mark.parametrize(
    "kw", [{}, {"num_kv_blocks": 40, "max_num_tokens": 256}, {"two_batch_rows": 2}]
)
def test_drafts_on_the_device_are_the_host_drafters_and_lossless(kw):
    """50 prompts at once (and again with 40 KV blocks: preemption re-feeds whole sequences,
    which must rewrite the token cache; and in two alternating halves, whose steps are read
    one launch later): plain greedy output, and the in-process n-gram drafter's steps, drafts
    and acceptance exactly."""
    plain, _ = _run(_engine("none", **kw))
    host, host_stats = _run(_engine("ngram", **kw))
    eng = _engine("ngram", draft_on_device=True, **kw)
    missed = _count_misses(eng)
    device, device_stats = _run(eng)
    assert host == plain
    assert device == plain
    assert host_stats[2] > 0  # drafts were accepted
    assert device_stats == host_stats
    # Placeholders go only to rows whose lookup finds a match (the host knows which): no row
    # verifies a budget of placeholders for nothing.
    assert missed["drafting rows"] > 0 and missed["no match"] == 0
    assert len(eng.resources.get("device_ngram_seen")) == 0  # freed with the requests
    if kw.get("two_batch_rows"):
        assert counter(eng, "two_batch_steps") > 0
    if kw.get("num_kv_blocks"):
        assert counter(eng, "preemptions") > 0


def _count_misses(eng) -> dict[str, int]:
    """Wrap the engine's device lookup: rows asked to draft, and those it found no match for."""
    dd, seen = eng.runner.device_drafts, {"drafting rows": 0, "no match": 0}
    draft = dd.draft

    def counted(ids, slots, tables, lengths, caps, offsets, drafts_out, found_out):
        draft(ids, slots, tables, lengths, caps, offsets, drafts_out, found_out)
        asked = caps > 0
        seen["drafting rows"] += int(asked.sum())
        seen["no match"] += int((asked & ~found_out).sum())

    dd.draft = counted
    return seen


def test_draft_on_device_needs_the_ngram_drafter():
    with pytest.raises(UserError, match="--draft-on-device .* needs --drafter ngram, got"):
        TargetConfig(model="tiny-random", drafter="none", draft_on_device=True, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_drafts_on_the_device_are_the_host_drafters_and_lossless(graphs):
    """The Triton lookup inside the step's CUDA graphs (and eager): fp32, the same output as
    plain greedy decoding and the host drafter's steps and acceptance."""
    kw = {"device": "cuda", "dtype": "float32", "cuda_graphs": graphs, "draft_policy": "static"}
    plain, _ = _run(_engine("none", **kw))
    host, host_stats = _run(_engine("ngram", **kw))
    device, device_stats = _run(_engine("ngram", draft_on_device=True, **kw))
    assert host == plain and device == plain
    assert host_stats[2] > 0
    assert device_stats == host_stats
