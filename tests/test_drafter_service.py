"""The drafter service: sessions, deltas, resync, TTL, ngram/model/plugin drafters, gRPC, CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch
from procs import running_service, stop_service

from specwire.common import healthcheck
from specwire.common.drafters.model import ModelDrafter
from specwire.common.drafters.plugin import load_plugin
from specwire.common.errors import UserError
from specwire.common.model.config import ModelConfig
from specwire.common.model.llama import LlamaModel
from specwire.common.protogen import drafter_pb2, drafter_pb2_grpc
from specwire.drafter_service.config import DrafterServiceConfig
from specwire.drafter_service.drafters import NGramDrafter, SessionDrafter, build_drafter
from specwire.drafter_service.server import serve
from specwire.drafter_service.sessions import SessionStore

REPETITIVE = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


@pytest.fixture
def start():
    servers = []

    def _start(instance: SessionDrafter | None = None, **overrides):
        cfg = DrafterServiceConfig(**{"host": "127.0.0.1", "port": 0, **overrides})
        server = serve(cfg, instance)
        channel = grpc.insecure_channel(server.address)
        servers.append((server, channel))
        return server, drafter_pb2_grpc.DrafterServiceStub(channel)

    yield _start
    for server, channel in servers:
        channel.close()
        server.stop(None)


def seq(rid, base, tokens, k=4, finished=False):
    return drafter_pb2.SequenceUpdate(
        request_id=rid, base_len=base, new_tokens=tokens, max_draft_tokens=k, finished=finished
    )


def branched(update, max_branches, positions):
    update.max_branches, update.branch_positions = max_branches, positions
    return update


def req(step, *sequences, want_probs=False):
    return drafter_pb2.DraftRequest(step=step, sequences=sequences, want_probs=want_probs)


def streamed(m):
    """The same message as a DraftStreamRequest (the two encode identically)."""
    return drafter_pb2.DraftStreamRequest.FromString(m.SerializeToString())


def by_id(response):
    return {d.request_id: d for d in response.drafts}


# -- sessions ---------------------------------------------------------------------------------


def test_session_store_deltas_resync_finish_and_ttl():
    now = [0.0]
    store = SessionStore(NGramDrafter(), ttl_s=10.0, clock=lambda: now[0])
    assert store.apply("a", 0, [1, 2, 3]).tokens == [1, 2, 3]
    assert store.apply("a", 3, [4]).tokens == [1, 2, 3, 4]
    assert store.apply("a", 3, [9]) is None  # wrong base_len: resync, session untouched
    assert store.apply("b", 2, [9]) is None  # unknown session: resync
    assert store.apply("a", 0, [7, 8]).tokens == [7, 8]  # base_len 0 restarts the session
    store.check_integrity()
    assert store.finish("a") and "a" not in store and not store.finish("a")
    store.apply("c", 0, [1])
    now[0] = 5.0
    store.apply("d", 0, [1])
    now[0] = 12.0
    assert store.expire() == ["c"]  # idle 12 s > 10 s; "d" idle 7 s stays
    assert "d" in store and len(store) == 1
    store.check_integrity()


def test_expiry_on_every_message_scans_at_most_once_per_eighth_of_the_ttl():
    """`expire_due` runs with every message: a session past its TTL goes at the first scan
    due, and scans are at least TTL/8 apart (a session outlives its TTL by at most that)."""
    now = [0.0]
    store = SessionStore(NGramDrafter(), ttl_s=8.0, clock=lambda: now[0])
    store.apply("a", 0, [1])
    now[0] = 1.0
    store.apply("b", 0, [1])
    now[0] = 8.5
    store.expire_due()  # the first scan: "a" (idle 8.5 s) goes, "b" (7.5 s) stays
    assert "a" not in store and "b" in store
    now[0] = 9.2
    store.expire_due()  # "b" is past its TTL, but the next scan is due at 9.5
    assert "b" in store
    now[0] = 9.5
    store.expire_due()
    assert "b" not in store


# -- ngram over gRPC ----------------------------------------------------------------------------


def test_ngram_drafts_deltas_resync_and_finished(start):
    server, stub = start(max_draft_len=4)
    info = stub.GetInfo(drafter_pb2.GetInfoRequest(protocol_version=1))
    assert (info.name, info.vocab_size, info.tokenizer_fingerprint) == ("ngram", 0, "")
    assert info.max_draft_len == 4 and "stream" in info.capabilities

    r = stub.Draft(req(1, seq("a", 0, REPETITIVE, k=8), seq("z", 0, [5, 6], k=2)))
    assert r.step == 1
    d = by_id(r)
    assert list(d["a"].tokens) == [3, 4, 1, 2]  # capped at the service's max_draft_len
    assert d["a"].base_len == len(REPETITIVE) and not d["a"].resync
    assert list(d["z"].tokens) == []  # nothing repeats: no draft, never padding

    d = by_id(stub.Draft(req(2, seq("a", 10, [3], k=2), seq("z", 2, [], k=0))))
    assert list(d["a"].tokens) == [4, 1] and d["a"].base_len == 11
    assert list(d["z"].tokens) == [] and d["z"].base_len == 2

    d = by_id(stub.Draft(req(3, seq("a", 99, [1]))))
    assert d["a"].resync and list(d["a"].tokens) == []
    assert server.engine.store.get("a").tokens == REPETITIVE + [3]  # untouched by the resync

    r = stub.Draft(req(4, seq("a", 0, [], finished=True), seq("z", 2, [5])))
    assert set(by_id(r)) == {"z"}  # no entry for a finished sequence
    assert "a" not in server.engine.store
    assert by_id(stub.Draft(req(5, seq("a", 11, [4]))))["a"].resync
    server.engine.check_integrity()


def test_unary_and_stream_give_the_same_drafts(start):
    _, stub = start(max_draft_len=3)
    steps = [
        req(1, seq("a", 0, REPETITIVE), seq("b", 0, [7, 8, 9, 7, 8])),
        req(2, seq("a", 10, [3, 4]), seq("b", 5, [9])),
        req(3, seq("a", 12, [5, 1, 2]), seq("b", 6, [1], finished=True)),
        req(4, seq("a", 15, [3])),
    ]
    unary = [stub.Draft(m) for m in steps]
    for m in steps:  # same sessions again, from scratch
        for s in m.sequences:
            s.request_id += "-stream"
    streamed_replies = list(stub.DraftStream(map(streamed, steps)))
    assert [r.step for r in streamed_replies] == [1, 2, 3, 4]  # one reply per request, in order
    for u, s in zip(unary, streamed_replies, strict=True):
        assert {k: list(v.tokens) for k, v in by_id(u).items()} == {
            k.removesuffix("-stream"): list(v.tokens) for k, v in by_id(s).items()
        }
    assert list(by_id(unary[0])["b"].tokens) == [9, 7, 8]


@pytest.mark.parametrize(
    ("overrides", "inline"),
    [({}, True), ({"delay_ms": 1}, False), ({"drafter": "model:tiny-random"}, False)],
)
def test_cheap_drafters_draft_on_the_event_loop_and_the_same(start, overrides, inline):
    """n-gram drafts on the service's event loop (no hop to a worker thread); an injected
    delay or a model drafter goes to the workers. Same answers either way."""
    server, stub = start(max_draft_len=3, **overrides)
    assert server.engine.inline is inline
    m = req(1, seq("a", 0, REPETITIVE))
    assert len(by_id(stub.Draft(m))["a"].tokens) == 3
    assert len(by_id(next(iter(stub.DraftStream(iter([streamed(m)])))))["a"].tokens) == 3


def test_idle_sessions_expire(start):
    server, stub = start(session_ttl_s=0.2)
    stub.Draft(req(1, seq("a", 0, REPETITIVE)))
    time.sleep(0.4)
    assert by_id(stub.Draft(req(2, seq("a", 10, [3]))))["a"].resync
    assert "a" not in server.engine.store


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (seq("", 0, [1]), "request_id is empty"),
        (seq("a", 0, [1], k=-1), "max_draft_tokens must be >= 0"),
        (seq("a", -3, [1]), "base_len must be >= 0"),
        (branched(seq("a", 0, [1]), 17, 2), "max_branches must be between 0 and 16"),
        (branched(seq("a", 0, [1]), -1, 2), "max_branches must be between 0 and 16"),
        (branched(seq("a", 0, [1], k=4), 4, 6), "branch_positions must be between 0 and"),
    ],
)
def test_bad_requests_are_invalid_argument(start, bad, message):
    _, stub = start()
    for call in (stub.Draft, lambda m: next(stub.DraftStream(iter([streamed(m)])))):
        with pytest.raises(grpc.RpcError) as info:
            call(req(1, seq("ok", 0, [1, 2]), bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Draft(req(1, seq("a", 0, [1]), seq("a", 0, [2])))
    assert "appears twice" in info.value.details()


# -- plugin drafters ----------------------------------------------------------------------------

PLUGIN_SOURCE = textwrap.dedent(
    """
    class Repeat:
        '''Duck-typed plugin: drafts the last token again; refuses negative ids.'''
        name = "repeat"
        vocab_size = 50

        def new_state(self):
            return []

        def extend(self, state, tokens):
            if any(t < 0 for t in tokens):
                raise ValueError("negative token id")
            state.extend(tokens)

        def propose(self, state, budget, want_probs=False):
            return [state[-1]] * budget, None

    class NotADrafter:
        pass
    """
)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "sw_test_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sw_test_plugin"


def test_plugin_drafter_serves_and_bad_sequences_do_not_break_the_batch(start, plugin_module):
    drafter = build_drafter(DrafterServiceConfig(drafter=f"{plugin_module}:Repeat"))
    _, stub = start(drafter, max_draft_len=3)
    info = stub.GetInfo(drafter_pb2.GetInfoRequest(protocol_version=1))
    assert (info.name, info.vocab_size) == ("repeat", 50)
    d = by_id(stub.Draft(req(1, seq("a", 0, [4, 5], k=2), seq("bad", 0, [1, -2]))))
    assert list(d["a"].tokens) == [5, 5]
    assert list(d["bad"].tokens) == [] and not d["bad"].resync


def test_plugin_errors_are_one_line_user_errors(plugin_module):
    for spec, text in [
        (f"{plugin_module}:NotADrafter", "lacks new_state(), extend(), propose()"),
        (f"{plugin_module}:Missing", "has no 'Missing'"),
        ("sw_no_such_module:Foo", "cannot import"),
    ]:
        with pytest.raises(UserError, match=text):
            load_plugin(spec)
    with pytest.raises(UserError, match="expected ngram, model:NAME or module:Class"):
        DrafterServiceConfig(drafter="bogus")


# -- model drafter ------------------------------------------------------------------------------


def tiny_model_drafter(**kw) -> ModelDrafter:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    model = LlamaModel(cfg, block_size=4).double()  # float64: no argmax near-ties
    return ModelDrafter(model, name="model:tiny", vocab_size=61, num_blocks=64, **kw)


def fresh_drafts(tokens: list[int], budget: int) -> list[int]:
    """What a drafter with an empty cache proposes: the reference for the cached one."""
    d = tiny_model_drafter()
    st = d.new_state()
    d.extend(st, tokens)
    return d.propose(st, budget)[0]


def test_model_drafter_caches_and_rolls_back_exactly():
    d = tiny_model_drafter()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (9, 3, 14)]
    states = [d.new_state() for _ in prompts]
    for st, p in zip(states, prompts, strict=True):
        d.extend(st, p)
    budgets = [4, 2, 0]
    for round_ in range(4):
        proposals = d.propose_batch(states, budgets)  # all sessions in one batch
        for st, b, (drafts, probs) in zip(states, budgets, proposals, strict=True):
            assert probs is None and len(drafts) == b
            assert drafts == fresh_drafts(st.tokens, b)
        # Commit: accept some drafts, then a token that differs from the next draft (rollback).
        for st, (drafts, _) in zip(states, proposals, strict=True):
            keep = drafts[: round_ % 3]
            wrong = (drafts[len(keep)] + 1) % 61 if len(drafts) > len(keep) else 5
            d.extend(st, keep + [wrong])
        budgets = [3, 4, 1]
        d.check_integrity(states)
    for st in states:
        d.release(st)
    assert d.allocator.num_free == d.allocator.num_blocks


def test_model_drafter_refuses_out_of_vocab_ids_and_can_send_probs():
    d = tiny_model_drafter(probs_top_n=5)
    st = d.new_state()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.extend(st, [3, 61])
    d.extend(st, [3, 4, 5])
    tokens, probs = d.propose(st, 3, want_probs=True)
    assert len(tokens) == len(probs) == 3
    for t, (ids, ps) in zip(tokens, probs, strict=True):
        assert t in ids and len(ids) == 5 and abs(sum(ps) - 1) < 1e-6
    assert d.propose(st, 2)[1] is None  # only on request


def test_model_tiny_random_from_the_loader(start):
    pytest.importorskip("specwire.common.model.loader")
    server, stub = start(drafter="model:tiny-random", max_draft_len=3)
    info = stub.GetInfo(drafter_pb2.GetInfoRequest(protocol_version=1))
    assert info.name.startswith("model:") and info.vocab_size > 0
    d = by_id(stub.Draft(req(1, seq("a", 0, [1, 2, 3, 4, 5], k=3))))["a"]
    assert len(d.tokens) == 3 and all(0 <= t < info.vocab_size for t in d.tokens)
    d2 = by_id(stub.Draft(req(2, seq("a", 5, [d.tokens[0], (d.tokens[1] + 1) % 7], k=3))))
    assert len(d2["a"].tokens) == 3
    stub.Draft(req(3, seq("a", 0, [], finished=True)))
    server.engine.check_integrity()


# -- CLI (real subprocess) ------------------------------------------------------------------------


SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]


def test_cli_serves_getinfo_and_health():
    env = {"SPECWIRE_DRAFTER_PORT": "0", "SPECWIRE_MAX_DRAFT_LEN": "9", "SPECWIRE_DRAFTER": None}
    cmd = SPECWIRE + ["drafter", "--host", "127.0.0.1", "--max-draft-len", "3"]
    pattern = (
        r"^specwire drafter listening on 127\.0\.0\.1:(\d+) \(drafter=ngram security=plaintext\)$"
    )
    with running_service(cmd, env, pattern, timeout=60) as (proc, match):
        target = f"127.0.0.1:{match.group(1)}"
        with grpc.insecure_channel(target) as channel:
            info = drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
                drafter_pb2.GetInfoRequest(protocol_version=1), timeout=5
            )
        assert info.max_draft_len == 3  # the flag wins over SPECWIRE_MAX_DRAFT_LEN
        assert healthcheck.check(target, "specwire.v1.DrafterService") == "SERVING"
        assert stop_service(proc) == 0  # SIGTERM: clean shutdown


def test_cli_bad_drafter_is_a_one_line_error():
    cmd = SPECWIRE + ["drafter", "--port", "0", "--drafter", "bogus"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specwire: error: --drafter"), done.stderr
