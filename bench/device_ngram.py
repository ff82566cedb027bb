"""The n-gram drafter's lookup on the device: what it costs, and a check that it proposes exactly
what the host's index does.

`--draft-on-device` (runner/device_drafts.py) runs the lookup inside the step, so the host's
lookups leave its critical path; it is also what would let a step's drafts come from the previous
step's verified tokens without the host in between (bench/RESULTS.md, round 49;
`bench/pipeline_replay.py`, mode `device`). The lookup must propose what `NGramIndex.propose`
does (prefer="latest"), so that nothing about the drafts changes but where they are computed:

- the longest suffix of the sequence (up to `max_ngram` tokens, and fewer than the sequence)
  that occurred earlier with a token after it;
- of its latest `vote` occurrences, the first whose next token most of them share;
- what followed that occurrence, continued periodically (copy with overlap) to the budget.

Two implementations: `--impl kernel`, the server's one Triton launch
(`specwire/common/model/triton_ngram.py`) over a paged token cache, and `propose_batch` here,
a fixed number of tensor operations for a whole batch (no data-dependent shapes or host syncs:
it could sit in a CUDA graph too), kept as a reference and to compare costs (`--impl tensor`,
or `compiled` through torch.compile).

    python bench/device_ngram.py --check 300 --outputs bench/results/round38/serving80.json.gz
    python bench/device_ngram.py --rows 1,8,32,64 --ctx 512,2048  # time it (CPU or --device cuda)
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from branch_replay import load_outputs  # noqa: E402

from specwire.common.ngram import DEFAULT_MAX_NGRAM, VOTE, NGramIndex  # noqa: E402


def propose_batch(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    vote: int = VOTE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for each row of `tokens` [B, Lmax] (row b's sequence is its first `lengths[b]`
    tokens; the rest is ignored): (`drafts` [B, budget], `found` [B] bool). A row with no match
    has found False and drafts of no meaning; a row with one has `budget` drafts, as
    `NGramIndex.propose(budget)` would give for that sequence."""
    rows, width = tokens.shape
    dev = tokens.device
    length = lengths.view(rows, 1).to(torch.long)
    pos = torch.arange(width, device=dev).view(1, width)  # e: the token after an occurrence
    longest = (length - 1).clamp(max=max_ngram)  # the suffix may not be the whole sequence
    back = torch.arange(max_ngram, device=dev).view(1, max_ngram)
    last = tokens.gather(1, (length - 1 - back).clamp(min=0))  # [B, M]: last[t] = T[L-1-t]
    run = (pos >= 1) & (pos <= length - 1)  # occurrences end before the last token
    match = torch.zeros(rows, width, dtype=torch.long, device=dev)
    for t in range(max_ngram):
        src = (pos - 1 - t).clamp(min=0).expand(rows, width)
        run = (
            run & (pos - 1 - t >= 0) & (t < longest) & (tokens.gather(1, src) == last[:, t : t + 1])
        )
        match += run
    n = match.max(dim=1, keepdim=True).values  # [B, 1]: the longest match
    found = n.squeeze(1) > 0
    latest = torch.where((match == n) & (n > 0), pos, -1)
    top = latest.topk(min(vote, width), dim=1).values  # its latest occurrences, latest first
    seen = top >= 0
    nexts = tokens.gather(1, top.clamp(min=0))
    votes = ((nexts[:, :, None] == nexts[:, None, :]) & seen[:, None, :]).sum(-1)
    order = torch.arange(top.shape[1], device=dev).view(1, -1)
    score = torch.where(seen, votes * top.shape[1] - order, -1)  # ties: the latest occurrence
    start = top.gather(1, score.argmax(dim=1, keepdim=True)).clamp(min=0)  # [B, 1]
    period = (length - start).clamp(min=1)
    step = torch.arange(budget, device=dev).view(1, budget)
    drafts = tokens.gather(1, (start + step % period).clamp(max=width - 1))
    return drafts, found


try:  # the one-launch kernel needs Triton (a GPU, or TRITON_INTERPRET=1 to run it on the CPU)
    import triton

    from specwire.common.model.triton_ngram import ngram_drafts
except ImportError:  # pragma: no cover - CPU machines without Triton time the tensor ops only
    triton = None


def paged(tokens: torch.Tensor, block_size: int = 16, seed: int = 0):
    """`tokens` [B, W] as the server lays a cache out: a flat cache of shuffled blocks and each
    row's block table (`specwire.common.model.paged`), so a lookup must go through the table."""
    rows, width = tokens.shape
    per_row = -(-width // block_size)
    padded = torch.zeros(rows, per_row * block_size, dtype=tokens.dtype, device=tokens.device)
    padded[:, :width] = tokens
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(rows * per_row, generator=gen).to(tokens.device)  # table -> block
    cache = torch.empty(rows * per_row * block_size, dtype=tokens.dtype, device=tokens.device)
    cache.view(-1, block_size)[order] = padded.view(-1, block_size)
    return cache, order.view(rows, per_row).to(torch.int32)


def propose_kernel(
    tokens: torch.Tensor, lengths: torch.Tensor, budget: int, block: int = 1024, bs: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """`propose_batch` in one Triton launch over the rows' tokens laid out in blocks (`paged`:
    done here, outside the launch, as the server's cache already is)."""
    cache, tables = paged(tokens, bs)
    return propose_paged(cache, tables, lengths, budget, block, bs)


def propose_paged(cache, tables, lengths, budget: int, block: int = 1024, bs: int = 16):
    """The server's launch (`triton_ngram.ngram_drafts`), every row drafting `budget` tokens
    into a scratch id buffer (no slots: the cache is left as it is): drafts [B, budget], found."""
    rows, dev = tables.shape[0], cache.device
    drafts = torch.empty(rows, budget, dtype=cache.dtype, device=dev)
    found = torch.empty(rows, dtype=torch.bool, device=dev)
    caps = torch.full((rows,), budget, dtype=torch.long, device=dev)
    offsets = torch.arange(rows, device=dev) * budget
    ids = torch.empty(rows * budget, dtype=cache.dtype, device=dev)
    slots = torch.full((rows * budget,), -1, dtype=torch.long, device=dev)
    ngram_drafts(
        cache, tables, lengths, caps, offsets, ids, slots, drafts, found,
        block_size=bs, max_ngram=DEFAULT_MAX_NGRAM, vote=VOTE, block=block,
    )  # fmt: skip
    return drafts, found


def check(cases: int, seed: int, outputs: str | None = None, device: str = "cpu", fn=None) -> int:
    """Compare with `NGramIndex.propose` on random sequences over small vocabularies (many
    repeats, overlapping occurrences, ties in the vote), every prefix of one, and with
    `outputs` (saved by `branch_replay.py --save-outputs`) every 7th prefix of each recorded
    prompt + output; returns the number of mismatches. `fn`: the implementation checked
    (default `propose_batch`)."""
    fn = fn or propose_batch
    rng = random.Random(seed)
    seqs = []
    for r in load_outputs(outputs) if outputs else []:
        seq = list(r["prompt"]) + list(r["output"])
        seqs += [seq[:n] for n in range(len(r["prompt"]), len(seq), 7)]
    for _ in range(cases):
        vocab = rng.choice([2, 3, 5, 20, 1000])
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 80))])
    base = [rng.randrange(4) for _ in range(60)]
    seqs += [base[:n] for n in range(len(base) + 1)]
    width = max(len(s) for s in seqs) + 3
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        tokens[i, len(s) :] = 7  # what lies past a row's length must not matter
    lengths = torch.tensor([len(s) for s in seqs])
    bad = 0
    for budget in (1, 4, 9):
        drafts, found = fn(tokens.to(device), lengths.to(device), budget)
        drafts, found = drafts.cpu(), found.cpu()
        for i, s in enumerate(seqs):
            idx = NGramIndex()
            idx.extend(s)
            want = idx.propose(budget)
            got = drafts[i].tolist() if found[i] else []
            if got != want:
                bad += 1
                if bad <= 5:
                    print(f"mismatch: seq={s} budget={budget} want={want} got={got}")
    print(f"{len(seqs)} sequences x 3 budgets: {bad} mismatches")
    return bad


def timeit(
    rows: int, ctx: int, budget: int, device: str, graph: bool, iters: int, impl, block: int
) -> float:
    """µs per call of `impl` (`propose_batch`, it compiled, or "kernel": the server's launch
    over a paged cache, laid out once as a server's is) on random sequences of `ctx` tokens
    (vocab 50,000)."""
    gen = torch.Generator().manual_seed(rows * 7919 + ctx)
    tokens = torch.randint(0, 50_000, (rows, ctx), generator=gen).to(device)
    tokens[:, ctx // 2 : ctx // 2 + 16] = tokens[:, ctx - 16 :].clone()  # one long match a row
    lengths = torch.full((rows,), ctx, dtype=torch.long, device=device)
    if impl == "kernel":
        cache, tables = paged(tokens)
        call = lambda: propose_paged(cache, tables, lengths, budget, block)  # noqa: E731
    else:
        call = lambda: impl(tokens, lengths, budget)  # noqa: E731
    if device == "cuda" and graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        call = g.replay  # noqa: E731
    for _ in range(3):
        call()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", type=int, default=0, help="random sequences to compare (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outputs", help="also check every 7th prefix of these saved outputs")
    ap.add_argument("--block", type=int, default=1024, help="the kernel's positions a block")
    ap.add_argument("--rows", default="", help="batch sizes to time (comma-separated)")
    ap.add_argument("--ctx", default="512,2048", help="sequence lengths to time")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-graph", action="store_true", help="on CUDA, time eager calls")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--impl",
        choices=("tensor", "compiled", "kernel"),
        default="tensor",
        help="tensor ops (propose_batch), them through torch.compile, or the Triton kernel",
    )
    args = ap.parse_args()
    if args.impl == "kernel" and triton is None:
        print(
            "--impl kernel needs Triton (a CUDA build of torch, or triton and TRITON_INTERPRET=1)"
        )
        return 2
    if args.impl == "kernel":
        impl = "kernel"
        fn = functools.partial(propose_kernel, block=args.block)
    else:
        fn = impl = (
            torch.compile(propose_batch, dynamic=False)
            if args.impl == "compiled"
            else propose_batch
        )
    if args.check and check(args.check, args.seed, args.outputs, args.device, fn):
        return 1
    if args.rows:
        graph = args.device == "cuda" and not args.no_graph
        mode = f"{args.impl}, " + ("graph" if graph else "eager")
        print(f"\n| rows | ctx | µs per call ({args.device}, {mode}, budget {args.budget}) |")
        print("|---|---|---|")
        for rows in map(int, args.rows.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                us = timeit(
                    rows, ctx, args.budget, args.device, graph, args.iters, impl, args.block
                )
                print(f"| {rows} | {ctx} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
