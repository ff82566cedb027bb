"""Drive a real target engine to completion on the caller's thread (lossless tests, GPU tests)."""

from __future__ import annotations

from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import build_engine
from specwire.target_service.output import Complete


def tiny_engine(drafter: str = "none", **kw):
    """A tiny-random engine on the CPU: K = 4, 8 rows a step unless `kw` says otherwise."""
    kw.setdefault("max_batch_size", 8)
    cfg = TargetConfig(model="tiny-random", drafter=drafter, max_draft_len=4, progress=False, **kw)
    return build_engine(cfg)


def counter(engine, name: str) -> float:
    """A counter of the engine's /metrics registry (its public face), e.g. `steps`."""
    metrics = engine.executor.metrics
    return metrics.registry.get_sample_value(f"specwire_{name}_total", {"model": metrics.model})


def run_to_completion(engine, prompts, max_new_tokens=24, speculate=True) -> list[Complete]:
    """Submit every prompt at once, run until idle, return each request's Complete event.
    `speculate`: for every request, or one bool per prompt.

    Also checks that the KV cache is intact and every block is back in the pool."""
    tok = engine.loaded.tokenizer
    if isinstance(speculate, bool):
        speculate = [speculate] * len(prompts)
    streams = [
        engine.executor.submit(
            engine.new_request(tok.encode(p), max_new_tokens=max_new_tokens, speculate=spec)
        )
        for p, spec in zip(prompts, speculate, strict=True)
    ]
    engine.executor.run_until_idle()
    results = [completion(s) for s in streams]
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1, "KV blocks leaked"
    return results


def completion(stream) -> Complete:
    """The Complete event that ended a finished stream (its queue drained)."""
    events = []
    while not stream.events.empty():
        events.append(stream.events.get())
    assert isinstance(events[-1], Complete), events[-1]
    return events[-1]
