"""Which steps a remote n-gram drafter can draft without waiting, with and without branches:
a replay of real greedy outputs through the real drafting code, no device and no timing.

1. The target model (default SmolLM2-135M, fp32, on this machine's CPU) decodes greedily,
   without speculation, the chat prompts of `bench/prompt_pool.py` (HumanEval; the first
   `--per-kind` of each kind). Greedy speculation is lossless, so these are the tokens every
   drafter's run commits: each step's acceptance follows from its drafts alone.
2. Each output is replayed step by step under four drafters:
   - `inproc`:  the n-gram index drafts from what was committed, every step (in-process);
   - `wait`:    the same drafts from the drafter service, every drafting step waiting for it;
   - `remote`:  the drafter service not waited for (patience 0, as the auto patience does on
                the H200 at small batch): a step drafts only from a proposal it already holds
                (`RemoteSessions.drafts_from_run`), the latest that arrived, with its
                look-ahead (`--lookahead`; the client's auto by default). As the real client,
                a step asks only while no question is in flight (`--max-inflight`: more, a
                variant the real client does not run); `--reply-steps` says how
                many steps after the one that asked a reply is usable (2: it arrives during
                the next step; 3: a step late, a round trip longer than a step);
   - `branch`:  `remote` plus branches (`--branch-positions`, `--branches` per position).
   The drafter side is the real `DraftEngine` with the real `NGramDrafter`, called directly
   (no gRPC); the target side the real `RemoteSessions`.
3. For each: steps, steps with drafts, tokens per step. `--step-ms`, `--verify-ms` and
   `--rtt-ms` turn those into a projected speed against plain decoding; the defaults are the
   H200's at one stream (round 9: 1-token step, 5-token verify step, drafter round trip). A
   model, not a measurement: the real figures come from `bench/serving.py` on the GPU.

    python bench/branch_replay.py [--per-kind 10] [--kinds all] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from prompt_pool import ALL_KINDS, KINDS, build_pool  # noqa: E402

from specwire.common.drafters.ngram import NGramDrafter  # noqa: E402
from specwire.common.ngram import DEFAULT_MAX_NGRAM, VOTE, NGramIndex  # noqa: E402
from specwire.drafter_service.config import DrafterServiceConfig  # noqa: E402
from specwire.drafter_service.engine import DraftEngine, SeqUpdate  # noqa: E402
from specwire.drafter_service.sessions import SessionStore  # noqa: E402
from specwire.target_service.drafters.remote import LOOKAHEAD_STEPS  # noqa: E402
from specwire.target_service.drafters.remote_sessions import RemoteSessions  # noqa: E402
from specwire.target_service.request import Request, RequestState  # noqa: E402

MODES = ("inproc", "wait", "remote", "branch")


def greedy_outputs(args) -> tuple[list[dict], str]:
    """(one record per prompt: id, kind, prompt ids, greedy output ids; the prompts' source)."""
    from specwire.target_service.config import TargetConfig
    from specwire.target_service.engine import build_engine

    pool, source = build_pool(chat=True, kinds=args.kinds, seed=args.seed)
    skip = {d["id"] for d in json.loads(Path(args.exclude).read_text())} if args.exclude else set()
    pool = [p for p in pool if p.id not in skip]
    chosen = [
        p for kind in args.kinds for p in [q for q in pool if q.kind == kind][: args.per_kind]
    ]
    cfg = TargetConfig(
        model=args.model,
        drafter="none",
        device="cpu",
        dtype="float32",
        cuda_graphs=False,
        max_batch_size=64,
        max_num_tokens=8192,
        max_context_len=4096,
        progress=False,
    )
    eng = build_engine(cfg)
    tok = eng.loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in chosen]
    streams = [
        eng.executor.submit(eng.new_request(ids, max_new_tokens=args.max_new_tokens))
        for ids in prompts
    ]
    eng.executor.run_until_idle()
    out = []
    for p, ids, s in zip(chosen, prompts, streams, strict=True):
        last = None
        while not s.events.empty():
            last = s.events.get()
        out.append({"id": p.id, "kind": p.kind, "prompt": ids, "output": last.token_ids})
    eng.shutdown()
    return out, source


def load_outputs(path: str) -> list[dict]:
    """Greedy outputs saved by `--save-outputs`, as saved or gzipped (as in bench/results/)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def auto_lookahead(args) -> int:
    """`--lookahead`, or the remote client's auto for an n-gram drafter."""
    return args.lookahead if args.lookahead >= 0 else LOOKAHEAD_STEPS * (args.k + 1)


def accepted(drafts: list[int], truth: list[int], at: int) -> int:
    a = 0
    while a < len(drafts) and at + a < len(truth) and drafts[a] == truth[at + a]:
        a += 1
    return a


def replay(record: dict, mode: str, args) -> tuple[int, int, int, int, int]:
    """(steps, steps with drafts, tokens, draft tokens, accepted draft tokens) of one request
    under `mode`."""
    k = args.k
    lookahead = auto_lookahead(args)
    prompt, output = record["prompt"], record["output"]
    truth = prompt + output
    req = Request("r", list(prompt), max_new_tokens=len(output), max_draft_len=k)
    req.state, req.step_draft_cap = RequestState.DECODE, k
    sessions = RemoteSessions()
    drafter = NGramDrafter(args.max_ngram, vote=args.vote)
    engine = DraftEngine(drafter, SessionStore(drafter), max_draft_len=args.drafter_max)
    index = NGramIndex(args.max_ngram, vote=args.vote)
    index.extend(prompt)
    synced = 0  # the tokens the drafter holds
    pending: list[tuple] = []  # (step that asked, reply) asked for, oldest first, not arrived
    steps = drafting = drafted = accepted_total = 0
    while req.num_tokens < len(truth):
        n = req.num_tokens
        if mode in ("inproc", "wait"):
            drafts = index.propose(k)
        else:
            got = sessions.drafts_from_run(req)
            drafts = got[0] if got else []
        a = accepted(drafts, truth, n)
        commit = truth[n : min(len(truth), n + a + 1)]
        req.output_ids += commit
        index.extend(commit)
        steps += 1
        drafting += bool(drafts)
        drafted, accepted_total = drafted + len(drafts), accepted_total + a
        # A reply arrives `--reply-steps` - 1 steps after the one that asked: usable from the
        # step after that (2: it arrives during the next step). As the real client does, a
        # step asks only while fewer than `--max-inflight` questions are in flight (1: none;
        # its deltas ride along later).
        while pending and steps - pending[0][0] >= args.reply_steps - 1:
            sessions.keep("r", *pending.pop(0)[1])
        if mode in ("remote", "branch") and len(pending) < args.max_inflight:
            ask = min(k + lookahead, args.drafter_max)  # the step's K drafts, the look-ahead
            per = args.branches if mode == "branch" else 0
            update = SeqUpdate(
                "r",
                synced,
                req.tokens_between(synced, req.num_tokens),
                ask,
                max_branches=per,
                branch_positions=min(args.branch_positions, ask + 1) if per else 0,
            )
            synced = req.num_tokens
            sessions.synced["r"] = synced
            (reply,) = engine.draft([update])
            pending.append((steps, (synced, reply.tokens, None, ask, reply.branches or ())))
    return steps, drafting, req.num_tokens - len(prompt), drafted, accepted_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-kind", type=int, default=10)
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="prompt kinds, comma-separated, or 'all' (the serving benchmark's --kinds all)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="drafts per step")
    ap.add_argument("--max-ngram", type=int, default=DEFAULT_MAX_NGRAM, help="both drafters'")
    ap.add_argument(
        "--vote", type=int, default=VOTE, help="occurrences that vote (1: the latest alone)"
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt pool order")
    ap.add_argument(
        "--exclude", help="skip the prompts of outputs saved earlier (JSON): a held-out set"
    )
    ap.add_argument("--branches", type=int, default=4, help="alternatives per position")
    ap.add_argument("--branch-positions", type=int, default=2)
    ap.add_argument(
        "--lookahead",
        type=int,
        default=-1,
        help="tokens asked past a step's K drafts (-1: the client's auto for n-gram)",
    )
    ap.add_argument(
        "--drafter-max",
        type=int,
        default=DrafterServiceConfig().max_draft_len,
        help="the drafter service's --max-draft-len (caps drafts + look-ahead)",
    )
    ap.add_argument(
        "--reply-steps",
        type=int,
        default=2,
        help="a reply asked for as step s commits is usable from step s + N (2: it arrives"
        " during the next step; 3: a round trip longer than a step, as at 8 streams)",
    )
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=1,
        help="questions a client keeps in flight at once (the client's: 1)",
    )
    ap.add_argument("--step-ms", type=float, default=1.17, help="1-token step")
    ap.add_argument("--verify-ms", type=float, default=1.30, help="1+K-token step")
    ap.add_argument("--rtt-ms", type=float, default=0.85, help="drafter round trip (wait mode)")
    ap.add_argument(
        "--outputs", help="reuse greedy outputs saved by an earlier run (JSON, or gzipped JSON)"
    )
    ap.add_argument("--save-outputs", help="save the greedy outputs here (JSON)")
    args = ap.parse_args()
    args.kinds = ALL_KINDS if args.kinds == "all" else tuple(args.kinds.split(","))

    t0 = time.perf_counter()
    if args.outputs:
        data = load_outputs(args.outputs)
        source = f"outputs from {args.outputs}"
    else:
        data, source = greedy_outputs(args)
        if args.save_outputs:
            Path(args.save_outputs).write_text(json.dumps(data))
    print(
        f"# {len(data)} prompts ({source}), {args.model} fp32 greedy on CPU, "
        f"{sum(len(d['output']) for d in data)} tokens ({time.perf_counter() - t0:.0f} s); "
        f"K={args.k}, max n-gram {args.max_ngram}, vote {args.vote}, "
        f"look-ahead {auto_lookahead(args)} (drafter cap {args.drafter_max}), "
        f"branches {args.branches} x {args.branch_positions} positions, "
        f"replies usable {args.reply_steps} steps after they are asked for, "
        f"at most {args.max_inflight} in flight; "
        f"costs: step {args.step_ms} ms, verify {args.verify_ms} ms, rtt {args.rtt_ms} ms\n"
    )
    print(
        "| kind | drafter | steps | with drafts | accepted per draft token | tokens/step | "
        "projected ÷ none | ÷ inproc |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("all", *sorted({d["kind"] for d in data})):
        rows = [d for d in data if kind in ("all", d["kind"])]
        inproc_speed = None
        for mode in MODES:
            steps = drafting = tokens = drafted = hits = 0
            for d in rows:
                s, dr, t, n, a = replay(d, mode, args)
                steps, drafting, tokens = steps + s, drafting + dr, tokens + t
                drafted, hits = drafted + n, hits + a
            ms = (steps - drafting) * args.step_ms + drafting * args.verify_ms
            ms += drafting * args.rtt_ms if mode == "wait" else 0.0
            speed = tokens / ms * args.step_ms  # plain decoding: one token per step
            inproc_speed = inproc_speed or speed
            print(
                f"| {kind} | {mode} | {steps} | {drafting} | {hits / max(drafted, 1):.3f} | "
                f"{tokens / steps:.2f} | "
                f"{speed:.2f}× | {speed / inproc_speed:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
