"""`--draft-on-device`: the n-gram lookup runs where the step runs (runner.device_drafts), from a
token cache beside the KV cache. The drafts must be exactly the host drafter's — so the same
steps, the same acceptance — and the output that of plain greedy decoding. On the CPU the
lookup is `NGramIndex` over the token cache (the plumbing: cache, offsets, the real drafts
replacing the placeholders); on a GPU (marked `gpu`) the Triton kernel inside the graphs."""

from __future__ import annotations

import argparse
import importlib.util
import itertools

import pytest
import torch
from engine_driver import completion, counter, run_to_completion
from lossless_prompts import lossless_prompts

from specwire.common.errors import UserError
from specwire.target_service.cli import add_engine_flags, config_from_args
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


def test_pipelined_drafting_steps_need_drafts_the_host_need_not_read():
    """Pipelined steps draft on the device or from a remote drafter's kept proposals; the host
    n-gram drafter (which drafts from the tokens the step in flight computes) is refused in
    one line, and so is --no-overlap."""
    with pytest.raises(UserError, match="--pipeline-drafts .* needs --draft-on-device or a remote"):
        TargetConfig(model="tiny-random", drafter="ngram", pipeline_drafts=True, progress=False)
    with pytest.raises(UserError, match="overlap on"):
        TargetConfig(
            model="tiny-random", drafter="grpc://127.0.0.1:1", pipeline_drafts=True,
            overlap=False, progress=False,
        )  # fmt: skip
    cfg = TargetConfig(
        model="tiny-random", drafter="grpc://127.0.0.1:1", pipeline_drafts=True, progress=False
    )
    assert cfg.pipeline_drafts


def test_draft_on_device_needs_the_ngram_drafter():
    with pytest.raises(UserError, match="--draft-on-device .* needs --drafter ngram, got"):
        TargetConfig(model="tiny-random", drafter="none", draft_on_device=True, progress=False)


def test_the_device_lookup_and_pipelined_steps_are_the_default_on_cuda_only(monkeypatch):
    """`draft_on_device` and `pipeline_drafts` left unset (auto) resolve on for the n-gram
    drafter on CUDA, off on the CPU and wherever the rest of the config rules them out; an
    explicit choice stands. There is no GPU here: CUDA's presence and Triton's are faked, so
    this checks the resolution (the GPU tests run the default config on a real one)."""

    def resolved(**kw):
        cfg = TargetConfig(model="tiny-random", progress=False, **kw)
        return cfg.draft_on_device, cfg.pipeline_drafts

    assert resolved() == (False, False)  # the CPU
    assert resolved(draft_on_device=True) == (True, False)  # asked for: pipelining stays off
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    triton = {"present": True}

    def find_spec(name, *args):
        if name == "triton":
            return object() if triton["present"] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cuda = {"device": "cuda", "dtype": "bfloat16"}
    assert resolved(**cuda) == (True, True)
    assert resolved(**cuda, overlap=False) == (True, False)
    assert resolved(**cuda, two_batch_rows=8) == (True, False)
    assert resolved(**cuda, cuda_graphs=False) == (True, False)
    assert resolved(**cuda, attention="sdpa") == (True, False)  # no graphs on that backend
    assert resolved(**cuda, pipeline_drafts=False) == (True, False)
    assert resolved(**cuda, draft_on_device=False) == (False, False)
    assert resolved(**cuda, drafter="none") == (False, False)
    assert resolved(**cuda, max_draft_len=0) == (False, False)
    # A remote drafter's pipelined steps stay opt-in (experimental).
    assert resolved(**cuda, drafter="grpc://127.0.0.1:1") == (False, False)
    assert resolved(**cuda, drafter="grpc://127.0.0.1:1", pipeline_drafts=True) == (False, True)
    triton["present"] = False
    assert resolved(**cuda) == (False, False)
    # The flags: neither (auto), --x, --no-x; the environment the same way.
    triton["present"] = True
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)

    def from_flags(*argv):
        cfg = config_from_args(parser.parse_args(["--device", "cuda", *argv]))
        return cfg.draft_on_device, cfg.pipeline_drafts

    assert from_flags() == (True, True)
    assert from_flags("--no-pipeline-drafts") == (True, False)
    assert from_flags("--no-draft-on-device") == (False, False)
    for env, value, want in (
        ("SPECWIRE_DRAFT_ON_DEVICE", "0", (False, False)),
        ("SPECWIRE_DRAFT_ON_DEVICE", "auto", (True, True)),
        ("SPECWIRE_DRAFT_ON_DEVICE", "", (True, True)),
        ("SPECWIRE_PIPELINE_DRAFTS", "0", (True, False)),
    ):
        monkeypatch.setenv(env, value)
        parser = argparse.ArgumentParser()
        add_engine_flags(parser)
        assert from_flags() == want, (env, value)
        monkeypatch.delenv(env)
    monkeypatch.setenv("SPECWIRE_DRAFT_ON_DEVICE", "0")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert from_flags("--draft-on-device") == (True, True)  # the flag wins over the variable
    monkeypatch.setenv("SPECWIRE_PIPELINE_DRAFTS", "maybe")
    with pytest.raises(UserError, match="SPECWIRE_PIPELINE_DRAFTS"):
        add_engine_flags(argparse.ArgumentParser())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_drafts_on_the_device_are_the_host_drafters_and_lossless(graphs):
    """The Triton lookup inside the step's CUDA graphs (and eager): fp32, the same output as
    plain greedy decoding and the host drafter's steps and acceptance."""
    kw = {"device": "cuda", "dtype": "float32", "cuda_graphs": graphs, "draft_policy": "static"}
    plain, _ = _run(_engine("none", **kw))
    host, host_stats = _run(_engine("ngram", draft_on_device=False, **kw))
    eng = _engine("ngram", pipeline_drafts=False, **kw)  # the device lookup: CUDA's default
    assert eng.config.draft_on_device
    device, device_stats = _run(eng)
    assert host == plain and device == plain
    assert host_stats[2] > 0
    assert device_stats == host_stats


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"num_kv_blocks": 40, "max_num_tokens": 256},
        {"max_batch_size": 3},
    ],
)
def test_pipelined_drafting_steps_are_lossless(kw):
    """`--pipeline-drafts`: a drafting step is launched before the step before it is read,
    staged for "nothing accepted" and shifted by what was. 50 prompts at once (with 40 KV
    blocks: preemption around the requests whose drafts are unread; 3 rows a step): plain
    greedy output, drafts accepted, every block back."""
    plain, _ = _run(_engine("none", **kw))
    eng = _engine("ngram", draft_on_device=True, pipeline_drafts=True, **kw)
    out, stats = _run(eng)
    assert out == plain
    assert stats[2] > 0  # drafts were accepted
    assert counter(eng, "pipelined_steps") > 0
    assert counter(eng, "overlapped_steps") >= counter(eng, "pipelined_steps")
    assert len(eng.resources.get("device_ngram_seen")) == 0
    if kw.get("num_kv_blocks"):
        assert counter(eng, "preemptions") > 0


# The CPU, and on a GPU CUDA's default path: the device lookup in pipelined graph steps.
_CPU_AND_GRAPHS = [
    pytest.param({}, id="cpu"),
    pytest.param(
        {"device": "cuda", "dtype": "float32", "draft_policy": "static"},
        id="cuda-graphs",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("kw", _CPU_AND_GRAPHS)
def test_pipelined_steps_where_some_or_no_request_speculates_are_lossless(kw):
    """Requests that turned speculation off, beside ones that did not, and all of them: their
    pipelined steps stage no verification (no row has drafts there) and each row accepts none;
    the output is plain greedy decoding's, and a request that does not speculate gets no
    drafts. On a GPU the steps are the graphs' (CUDA's default: the device lookup, pipelined)."""
    plain, _ = _run(_engine("none", **kw))
    eng = _engine("ngram", draft_on_device=True, pipeline_drafts=True, **kw)
    mixed = [i % 2 == 0 for i in range(len(PROMPTS))]
    done = run_to_completion(eng, PROMPTS, speculate=mixed)
    assert [c.token_ids for c in done] == plain
    assert all(c.stats.draft_tokens == 0 for c, spec in zip(done, mixed, strict=True) if not spec)
    assert sum(c.stats.accepted_tokens for c in done) > 0
    assert counter(eng, "pipelined_steps") > 0
    before = counter(eng, "pipelined_steps")
    done = run_to_completion(eng, PROMPTS, speculate=False)
    assert [c.token_ids for c in done] == plain
    assert counter(eng, "pipelined_steps") == before  # no step drafted
    assert all(c.stats.draft_tokens == 0 for c in done)


@pytest.mark.parametrize("kw", _CPU_AND_GRAPHS)
def test_a_pipelined_step_after_one_without_drafts_moves_no_row(kw):
    """A pipelined step is moved on the device by what the step before accepted, but only a
    step with drafts can accept any: after one without (requests that turned speculation off,
    here every other one), the executor gives no row a source to move by, so the runner stages
    no shift (on a GPU the graph's shift sources are all none). Output as plain decoding, and
    steps after drafting ones still move."""
    plain, _ = _run(_engine("none", **kw))
    eng = _engine("ngram", draft_on_device=True, pipeline_drafts=True, **kw)
    seen: list[tuple[bool, bool]] = []  # per launch: (some row has drafts, some row may move)
    forward = eng.runner.forward

    def watching(rows, tables, allow_graphs=True):
        seen.append((any(r.drafts for r in rows), any(r.after >= 0 for r in rows)))
        return forward(rows, tables, allow_graphs)

    eng.runner.forward = watching
    mixed = [i % 2 == 0 for i in range(len(PROMPTS))]
    done = run_to_completion(eng, PROMPTS, speculate=mixed)
    assert [c.token_ids for c in done] == plain
    assert any(moves for _, moves in seen)  # after drafting steps rows may move ...
    after_plain = [moves for (drafts, _), (_, moves) in itertools.pairwise(seen) if not drafts]
    assert after_plain and not any(after_plain)  # ... after plain ones none does


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "kw", [{"cuda_graphs": True}, {"cuda_graphs": False}, {"num_kv_blocks": 40}]
)
def test_gpu_pipelined_drafting_steps_are_lossless(kw):
    """Pipelined drafting steps in the CUDA graphs (the rows shifted and the drafts counted
    inside the graph), eagerly (shifted on the host) and with preemption: fp32, the output of
    plain greedy decoding."""
    kw = {"device": "cuda", "dtype": "float32", "draft_policy": "static", **kw}
    if "num_kv_blocks" in kw:
        kw["max_num_tokens"] = 256
    plain, _ = _run(_engine("none", **kw))
    if not kw.get("cuda_graphs", True):  # pipelining without graphs is opt-in
        kw.update(draft_on_device=True, pipeline_drafts=True)
    eng = _engine("ngram", **kw)  # CUDA's default: the device lookup in pipelined steps
    assert eng.config.draft_on_device and eng.config.pipeline_drafts
    out, stats = _run(eng)
    assert out == plain
    assert stats[2] > 0 and counter(eng, "pipelined_steps") > 0


def test_pipelined_drafting_needs_drafts_on_the_device_and_overlap():
    with pytest.raises(UserError, match="--pipeline-drafts .* needs --draft-on-device"):
        TargetConfig(model="tiny-random", drafter="ngram", pipeline_drafts=True, progress=False)
    with pytest.raises(UserError, match="cannot be combined"):
        TargetConfig(
            model="tiny-random", drafter="ngram", draft_on_device=True, pipeline_drafts=True,
            two_batch_rows=2, progress=False,
        )  # fmt: skip


def test_pipelined_drafting_up_to_the_end_of_the_context():
    """Requests that fill the context: a row whose step in flight may end it there is not
    run after it (its positions could pass the end), and the output is plain decoding's."""
    ctx = 160
    outs = []
    for kw in ({}, {"draft_on_device": True, "pipeline_drafts": True}):
        eng = _engine("none" if not kw else "ngram", max_context_len=ctx, **kw)
        tok = eng.loaded.tokenizer
        prompts = [ids for ids in map(tok.encode, PROMPTS) if len(ids) < 100][:16]
        streams = [
            eng.executor.submit(eng.new_request(ids, max_new_tokens=ctx - len(ids)))
            for ids in prompts
        ]
        eng.executor.run_until_idle()
        done = [(c.token_ids, c.finish_reason) for c in map(completion, streams)]
        eng.resources.check_integrity()
        assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1
        outs.append(done)
    assert outs[0] == outs[1]
    assert {reason for _, reason in outs[1]} == {"context"}


_CUDA_EAGER = pytest.param(
    {"device": "cuda", "dtype": "float32", "cuda_graphs": False,
     "draft_on_device": True, "pipeline_drafts": True},
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
    id="cuda-eager",
)  # fmt: skip


_CPU_PIPELINED = pytest.param({"draft_on_device": True, "pipeline_drafts": True}, id="cpu")


@pytest.mark.parametrize("kw", [_CPU_PIPELINED, _CUDA_EAGER])
def test_pipelined_steps_with_a_prompt_prefilled_in_chunks_alone(kw):
    """A prompt longer than a step's token budget, alone at first: its first steps hold only
    prefill chunks that do not end it (no logit row, so no row verifies anything). An eager
    pipelined step counts its accepted drafts on the host's side of the runner
    (`_accept_eager`): it must count none (it failed every request in the step), and the
    output is plain decoding's. A graph's step counts into fixed buffers and was never
    affected; on CUDA this runs eagerly."""
    prompts = [" ".join(PROMPTS[:8]), PROMPTS[9]]
    kw = {"max_num_tokens": 64, "draft_policy": "static", **kw}
    base = {k: v for k, v in kw.items() if k not in ("draft_on_device", "pipeline_drafts")}
    plain, _ = _run_prompts(_engine("none", **base), prompts)
    eng = _engine("ngram", **kw)
    assert eng.config.pipeline_drafts
    assert len(eng.loaded.tokenizer.encode(prompts[0])) > 3 * kw["max_num_tokens"]
    out, stats = _run_prompts(eng, prompts)
    assert out == plain
    assert stats.accepted_tokens > 0 and counter(eng, "pipelined_steps") > 0
    assert counter(eng, "eager_steps") > 0


def test_pipelined_steps_with_a_sampled_arrival_and_a_cancel_mid_flight():
    """A sampled request arriving while pipelined drafting steps run makes the next steps
    synchronous (the step in flight is read first) and a request cancelled while its drafts
    are unread is released: the other greedy requests' output is plain decoding's, the
    sampled one completes, every block comes back."""
    from specwire.target_service.request import SamplingConfig

    prompts = PROMPTS[:12]
    plain, _ = _run_prompts(_engine("none"), prompts)
    eng = _engine("ngram", draft_on_device=True, pipeline_drafts=True)
    ex, tok = eng.executor, eng.loaded.tokenizer
    streams = [ex.submit(eng.new_request(tok.encode(p), max_new_tokens=24)) for p in prompts]
    ex.run_until_idle(max_steps=12)  # stops with a pipelined step in flight
    victim = next(s.request for s in streams if s.request.unread_drafts)
    sampled = ex.submit(
        eng.new_request(
            tok.encode("a sampled neighbour"),
            max_new_tokens=8,
            sampling=SamplingConfig(temperature=0.8, seed=3),
        )
    )
    ex.cancel(victim.request_id)
    ex.run_until_idle()
    for i, s in enumerate([*streams, sampled]):
        done = completion(s)
        if i == len(streams):
            assert len(done.token_ids) > 0
        elif s.request is victim:
            assert done.finish_reason == "cancelled"
        else:
            assert done.token_ids == plain[i]
    assert counter(eng, "pipelined_steps") > 0
    eng.resources.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1


def _run_prompts(eng, prompts):
    out = [c.token_ids for c in run_to_completion(eng, prompts)]
    return out, eng.executor.stats
