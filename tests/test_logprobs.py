"""Logprobs and n > 1 through the gRPC API (a real TargetServer on loopback, tiny-random, fp32).

Logprobs are the target's raw distribution: with speculation they must equal those without it
(the verifier has the target's logits at every committed position), and the first one must be
log_softmax of a direct forward over the prompt.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from paged_runner import prompt_logits

from specwire.common.client import GenerationClient, build_request
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.server import TargetServer

PROMPT = "a b c a b c a b c a b"  # periodic: the n-gram drafter's drafts get accepted


@pytest.fixture(scope="module")
def client(tiny):
    cfg = TargetConfig(
        model="tiny-random", drafter="ngram", max_draft_len=4, progress=False, max_context_len=512
    )
    server = TargetServer("127.0.0.1", 0)
    server.start()
    server.attach(build_engine(cfg, loaded=tiny))
    with GenerationClient(f"127.0.0.1:{server.port}", timeout=120) as c:
        yield c
    server.stop(0)


def stream(client, **kw) -> list:
    return list(client.stream(build_request(**kw)))


def logprobs(client, **kw):
    """(token ids, per-token logprob entries, accepted drafts) of an n = 1 request."""
    ids, lps, accepted = [], [], 0
    for msg in stream(client, **kw):
        if msg.WhichOneof("response") == "chunk":
            assert len(msg.chunk.logprobs) == len(msg.chunk.token_ids)
            ids += msg.chunk.token_ids
            lps += msg.chunk.logprobs
            accepted += msg.chunk.accepted_tokens
    return ids, lps, accepted


def test_logprobs_with_speculation_equal_logprobs_without(client, tiny):
    kw = dict(prompt=PROMPT, max_new_tokens=24, temperature=0.0, logprobs=True, top_logprobs=5)
    ids_spec, spec, accepted = logprobs(client, **kw)
    ids_plain, plain, _ = logprobs(client, speculate=False, **kw)
    assert accepted > 0, "no draft was accepted: the test would not exercise speculation"
    assert ids_spec == ids_plain
    for a, b in zip(spec, plain, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
        for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    # Greedy: the chosen token is the most likely one, so it heads the alternatives.
    assert all(lp.top_logprobs[0].token_id == lp.token_id for lp in spec)
    assert all(len(lp.top_logprobs) == 5 for lp in spec)


def test_first_logprob_is_log_softmax_of_a_direct_forward(client, tiny):
    ids, lps, _ = logprobs(client, prompt=PROMPT, max_new_tokens=3, logprobs=True, top_logprobs=3)
    with torch.inference_mode():
        ref = torch.log_softmax(prompt_logits(tiny.model, tiny.tokenizer.encode(PROMPT))[-1], -1)
    first = lps[0]
    assert first.token_id == ids[0]
    assert first.logprob == pytest.approx(ref[ids[0]].item(), abs=1e-5)
    top = torch.topk(ref, 3)
    assert [t.token_id for t in first.top_logprobs] == top.indices.tolist()
    assert first.token == tiny.tokenizer.decode([ids[0]])


def test_sampled_logprobs_are_those_of_the_raw_distribution(client):
    # Temperature changes which token is drawn, not the distribution logprobs report: the first
    # position's alternatives are the same as under greedy decoding.
    _, greedy, _ = logprobs(client, prompt=PROMPT, max_new_tokens=1, logprobs=True, top_logprobs=5)
    _, sampled, _ = logprobs(
        client,
        prompt=PROMPT,
        max_new_tokens=1,
        temperature=0.7,
        seed=3,
        logprobs=True,
        top_logprobs=5,
    )
    pairs = [(t.token_id, round(t.logprob, 4)) for t in greedy[0].top_logprobs]
    assert [(t.token_id, round(t.logprob, 4)) for t in sampled[0].top_logprobs] == pairs


def test_no_logprobs_unless_asked(client):
    chunks = [
        m.chunk
        for m in stream(client, prompt=PROMPT, max_new_tokens=6)
        if m.WhichOneof("response") == "chunk"
    ]
    assert chunks and all(len(c.logprobs) == 0 for c in chunks)


def by_index(messages) -> tuple[dict[int, list[int]], dict[int, str], list[int]]:
    ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    completes = []
    for m in messages:
        if m.WhichOneof("response") == "chunk":
            ids.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
            text[m.chunk.index] = text.get(m.chunk.index, "") + m.chunk.text
        else:
            assert m.WhichOneof("response") == "complete"
            completes.append(m.complete.index)
            assert m.complete.text == text.get(m.complete.index, "")
    return ids, text, completes


def test_n_sampled_completions_use_seed_plus_index(client):
    kw = dict(prompt=PROMPT, max_new_tokens=12, temperature=1.0)
    ids, _, completes = by_index(stream(client, n=3, seed=100, **kw))
    assert sorted(completes) == [0, 1, 2]
    for i in range(3):
        alone, _, _ = by_index(stream(client, seed=100 + i, **kw))
        assert ids[i] == alone[0]
    assert len({tuple(v) for v in ids.values()}) > 1, "three seeds gave one completion"


def test_greedy_n_gives_identical_completions(client):
    ids, _, completes = by_index(stream(client, prompt=PROMPT, max_new_tokens=10, n=2))
    assert sorted(completes) == [0, 1] and ids[0] == ids[1]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n=17), "n"),
        (dict(n=0), "n"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
    ],
)
def test_out_of_range_values_are_invalid_argument(client, kw, field):
    with pytest.raises(grpc.RpcError) as err:
        stream(client, prompt=PROMPT, max_new_tokens=2, **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
