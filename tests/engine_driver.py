"""Drive a real target engine to completion on the caller's thread (lossless tests, GPU tests)."""

from __future__ import annotations

from specwire.target_service.output import Complete


def run_to_completion(engine, prompts, max_new_tokens=24, speculate=True) -> list[Complete]:
    """Submit every prompt at once, run until idle, return each request's Complete event.

    Also checks that the KV cache is intact and every block is back in the pool."""
    tok = engine.loaded.tokenizer
    streams = [
        engine.executor.submit(
            engine.new_request(tok.encode(p), max_new_tokens=max_new_tokens, speculate=speculate)
        )
        for p in prompts
    ]
    engine.executor.run_until_idle()
    results = []
    for s in streams:
        events = []
        while not s.events.empty():
            events.append(s.events.get())
        assert isinstance(events[-1], Complete), events[-1]
        results.append(events[-1])
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1, "KV blocks leaked"
    return results
