"""Input preparation in the varlen layout (what the GPU's Triton backend runs): rows of any
lengths, each decode row's real drafts from its Row, and the feed of placeholders from the
previous step's argmax. Pure host code, checked on the CPU."""

from __future__ import annotations

from specwire.common.model.paged import slots_of
from specwire.target_service.request import Request
from specwire.target_service.runner.inputs import InputPreparer
from specwire.target_service.scheduler import Row


def _req(rid: str, prompt: list[int], output: list[int], computed: int) -> Request:
    r = Request(request_id=rid, prompt_ids=prompt, max_new_tokens=8, max_draft_len=4)
    r.output_ids = list(output)
    r.num_computed = computed
    return r


def test_varlen_step_from_rows():
    prep = InputPreparer(block_size=4, max_blocks_per_seq=8, dummy_block=0, device="cpu")
    chunk = _req("chunk", list(range(10, 20)), [], 0)  # prefill chunk of 6 of its 10 tokens
    verify = _req("verify", [1, 2, 3, 4, 5], [6], 5)  # decode row: 1 token + 3 drafts
    fed = _req("fed", [7, 8, 9], [-1], 3)  # its last token is the step in flight's logit row 2
    rows = [
        Row(chunk, 6, decode=False),
        Row(verify, 1, decode=True, drafts=[40, 41, 42]),
        Row(fed, 1, decode=True, feed_src=2),
    ]
    tables = [[1, 2, 3], [4, 5, 7], [6]]
    step = prep.prepare_varlen(rows, tables)
    assert step.ids == [10, 11, 12, 13, 14, 15, 6, 40, 41, 42, -1]
    assert step.positions == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 3]
    assert step.cu_seqlens == [0, 6, 10, 11]
    assert step.seq_lens == [6, 9, 4]
    assert step.slots == slots_of([1, 2, 3], 0, 6, 4) + slots_of([4, 5, 7], 5, 4, 4) + [6 * 4 + 3]
    assert step.tables == [[1, 2], [4, 5, 7], [6]]  # blocks covering each row's context
    # Logits at the verify row's 4 positions and the fed row's one, in decode-row order.
    assert step.logit_rows == [6, 7, 8, 9, 10]
    assert step.spans == [(0, 4), (4, 1)]
    # The placeholder at flat index 10 is gathered from the previous step's logit row 2.
    assert step.feed == [(10, 2)]


def test_slots_of_is_slot_of_for_every_token() -> None:
    """The block-run form of `slots_of` equals `slot_of` token by token: inside the table,
    past its end (dummy block or -1), across block edges, for one token and for many."""
    import random

    from specwire.common.model.paged import slot_of

    rng = random.Random(0)
    for _ in range(500):
        bs = rng.choice([1, 2, 4, 16])
        table = rng.sample(range(100), rng.randint(0, 6))
        start, count = rng.randint(0, 8 * bs), rng.randint(1, 9 * bs)
        dummy = rng.choice([-1, 0, 99])
        want = [slot_of(table, t, bs, dummy) for t in range(start, start + count)]
        assert slots_of(table, start, count, bs, dummy) == want, (table, start, count, bs)


def _reference_step(prep: InputPreparer, rows, tables) -> tuple:
    """The varlen step by the definition, row by row through `row_tokens` (what the short
    path for plain decode rows must reproduce)."""
    from specwire.common.model.paged import blocks_for

    ids, pos, slots, cu, seq_lens, tabs, logit_rows, spans, feed = (
        [],
        [],
        [],
        [0],
        [],
        [],
        [],
        [],
        [],
    )
    for row, table in zip(rows, tables, strict=True):
        toks, start = prep.row_tokens(row)
        n = len(toks)
        if row.feed_src >= 0:
            feed.append((len(ids) + row.num_committed - 1, row.feed_src))
        ids += toks
        pos += range(start, start + n)
        slots += slots_of(table, start, n, prep.block_size)
        cu.append(cu[-1] + n)
        seq_lens.append(start + n)
        tabs.append(table[: blocks_for(start + n, prep.block_size)])
        if row.decode:
            m = 1 + len(row.drafts)
            spans.append((len(logit_rows), m))
            logit_rows += range(len(ids) - m, len(ids))
    return ids, pos, slots, cu, seq_lens, tabs, logit_rows, spans, feed


def test_steady_decode_rows_take_the_short_path_to_the_same_step() -> None:
    """Steady decode rows (one committed token, then any drafts) have a short path in
    `prepare_varlen`; mixed with prompt chunks, with and without a fed placeholder, with the
    tokens' blocks inside, across or past the table, the step equals the definition."""
    import random

    rng = random.Random(1)
    prep = InputPreparer(block_size=4, max_blocks_per_seq=16, dummy_block=0, device="cpu")
    for _ in range(200):
        rows, tables = [], []
        for j in range(rng.randint(1, 8)):
            plen, olen = rng.randint(1, 12), rng.randint(1, 12)
            req = _req(f"r{j}", rng.sample(range(50), plen), rng.sample(range(50), olen), 0)
            if rng.random() < 0.2:  # a prompt chunk
                req.output_ids, req.num_computed = [], rng.randint(0, plen - 1)
                rows.append(Row(req, plen - req.num_computed, decode=False))
            elif rng.random() < 0.2:  # the prompt's last token fed alone, nothing generated
                req.output_ids, req.num_computed = [], plen - 1
                rows.append(Row(req, 1, decode=True))
            else:
                req.num_computed = plen + olen - 1  # its last token is the one fed
                drafts = rng.choice([[], [], [7], [7, 8], [7, 8, 9, 10, 11, 12]])
                rows.append(Row(req, 1, decode=True, drafts=drafts, feed_src=rng.choice([-1, 3])))
            tables.append(rng.sample(range(1, 40), rng.randint(1, 7)))
        step = prep.prepare_varlen(rows, tables)
        got = (step.ids, step.positions, step.slots, step.cu_seqlens, step.seq_lens, step.tables)
        got += (step.logit_rows, step.spans, step.feed)
        assert got == _reference_step(prep, rows, tables)


def _shifted_on_device(step, rows, acc: list[int]):
    """What a pipelined graph step does to its staged inputs (`pipeline.shift_rows`), on the
    CPU: (positions, slots, context lengths, feed sources, lookup lengths)."""
    import torch

    from specwire.target_service.runner.model_runner import ModelRunner
    from specwire.target_service.runner.pipeline import shift_rows

    b, none = step.num_rows, 8  # 8 rows at most; entry 8 is the sentinel
    src = torch.tensor([a if a >= 0 else none for a in step.after] + [none] * (none + 1 - b))
    acc_t = torch.tensor(acc + [0] * (none + 1 - len(acc)))
    tok_row = torch.repeat_interleave(torch.arange(b), torch.tensor(step.cu_seqlens).diff())
    feed_row = tok_row[[dst for dst, _ in step.feed]]
    width = max(len(t) for t in step.tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in step.tables], dtype=torch.int32)
    pos, slots = torch.tensor(step.positions), torch.tensor(step.slots)
    seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32)
    feed_src = torch.tensor([src for _, src in step.feed])
    lookup = torch.tensor(ModelRunner._drafting(rows, step.cu_seqlens)[0])
    shift_rows(acc_t, src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, lookup, 4)
    return pos.tolist(), slots.tolist(), seq_lens.tolist(), feed_src.tolist(), lookup.tolist()


def test_a_pipelined_step_shifted_on_the_device_is_the_step_staged_with_its_shifts():
    """A pipelined step is staged for "the step before accepted nothing"; moved on the
    device by the accepted counts (`shift_rows`) it must be exactly the step the host would
    stage knowing them (`prepare_varlen(..., shifts)`, the eager path), and its rows' tables
    must cover the furthest shift (`Row.slack`)."""
    from specwire.target_service.runner.model_runner import ModelRunner

    prep = InputPreparer(block_size=4, max_blocks_per_seq=8, dummy_block=0, device="cpu")
    chunk = _req("chunk", list(range(10, 20)), [], 0)  # a prefill chunk: never shifted
    # Decode rows whose last token is the step in flight's (-1), 3 and 2 drafts unread there.
    a = _req("a", [1, 2, 3, 4, 5], [6, -1], 6)
    b = _req("b", [7, 8, 9], [-1], 3)
    c = _req("c", [1, 1, 1, 1], [2], 4)  # not in the step in flight
    rows = [
        Row(chunk, 6, decode=False),
        Row(a, 1, decode=True, feed_src=3, after=1, slack=3, drafts=[0, 0]),
        Row(b, 1, decode=True, feed_src=7, after=2, slack=2, drafts=[0, 0, 0]),
        Row(c, 1, decode=True, drafts=[5]),
    ]
    tables = [[1, 2, 3], [4, 5, 7], [6, 9, 12], [10, 11]]
    for acc in ([0, 0, 0], [0, 3, 1], [0, 2, 2], [0, 1, 0]):
        staged = prep.prepare_varlen(rows, tables)
        staged.after = [r.after for r in rows]
        shifts = [acc[r.after] if r.after >= 0 else 0 for r in rows]
        want = prep.prepare_varlen(rows, tables, shifts)
        got = _shifted_on_device(staged, rows, acc)
        lookup = ModelRunner._drafting(rows, want.cu_seqlens, shifts)[0]
        assert got == (
            want.positions,
            want.slots,
            want.seq_lens,
            [s for _, s in want.feed],
            lookup,
        ), acc
        assert want.ids == staged.ids  # the ids do not move: gathered and drafted there
    assert staged.tables[1] == [4, 5, 7] and staged.tables[2] == [6, 9, 12]  # up to the slack


def test_shifting_a_step_whose_sources_are_all_none_moves_nothing_whatever_its_rows():
    """`pipeline.shift_rows` with every shift source none (a pipelined step after one without
    drafts: `TokenGraphs._stage_pipeline` then leaves the token and feed rows stale) changes no
    position, slot, context length, feed source or lookup length, even where the stale rows
    point at rows whose counts are not 0. (The Triton launch's twin:
    tests/test_triton_pipeline.py.)"""
    import torch

    from specwire.target_service.runner import pipeline

    g = torch.Generator().manual_seed(3)
    rows, tokens, bs = 64, 200, 16
    acc = torch.randint(1, 5, (rows + 1,), generator=g)
    acc[rows] = 0  # the none row's count (always 0)
    src = torch.full((rows + 1,), rows)
    tok_row = torch.randint(0, rows + 1, (tokens,), generator=g)  # stale: any row, or none
    feed_row = torch.randint(0, rows + 1, (rows,), generator=g)
    tables = torch.randperm(rows * 40, generator=g).view(rows, 40).int() + 1
    pos = torch.randint(0, 35 * bs, (tokens,), generator=g)
    slots = torch.randint(0, 10_000, (tokens,), generator=g)
    seq_lens = torch.randint(1, 500, (rows,), generator=g).int()
    feed_src = torch.randint(0, 100, (rows,), generator=g)
    lookup = torch.randint(1, 500, (rows,), generator=g)
    moved = [pos, slots, seq_lens, feed_src, lookup]
    before = [t.clone() for t in moved]
    pipeline.shift_rows(
        acc, src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, lookup, bs
    )
    for want, have in zip(before, moved, strict=True):
        assert torch.equal(want, have)
    src[5] = 3  # one real source: that row's tokens move (so the check above could fail)
    pipeline.shift_rows(
        acc, src, tok_row, feed_row, pos, slots, seq_lens, feed_src, tables, lookup, bs
    )
    assert not torch.equal(before[2], seq_lens)


def test_the_graphs_staging_of_steps_that_move_no_row_keeps_every_shift_at_zero():
    """`TokenGraphs._stage_pipeline` on the host buffers of both twins (stand-ins: the method
    runs on numpy), over a random run of steps of changing sizes, shifted and not: a step that
    moves no row stages every source none and leaves the token and feed rows as an earlier
    step staged them; those stay in bounds, and `shift_rows` over the staged buffers then moves
    nothing. A shifted step stages them afresh."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import torch

    from specwire.target_service.runner import pipeline
    from specwire.target_service.runner.graphs import TokenGraphs
    from specwire.target_service.runner.inputs import VarlenStep

    rng, R, T, bs = random.Random(5), 16, 96, 16

    def twins(n, fill):
        return [np.full(n, fill, np.int64) for _ in range(2)]

    g = SimpleNamespace(
        max_rows=R,
        h_shift_src=twins(R + 1, R),
        h_tok_row=twins(T, R),
        h_feed_row=twins(R, R),
        h_v_first=twins(R, 0),
        h_v_logit=twins(R, 0),
        h_v_drafts=twins(R, 0),
    )
    for i in range(400):
        w, b = i % 2, rng.randint(1, R)
        lens = [rng.randint(1, 5) for _ in range(b)]
        t = sum(lens)
        bucket = min(T, t + rng.randint(0, 8))
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        shifted = rng.random() < 0.5
        after = [rng.choice([-1, rng.randrange(R)]) if shifted else -1 for _ in range(b)]
        shifted = any(a >= 0 for a in after)
        feed = [(cu[r], r) for r in range(b) if rng.random() < 0.7]
        step = VarlenStep(
            [0] * t, [0] * t, [0] * t, cu, [1] * b, [[]] * b, [], [], feed,
            after=after, shifted=shifted,
        )  # fmt: skip
        tok_before, feed_before = g.h_tok_row[w].copy(), g.h_feed_row[w].copy()
        TokenGraphs._stage_pipeline(g, w, step, bucket)
        src, tok_row, feed_row = g.h_shift_src[w], g.h_tok_row[w], g.h_feed_row[w]
        assert tok_row.max() <= R and feed_row.max() <= R and src.max() <= R
        if not shifted:
            assert (src == R).all()
            assert (tok_row == tok_before).all() and (feed_row == feed_before).all()
        else:
            assert (tok_row[:t] == np.repeat(np.arange(b), lens)).all()
        acc = torch.randint(1, 4, (R + 1,))
        acc[R] = 0
        pos = torch.randint(0, 30 * bs, (T,))
        seq_lens = torch.randint(1, 500, (R,)).int()
        feed_src = torch.randint(0, 100, (R,))
        tables = torch.arange(R * 40).view(R, 40).int()
        moved = [pos, torch.randint(0, 10_000, (T,)), seq_lens, feed_src]
        before = [m.clone() for m in moved]
        pipeline.shift_rows(
            acc, torch.from_numpy(src), torch.from_numpy(tok_row[:bucket]),
            torch.from_numpy(feed_row), pos[:bucket], moved[1][:bucket], seq_lens[:b],
            feed_src, tables, None, bs,
        )  # fmt: skip
        if not shifted:
            for want, have in zip(before, moved, strict=True):
                assert torch.equal(want, have)


def test_a_pipelined_step_without_drafts_stages_no_verification_and_accepts_none():
    """Pipelined steps (`ModelRunner._varlen`): where no row has drafts (their requests turned
    speculation off) the step carries no verification inputs, and an eager step's accepted
    counts are then all 0; a step where one row has drafts carries them. (The GPU's graphs
    stage the same None as zero draft counts: tests/test_device_drafts.py, on a GPU.)"""
    from types import SimpleNamespace

    import torch

    from specwire.target_service.runner.model_runner import ModelRunner

    prep = InputPreparer(block_size=4, max_blocks_per_seq=8, dummy_block=0, device="cpu")
    runner = SimpleNamespace(
        inputs=prep,
        device_drafts=None,
        config=SimpleNamespace(pipelined=True),
        graphs=None,
        last_acc=None,
        _verify_inputs=ModelRunner._verify_inputs,
    )
    a = _req("a", [1, 2, 3, 4, 5], [6], 5)
    b = _req("b", [7, 8, 9], [10], 3)
    plain = [Row(a, 1, decode=True), Row(b, 1, decode=True)]
    tables = [[4, 5, 7], [6]]
    step = ModelRunner._varlen(runner, plain, tables, None)
    assert step.after == [-1, -1] and step.verify is None and not step.shifted
    ids = torch.tensor(step.ids)
    ModelRunner._accept_eager(runner, plain, ids, torch.tensor([6, 10]), step.verify, None)
    assert runner.last_acc.tolist() == [0, 0]
    drafted = [Row(a, 1, decode=True, drafts=[7, 8]), Row(b, 1, decode=True)]
    drafted[1].after = 0  # b was row 0 of a step before that drafted: it may move
    step = ModelRunner._varlen(runner, drafted, tables, None)
    assert step.verify == ([1, 4], [0, 3], [2, 0])  # (flat first draft, first logit, drafts)
    assert step.after == [-1, 0] and step.shifted
