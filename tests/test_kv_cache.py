"""KV cache manager and scheduler: block accounting under thousands of random steps."""

import random

import pytest

from specwire.target_service.request import Request, RequestState
from specwire.target_service.resources.kv_cache import KVCacheManager, OutOfBlocks
from specwire.target_service.scheduler import Scheduler, SchedulerConfig


def _req(i: int, prompt_len: int, max_new: int = 40, k: int = 4) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_ids=list(range(1, prompt_len + 1)),
        max_new_tokens=max_new,
        max_draft_len=k,
    )


def test_reserve_rewind_free_roundtrip():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_draft_len=4)
    r = _req(0, 5)
    kv.reserve(r, 10)  # 3 blocks
    assert len(kv.block_table(r)) == 3 and kv.num_free_blocks == 6
    kv.rewind(r, 5)  # keep 2 blocks
    assert len(kv.block_table(r)) == 2 and kv.num_free_blocks == 7
    kv.check_integrity()
    with pytest.raises(OutOfBlocks):
        kv.reserve(r, 100)
    kv.free(r)
    assert kv.num_free_blocks == 9
    kv.check_integrity()


def test_dummy_block_is_never_handed_out():
    kv = KVCacheManager(num_blocks=5, block_size=2, max_draft_len=0)
    r = _req(0, 1)
    kv.reserve(r, 8)
    assert KVCacheManager.DUMMY_BLOCK not in kv.block_table(r)
    assert kv.num_free_blocks == 0


def test_thousands_of_random_steps_never_leak():
    """Simulate the executor's KV lifecycle: schedule, prepare, accept a random number of
    drafts, rewind, finish or cancel at random; preemption under pressure included."""
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=40, block_size=4, max_draft_len=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=6, max_num_tokens=48, max_draft_len=4), kv)
    start_free = kv.num_free_blocks
    next_id = 0
    preemptions = 0
    finished = 0
    for _step in range(3000):
        if rng.random() < 0.3:
            sched.add(_req(next_id, rng.randint(1, 30), rng.randint(1, 60)))
            next_id += 1
        batch = sched.schedule()
        preemptions += len(batch.preempted)
        kv.prepare(batch.requests)
        for row in batch.rows:
            req = row.request
            assert len(kv.block_table(req)) * kv.block_size >= req.num_computed + row.num_committed
            accepted = rng.randint(0, req.draft_budget) if row.decode else 0
            req.num_computed += row.num_committed + accepted
            if row.decode:
                req.state = RequestState.DECODE
                req.output_ids.extend([7] * (accepted + 1))
        kv.update(batch.requests, {})
        for req in list(batch.requests):
            done = req.num_tokens >= len(req.prompt_ids) + req.max_new_tokens
            if done or rng.random() < 0.02:  # finish or cancel
                req.state = RequestState.FINISHED
                sched.remove(req)
                kv.free(req)
                finished += 1
        if rng.random() < 0.01 and sched.waiting:  # cancel a waiting request
            req = sched.waiting[-1]
            sched.remove(req)
            kv.free(req)
        kv.check_integrity()
    for req in list(sched.running) + list(sched.waiting):
        sched.remove(req)
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == start_free
    assert finished > 100
    assert preemptions > 0, "the pool was sized to force preemption; none happened"


def test_a_step_beside_one_in_flight_never_touches_its_requests():
    """Two-batch overlap: requests of the step in flight (`exclude`) are neither scheduled
    nor preempted (the device may still write their blocks); `max_rows` caps a step."""
    kv = KVCacheManager(num_blocks=9, block_size=4, max_draft_len=0)  # 8 usable blocks
    sched = Scheduler(SchedulerConfig(max_batch_size=8, max_num_tokens=64, max_draft_len=0), kv)
    a, b, c = _req(0, 12, k=0), _req(1, 8, k=0), _req(2, 8, k=0)
    for r in (a, b, c):
        sched.add(r)
    first = sched.schedule(step_k=0, max_rows=2)
    assert [r.request_id for r in first.requests] == ["r0", "r1"]  # capped at two rows
    kv.prepare(first.requests)
    second = sched.schedule(step_k=0, exclude={a.request_id})
    assert {r.request_id for r in second.requests} == {"r1", "r2"}
    assert not second.preempted and a in sched.running


def test_beside_a_step_in_flight_a_request_short_of_blocks_waits_and_nobody_jumps_ahead():
    """A running request that does not fit while a step is in flight is not preempted (that
    step may give blocks back) and no newer request is admitted ahead of it into the blocks
    it is waiting for."""
    kv = KVCacheManager(num_blocks=9, block_size=4, max_draft_len=0)  # 8 usable blocks
    sched = Scheduler(SchedulerConfig(max_batch_size=8, max_num_tokens=24, max_draft_len=0), kv)
    a, b, c = _req(0, 12, k=0), _req(1, 8, k=0), _req(2, 16, k=0)
    for r in (a, b, c):
        sched.add(r)
    first = sched.schedule(step_k=0)
    assert [(r.request.request_id, r.num_committed) for r in first.rows] == [
        ("r0", 12),
        ("r1", 8),
        ("r2", 4),  # a chunk: the step's 24 tokens are spent
    ]
    kv.prepare(first.requests)  # a 3 blocks, b 2, c 1: 2 left
    for row in first.rows:
        row.request.num_computed += row.num_committed
    b.state = RequestState.DECODE
    b.output_ids.append(7)  # b's next token needs a third block
    newcomer = _req(3, 2, k=0)  # one block would hold it
    sched.add(newcomer)
    # a's step is in flight. b takes a block; c's rest needs 3 of the 1 left.
    step = sched.schedule(step_k=0, exclude={a.request_id})
    assert [r.request_id for r in step.requests] == ["r1"]
    assert not step.preempted and c in sched.running
    assert newcomer in sched.waiting  # not admitted ahead of c
