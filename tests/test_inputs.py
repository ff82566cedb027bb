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
