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
