"""Serving benchmark over gRPC on prompts each server sees for the first time.

Real traffic is new: a benchmark that warms up on the prompts it then times hides first-sight
costs (new shapes, new compiles, new KV layouts). Here every configuration (--configs) is a
fresh `specwire target` process (bench/servers.py) driven over gRPC, and within one server no
timed prompt is ever sent twice, except in the explicit replay pass:

1. warm-up: --warmup-prompts prompts reserved for warm-up, never timed;
2. for each concurrency c (--concurrency): a timed pass on prompts that server has never seen;
3. replay: the prompts of the largest-c pass again at that c, reported apart, with the ratio
   first-sight / replay.

With --paired, step 2 becomes pairs of passes on the same server: at each c, --pairs times one
fresh batch split in two halves with the same mix of prompt kinds, one half sent with
speculation on and the other with `speculation.disable` set on every request, back to back,
the first of each pair alternating; no replay. Each pair gives a ratio on / off that the
server-to-server spread does not touch (serving_stats.paired_ratios).

With --interleave, a round's configurations are not run one after the other but side by side:
every server is started first, then each pass runs on each server in turn (the servers' order
reversed every other pass). Configurations run minutes apart compared the machine's drift as
much as the code: on one H100 start the same remote-drafter configuration ran 8,725 tok/s and,
four servers later, 9,737 (bench/RESULTS.md, round 44). Each pass records `seq`, its place
among all the run's passes.

Every configuration gets the same prompt sets (each is a fresh server, so each sees them first),
so configurations compare side by side. A ledger of the prompts sent to each server refuses to
run a pass that would time a repeated prompt. Concurrency c keeps c requests in flight (c
coroutines over one grpc.aio channel, each taking the next prompt) until the pass's prompts
are done. How each figure is computed: bench/serving_stats.py and bench/README.md.

    python bench/serving.py --model tiny-random --concurrency 1,4 --prompts-per-pass 8 \
        --max-new-tokens 16                                                   # CPU smoke run
    python bench/serving.py --model smollm2-135m --device cuda --dtype bfloat16 \
        --configs none,ngram,remote-ngram --concurrency 1,8,32,64 --metrics --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from client_procs import run_pass_procs  # noqa: E402
from policy_stats import policy_pass  # noqa: E402
from prompt_pool import ALL_KINDS, KINDS, Prompt, build_pool  # noqa: E402
from servers import CONFIGS, add_target_flags, running_config, scrape_metrics  # noqa: E402
from serving_plan import Ledger, PassPlan, plan_paired, plan_passes  # noqa: E402
from serving_stats import (  # noqa: E402
    RequestRecord,
    config_markdown,
    paired_markdown,
    repeat_markdown,
    steady_state,
    summarise,
    summary_markdown,
)

from specwire.common.client import FINISH_NAMES, build_request  # noqa: E402
from specwire.common.protogen import generation_pb2 as pb  # noqa: E402
from specwire.common.protogen import generation_pb2_grpc as pb_grpc  # noqa: E402
from specwire.target_service.metrics import DRAFTER_TIMINGS  # noqa: E402

EAGER = "specwire_eager_steps_total"
OVERLAPPED = "specwire_overlapped_steps_total"
ONE_TOKEN = "specwire_one_token_step_gpu_seconds"
STEPS = "specwire_steps_total"


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def send(
    stub, prompt: Prompt, rid: str, args: argparse.Namespace, speculate: bool = True
) -> RequestRecord:
    rec = RequestRecord(prompt.id, prompt.kind)
    text = dict(chat=[{"role": "user", "content": prompt.text}]) if args.chat else {}
    req = build_request(
        None if args.chat else prompt.text,
        **text,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        ignore_eos=args.ignore_eos,
        request_id=rid,
        speculate=speculate,  # False: `speculation.disable` on this request
    )
    rec.sent = time.perf_counter()
    try:
        async for resp in stub.Generate(req, timeout=args.request_timeout):
            now = time.perf_counter()
            which = resp.WhichOneof("response")
            if which == "chunk" and resp.chunk.token_ids:
                rec.chunks.append((now, len(resp.chunk.token_ids)))
            elif which == "complete":
                c = resp.complete
                rec.done, rec.completion_tokens = now, c.usage.completion_tokens
                rec.server_ttft = c.time_to_first_token_s
                rec.finish = FINISH_NAMES.get(c.finish_reason, "unspecified")
                s = c.speculation
                rec.steps, rec.drafted, rec.accepted = s.steps, s.draft_tokens, s.accepted_tokens
            elif which == "error":
                rec.error = f"{resp.error.code}: {resp.error.message}"
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    return rec


async def run_pass(stub, plan: PassPlan, config: str, args) -> tuple[float, list[RequestRecord]]:
    """(wall seconds, records) with `plan.concurrency` requests in flight until all are done."""
    todo = iter(enumerate(plan.prompts))
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i, prompt in todo:  # shared iterator: each worker takes the next prompt
            rid = f"{config}/{plan.name}/{i}"
            records.append(await send(stub, prompt, rid, args, plan.speculate))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return time.perf_counter() - t0, records


def _counter_delta(before: dict, after: dict, name: str) -> float | None:
    return after[name] - before.get(name, 0.0) if name in after else None


def _graph_gpu_s(before: dict, after: dict) -> float | None:
    """Device time of the pass's graph steps: the server times a sample of them
    (`specwire_step_gpu_seconds`), so their mean x the number of graph steps."""
    mean_ms = _mean_ms(before, after, "specwire_step_gpu_seconds")
    steps = _counter_delta(before, after, STEPS)
    eager = _counter_delta(before, after, EAGER) or 0.0
    if mean_ms is None or steps is None:
        return None
    return mean_ms / 1e3 * max(0.0, steps - eager)


def _mean_ms(before: dict, after: dict, histogram: str) -> float | None:
    """Mean of a histogram's observations between two scrapes, in ms."""
    total = _counter_delta(before, after, histogram + "_sum")
    count = _counter_delta(before, after, histogram + "_count")
    return total / count * 1e3 if total is not None and count else None


class ServerRun:
    """One server's passes over one channel: `run` times a pass, `record` is the
    configuration's JSON record. A ledger per server refuses a timed prompt it has seen."""

    def __init__(self, server, args) -> None:
        self.server, self.args = server, args
        self.ledger = Ledger()
        self.passes: list[dict] = []
        self.first_sight: list[RequestRecord] = []  # the timed passes' requests, no replay
        self.info = None

    async def __aenter__(self) -> ServerRun:
        self._channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = pb_grpc.GenerationServiceStub(self._channel)
        try:
            self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except BaseException:
            await self._channel.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()

    async def run(self, plan: PassPlan, seq: int) -> None:
        """Run `plan` on this server; `seq`: its place among every pass of the run (with
        --interleave, the servers' passes alternate)."""
        args = self.args
        self.ledger.admit(plan.prompts, plan.replay)  # before anything is sent
        before = await asyncio.to_thread(scrape_metrics, self.server.metrics_url)
        if args.client_procs > 1:
            wall, records = await asyncio.to_thread(
                run_pass_procs,
                self.server.address,
                plan,
                self.server.config,
                args,
                args.client_procs,
            )
        else:
            wall, records = await run_pass(self.stub, plan, self.server.config, args)
        after = await asyncio.to_thread(scrape_metrics, self.server.metrics_url)
        timed = plan.timed
        rec = dict(
            name=plan.name,
            concurrency=plan.concurrency,
            timed=timed,
            seq=seq,
            **({} if plan.pair is None else dict(pair=plan.pair, speculate=plan.speculate)),
            summary=summarise(records, wall),
            **steady_state(records, plan.concurrency),
            per_kind={
                k: summarise([r for r in records if r.kind == k], None)
                for k in ALL_KINDS
                if any(r.kind == k for r in records)
            },
            eager_steps=_counter_delta(before, after, EAGER),
            overlapped_steps=_counter_delta(before, after, OVERLAPPED),
            steps=_counter_delta(before, after, STEPS),
            step_ms=_mean_ms(before, after, "specwire_step_seconds"),
            host_ms=_mean_ms(before, after, "specwire_step_host_seconds"),
            gpu_ms=_mean_ms(before, after, "specwire_step_gpu_seconds"),
            # the drafter's exposed time, summed, against all steps' time
            draft_s=_counter_delta(before, after, "specwire_draft_seconds_sum"),
            draft_steps=_counter_delta(before, after, "specwire_draft_seconds_count"),
            # and the rest of it: a synchronous step's ask after its commit (remote)
            ask_s=_counter_delta(before, after, "specwire_drafter_ask_seconds_sum"),
            ask_steps=_counter_delta(before, after, "specwire_drafter_ask_seconds_count"),
            step_s=_counter_delta(before, after, "specwire_step_seconds_sum"),
            # synchronous steps (speculative ones, where steps overlap), timed from the end
            # of the step before: what a switch to speculation costs per step
            sync_steps=_counter_delta(before, after, "specwire_sync_step_seconds_count"),
            sync_ms=_mean_ms(before, after, "specwire_sync_step_seconds"),
            drafter={
                k: _counter_delta(before, after, f"specwire_drafter_{k}_total")
                for k in (
                    "lookahead",
                    "branched",
                    "prefetched",
                    "late",
                    "failed",
                    "deferred",
                    "at_launch",
                    "probes",
                    "hypotheses_held",
                    "hypotheses_failed",
                )
            },
            # the remote drafter's auto-patience EMAs at the pass's end, ms (None: not
            # sampled yet, or no remote drafter)
            drafter_ema_ms={
                k: after[name] * 1e3 if (name := f"specwire_drafter_{k}_seconds") in after else None
                for k in DRAFTER_TIMINGS
            },
            # device time of the pass's graph steps (mean of the sampled ones x their
            # number): / wall = how busy the GPU was
            gpu_s=_graph_gpu_s(before, after),
            wall_s=wall,
            one_token_gpu_ms=after.get(ONE_TOKEN) and after[ONE_TOKEN] * 1e3,
            policy=policy_pass(before, after),
            requests=[r.to_json() for r in records],
        )
        self.passes.append(rec)
        if timed and not plan.replay:
            self.first_sight += records
        s = rec["summary"]
        steady = (
            f"n/a, {rec['steady_na']}"
            if rec["steady_na"]
            else f"{rec['steady_tok_s']:.1f} tok/s over {rec['steady_s']:.2f}s"
        )
        log(
            f"{self.server.config} {plan.name}: {s['completion_tokens']} tokens in {wall:.2f}s "
            f"({s['tok_per_s'] or 0:.1f} tok/s; steady {steady}), errors {s['errors']}"
            + ("" if timed else " [warm-up, not timed]")
        )

    def record(self) -> dict:
        return dict(
            config=self.server.config,
            commands=[shlex.join(c) for c in self.server.commands],
            startup_s=self.server.startup_s,
            model=dict(
                drafter=self.info.drafter,
                max_draft_len=self.info.max_draft_len,
                cuda_graphs=self.info.cuda_graphs,
                device=self.info.device,
                dtype=self.info.dtype,
                kv_blocks_total=self.info.kv_blocks_total,
            ),
            passes=self.passes,
            per_kind_first_sight={
                k: summarise([r for r in self.first_sight if r.kind == k], None)
                for k in ALL_KINDS
                if any(r.kind == k for r in self.first_sight)
            },
        )


async def run_server(server, plans: list[PassPlan], args) -> dict:
    """Run every pass on one server; the configuration's JSON record."""
    async with ServerRun(server, args) as run:
        for seq, plan in enumerate(plans):
            await run.run(plan, seq)
        return run.record()


def run_config(name: str, plans: list[PassPlan], args) -> dict:
    with running_config(name, args) as server:
        log(f"{name}: target {server.address} ready in {server.startup_s:.1f}s")
        return asyncio.run(run_server(server, plans, args))


def run_interleaved(names: list[str], plans: list[PassPlan], args) -> list[dict]:
    """--interleave: every configuration's server up at once, and each pass run on every
    server in turn before the next pass (the servers' order reversed every other pass), so
    that the machine's drift over a run hits every configuration alike."""
    with contextlib.ExitStack() as stack:
        servers = []
        for name in names:
            server = stack.enter_context(running_config(name, args))
            log(f"{name}: target {server.address} ready in {server.startup_s:.1f}s")
            servers.append(server)
        return asyncio.run(_interleaved(servers, plans, args))


async def _interleaved(servers, plans: list[PassPlan], args) -> list[dict]:
    async with contextlib.AsyncExitStack() as stack:
        runs = [await stack.enter_async_context(ServerRun(s, args)) for s in servers]
        seq = 0
        for i, plan in enumerate(plans):
            for run in runs if i % 2 == 0 else runs[::-1]:
                await run.run(plan, seq)
                seq += 1
        return [run.record() for run in runs]


def environment(args: argparse.Namespace) -> dict:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    gpu = None
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception as exc:  # no torch or no driver: the JSON says why
        gpu = f"unavailable: {exc!r}"
    return dict(
        command=shlex.join([sys.executable, *sys.argv]),
        git_commit=git("rev-parse", "HEAD"),
        git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        gpu=gpu,
        python=sys.version.split()[0],
        platform=platform.platform(),
        grpc=grpc.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S %z"),
    )


def round_order(configs: list[str], rnd: int, fixed: bool = False) -> list[str]:
    """The configurations' order in round `rnd` (0-based): odd rounds reversed unless
    `fixed` (--fixed-order)."""
    return configs if fixed or rnd % 2 == 0 else configs[::-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_flags(ap)
    ap.add_argument("--configs", default="none,ngram,remote-ngram", help=", ".join(CONFIGS))
    ap.add_argument("--concurrency", default="1,8,32,64", help="requests in flight, per pass")
    ap.add_argument(
        "--prompts-per-pass",
        type=int,
        default=None,
        help="default max(--pass-factor * c, --min-prompts)",
    )
    ap.add_argument("--min-prompts", type=int, default=16, help="least prompts per timed pass")
    ap.add_argument(
        "--pass-factor",
        type=int,
        default=2,
        help="prompts per pass = this many times c (longer passes: less ramp-up and drain)",
    )
    ap.add_argument("--warmup-prompts", type=int, default=16, help="reserved, never timed")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    ap.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send prompts as chat messages (default) or raw text (--no-chat)",
    )
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"prompt kinds to mix, or 'all' ({','.join(ALL_KINDS)}: twice the unique prompts)",
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt pool order")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every configuration (fresh servers each); >1 adds mean ratios and ranges",
    )
    ap.add_argument(
        "--fixed-order",
        action="store_true",
        help="run the configurations in the same order every round (default: every other "
        "round reversed, so a position in the order favours no configuration)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="load-generator processes per pass (one client process caps what it can receive)",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="on each server, pairs of passes with speculation on and off per request "
        "(speculation.disable), back to back on halves of one fresh batch: ratio on / off",
    )
    ap.add_argument("--pairs", type=int, default=2, help="--paired: pairs per concurrency")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="start every configuration's server at once and run each pass on each in turn "
        "(the order reversed every other pass), so drift over the run hits all alike; every "
        "server holds its model and KV pool meanwhile",
    )
    ap.add_argument("--json", default=None, metavar="PATH", help="write everything here")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not levels or min(levels) < 1:
        ap.error(f"bad --configs {unknown} or --concurrency {levels}")
    if min(args.pass_factor, args.repeat, args.client_procs, args.pairs) < 1:
        ap.error("--pass-factor, --repeat, --client-procs and --pairs must be at least 1")

    env = environment(args)
    kinds = ALL_KINDS if args.kinds == "all" else tuple(k for k in args.kinds.split(",") if k)
    pool, source = build_pool(args.chat, kinds, args.seed)
    sizes = (args.prompts_per_pass, args.warmup_prompts, args.min_prompts, args.pass_factor)
    if args.paired:  # the order of each pair's passes changes round to round
        rounds = [plan_paired(pool, levels, *sizes, args.pairs, r) for r in range(args.repeat)]
    else:
        rounds = [plan_passes(pool, levels, *sizes)] * args.repeat
    plans = rounds[0]
    log(
        f"{len(pool)} unique {source} prompts; passes: "
        + ", ".join(f"{p.name} ({len(p.prompts)} at c={p.concurrency})" for p in plans)
    )
    report = dict(
        env=env,
        args=vars(args),
        prompt_source=source,
        pool_size=len(pool),
        plan=[
            dict(name=p.name, concurrency=p.concurrency, prompts=[q.id for q in p.prompts])
            for p in plans
        ],
        **({"plan_order_by_round": [[p.name for p in r] for r in rounds]} if args.paired else {}),
        results=[],
        failures=[],
    )
    # --repeat: every configuration once per round, rounds one after the other, so slow drift
    # of the machine hits every configuration alike; every other round in reverse order (on the
    # H200 in round 11 the same code gave ngram 1.09x none at c=64 run before none and 1.02x
    # run after it: bench/RESULTS.md, runs C and D)
    # --interleave: a round's configurations run side by side, pass by pass (run_interleaved).
    if args.interleave:
        order = [(r, round_order(configs, r, args.fixed_order)) for r in range(args.repeat)]
    else:
        order = [
            (r, [n]) for r in range(args.repeat) for n in round_order(configs, r, args.fixed_order)
        ]
    for rnd, names in order:
        try:
            if args.interleave:
                recs = run_interleaved(names, rounds[rnd], args)
            else:
                recs = [run_config(names[0], rounds[rnd], args)]
            for rec in recs:
                rec["round"] = rnd
                report["results"].append(rec)
                print("\n" + config_markdown(rec), flush=True)
        except Exception as exc:  # record it, go on with the next configuration (or round)
            log(f"{','.join(names)} FAILED: {exc}")
            report["failures"].append(
                dict(config=",".join(names), round=rnd, error=traceback.format_exc())
            )
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if report["results"]:
        first_round = [r for r in report["results"] if r["round"] == 0]
        summary = summary_markdown(first_round or report["results"])
        if args.paired:  # rounds run their pairs in other orders: compare passes by name
            summary += "\n" + paired_markdown(report["results"])
        elif args.repeat > 1:
            summary += "\n" + repeat_markdown(report["results"])
        report["summary_markdown"] = summary
        print("\n## Side by side\n\n" + summary, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
