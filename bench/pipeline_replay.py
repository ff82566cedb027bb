"""What drafting steps that do not synchronise would keep of speculation's tokens per step: a
replay of real greedy outputs, no device and no timing.

Today a drafting step waits for the step before it to be read on the host, drafts from what it
committed and launches (`sync` below). The alternative set out in bench/RESULTS.md (round 48)
launches step n+1 before step n is read. The host is then one step behind: it knows what step n
computes for a row but not its outcome, so it prepares step n+1's row for *hypotheses* of that
outcome, and the device picks the one that came true (a row none matches decodes its bonus
token plainly, the only input the device can form on its own):

- `sync`:      drafts from the committed tokens, every step (the n-gram drafter in-process);
- `plain`:     no drafts: one token a step;
- `pipe`:      one hypothesis a row: step n accepts all its drafts and its bonus token is what
               the n-gram index proposes next (the look-ahead); step n+1 verifies the drafts that
               follow it. After a plain step the hypothesis is the index's next token;
- `pipe+bN`:   also N alternatives at each position of step n's drafts (`NGramIndex.alternatives`,
               the remote drafter's branches): the outcomes "the first p drafts accepted, then
               this other token", each with its own drafts for step n+1;
- `device`:    the device drafts itself after verifying (an n-gram lookup on the device): no
               hypotheses, the same steps as `sync`.

Each row's output is the recorded greedy output (lossless: every mode commits it), so a step's
acceptance follows from its drafts alone. For each mode: steps, tokens per step, and the share
of steps that drafted; and the hypothesis hit rate. What a mode would be worth on a device is
its tokens per step times the steps per second it runs: a synchronous step pays the host's
critical path on top of the device, a step that does not synchronise only the device (bounded
at 1.27x in-process at 8 streams on the H200, round 48). `--sync-over-device` is that factor;
the projection is a model, not a measurement.

    python bench/pipeline_replay.py --outputs bench/results/round38/serving80.json.gz --k 4,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from branch_replay import accepted, load_outputs  # noqa: E402

from specwire.common.ngram import NGramIndex  # noqa: E402


def index_of(tokens: list[int]) -> NGramIndex:
    idx = NGramIndex()
    idx.extend(tokens)
    return idx


def run_sync(truth: list[int], start: int, k: int, draft: bool) -> tuple[int, int]:
    """(steps, steps that drafted) to commit truth[start:] drafting from the committed tokens."""
    c, steps, drafted = start, 0, 0
    idx = index_of(truth[:c])
    while c < len(truth):
        drafts = idx.propose(k) if draft else []
        a = accepted(drafts, truth, c)
        n = min(a + 1, len(truth) - c)
        idx.extend(truth[c : c + n])
        c, steps, drafted = c + n, steps + 1, drafted + bool(drafts)
    return steps, drafted


def hypotheses(seq: list[int], fed_drafts: list[int] | None, branches: int) -> list[list[int]]:
    """What the host expects step n to commit, each as the tokens it would add to `seq` (the
    committed tokens the host knows). `fed_drafts` is step n's drafts (None: a plain step)."""
    idx = index_of(seq)
    drafts = fed_drafts or []
    ahead = index_of(seq + drafts).propose(1)
    hyps = [drafts + ahead] if ahead else []
    if branches and drafts:
        for p, token, _ in idx.alternatives(drafts, len(drafts) + 1, branches, len(drafts) + 1):
            hyps.append(drafts[:p] + [token])
    elif branches and ahead:
        hyps += [[t] for _, t, _ in index_of(seq).alternatives(ahead, 1, branches, 1)]
    return hyps


def run_pipe(truth: list[int], start: int, k: int, branches: int) -> tuple[int, int, int, int]:
    """(steps, steps that drafted, hypotheses that came true, steps that had hypotheses) to
    commit truth[start:] when each step is prepared before the previous one is read."""
    # The step in flight: (committed length before it, its drafts or None for a plain step).
    known = start  # the step that ends the prompt drafts from it: nothing is in flight yet
    fed = index_of(truth[:start]).propose(k) or None
    steps = drafted = hits = tried = 0
    while True:
        # Step n = (known, fed) runs; its outcome on the device:
        a = accepted(fed or [], truth, known)
        n = min(a + 1, len(truth) - known)
        steps += 1
        drafted += fed is not None and len(fed) > 0
        after = known + n
        if after >= len(truth):
            return steps, drafted, hits, tried
        # Step n+1 was prepared from hypotheses of that outcome, before it was known.
        seq = truth[:known]
        hyps = hypotheses(seq, fed, branches)
        tried += bool(hyps)
        nxt = None
        for h in hyps:
            if truth[known : known + len(h)] == h and known + len(h) == after:
                nxt = index_of(seq + h).propose(k)
                hits += 1
                break
        known, fed = after, nxt  # no hypothesis came true: a plain step (fed None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", default="bench/results/round38/serving80.json.gz")
    ap.add_argument("--k", default="4,8", help="draft lengths (comma-separated)")
    ap.add_argument("--branches", default="0,1,2", help="alternatives a position for pipe+bN")
    ap.add_argument(
        "--sync-over-device",
        type=float,
        default=1.27,
        help="a synchronous step's period over the device's alone (round 48: 1.27 "
        "in-process at 8 streams on the H200)",
    )
    args = ap.parse_args()
    path = Path(args.outputs)
    records = load_outputs(str(path if path.exists() else ROOT / path))
    tokens = sum(len(r["output"]) for r in records)
    print(f"{len(records)} requests, {tokens} output tokens ({args.outputs})\n")
    print(
        "| k | mode | steps | tokens/step | drafting steps | hypotheses true | ÷ sync tokens/step "
        "| projected ÷ sync |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k in [int(x) for x in args.k.split(",")]:
        base = None
        rows = []
        for mode in ["sync", "plain"] + [
            f"pipe+b{b}" if b else "pipe" for b in map(int, args.branches.split(","))
        ]:
            steps = drafted = hits = tried = 0
            for r in records:
                truth, start = list(r["prompt"]) + list(r["output"]), len(r["prompt"])
                if mode in ("sync", "plain"):
                    s, d = run_sync(truth, start, k, mode == "sync")
                    h = t = 0
                else:
                    b = int(mode[6:]) if "+b" in mode else 0
                    s, d, h, t = run_pipe(truth, start, k, b)
                steps, drafted, hits, tried = steps + s, drafted + d, hits + h, tried + t
            base = base or steps
            rows.append((mode, steps, drafted, hits, tried))
        rows.append(("device", base, rows[0][2], 0, 0))
        for mode, steps, drafted, hits, tried in rows:
            share = base / steps
            # sync pays the host's critical path; plain overlaps (shown unprojected: its 1-token
            # step is cheaper than a verify step, which this model does not know).
            proj = {"sync": 1.0, "plain": float("nan")}.get(mode, share * args.sync_over_device)
            true = f"{hits / tried:.0%}" if tried else "–"
            print(
                f"| {k} | {mode} | {steps} | {tokens / steps:.2f} | {drafted / steps:.0%} | "
                f"{true} | {share:.3f} | {proj:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
