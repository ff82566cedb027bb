"""One timed pass driven from several load-generator processes (`serving.py --client-procs N`).

One Python process receiving every token of 64 streams over grpc.aio spends most of a core on
it (~20k messages/s on the H200): past some load the client, not the server, sets the pace.
With N processes, prompt i goes to process i mod N, each keeps its share of the pass's
concurrency in flight over its own channel, and all start together: each connects, reports
ready, and waits for one start signal; the pass's wall time runs from that signal to the last
process's last reply (perf_counter is the system's monotonic clock, so the processes' times
compare).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import grpc


def shares(n_items: int, concurrency: int, procs: int) -> list[tuple[list[int], int]]:
    """Per process: (indices of its prompts, its concurrency). No more processes than the
    concurrency, none with no prompt; the concurrency is split as evenly as possible."""
    procs = max(1, min(procs, concurrency))
    out = []
    for p in range(procs):
        idx = list(range(p, n_items, procs))
        c = concurrency // procs + (1 if p < concurrency % procs else 0)
        if idx:
            out.append((idx, c))
    return out


def _child(
    address, prompts, indices, concurrency, config, name, speculate, args, ready, start, results
):
    import serving  # the bench's module: the same `send` as a single-process pass

    from specwire.common.protogen import generation_pb2_grpc as pb_grpc

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            await channel.channel_ready()
            stub = pb_grpc.GenerationServiceStub(channel)
            ready.put(True)
            await asyncio.to_thread(start.wait)
            todo = iter(zip(indices, prompts, strict=True))
            records = []

            async def worker() -> None:
                for i, prompt in todo:
                    rid = f"{config}/{name}/{i}"
                    records.append(await serving.send(stub, prompt, rid, args, speculate))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            results.put((time.perf_counter(), records))

    asyncio.run(main())


def run_pass_procs(address: str, plan, config: str, args: argparse.Namespace, procs: int):
    """(wall seconds, records) of one pass from `procs` processes (blocking)."""
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    children = []
    for indices, c in shares(len(plan.prompts), plan.concurrency, procs):
        prompts = [plan.prompts[i] for i in indices]
        child = ctx.Process(
            target=_child,
            args=(
                address,
                prompts,
                indices,
                c,
                config,
                plan.name,
                plan.speculate,
                args,
                ready,
                start,
                results,
            ),
            daemon=True,
        )
        child.start()
        children.append(child)
    try:
        for _ in children:
            ready.get(timeout=120)
        t0 = time.perf_counter()
        start.set()
        ends, records = [], []
        for _ in children:
            end, recs = results.get(timeout=args.request_timeout)
            ends.append(end)
            records += recs
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
        for q in (ready, results):
            q.close()
            q.join_thread()
    return max(ends) - t0, records
