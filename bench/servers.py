"""Real specwire services for the serving benchmarks: one fresh target (and drafter) per run.

`add_target_flags` puts the target flags on a benchmark's CLI; `running_config(name, args)`
starts `python -m specwire.common.cli target ...` (plus `python -m specwire.common.cli drafter ...`
for a remote
drafter configuration) with those flags, waits for the "listening" line and health SERVING,
yields a `Server`, and stops everything on the way out. `scrape_metrics` reads the target's
Prometheus endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from policy_stats import labelled_samples  # noqa: E402
from procs import free_port, output_tail, start_service, stop_service  # noqa: E402

from specwire.drafter_service.config import DrafterServiceConfig  # noqa: E402
from specwire.target_service.config import AUTO_DRAFT_LEN, AUTO_DRAFT_LEN_GPU  # noqa: E402
from specwire.target_service.drafters.remote import LOOKAHEAD_STEPS  # noqa: E402
from specwire.target_service.drafters.remote_relay import SPIN_ENV  # noqa: E402

# Configuration name -> the target's --drafter value ("remote" = a drafter service started here).
# configuration -> drafter; a "-sync" configuration runs the same with --no-overlap (every
# step synchronous), to measure overlapped steps side by side; "-unary" talks to its drafter
# service with unary calls (--drafter-mode unary) instead of the stream; "-2b" runs
# speculative steps as two alternating halves from TWO_BATCH_ROWS requests on
# (--two-batch-rows); "-p0" never waits for drafts asked for as the previous step committed
# (--drafter-patience-ms 0: a late reply serves the steps after), "-pwait" always waits for
# them up to the deadline (--drafter-patience-ms = the 50 ms deadline); "-proc" runs the engine in a
# process of its own (--engine-process on: the default on CUDA), "-inproc" in the target's
# (--engine-process off); "-nobranch" asks the drafter
# for no branches (--drafter-branches 0), "-la1" for a look-ahead of K+1 (round 23's auto),
# "-atcommit" for questions always sent at the commit (--drafter-ask-at commit), "-timed" for
# questions held for the launch on the timing rule only (--drafter-ask-at timed), "-atlaunch"
# for every question held for the launch (--drafter-ask-at launch), "-inflight1"
# for one question at a time on the stream (--drafter-max-inflight 1; round 27 made 2 the
# default; "-inflight2" names it explicitly), "-relay" for the stream held by a relay process
# (--drafter-mode relay), "-gain" for auto patience that waits as long as the drafts pay for
# the wait (--drafter-wait-rule gain), "-spin" for a relay whose two ends poll the pipe
# instead of sleeping on it ($SPECWIRE_RELAY_SPIN_MS=20), "-socket" for the drafter service's
# unix socket (its --socket, the target's --drafter-mode socket; the target's polling is its
# default, auto: on a GPU), "-socket-nospin" for that with no polling at either end
# (--drafter-spin-ms 0), "-socket-dspin" for the drafter's event loop alone polling 20 ms after
# each event (its --spin-ms 20) and "-socket-spin" for both ends polling 20 ms
# (--spin-ms 20, --drafter-spin-ms 20), "-socket-brreply" for the socket with the branches in
# the drafts' reply (--drafter-branches-at reply; before round 37 the only way) and
# "-socket-atlaunch" for the socket with every question held for the launch (round 38's
# proxy: +5 % at one stream, +10 % at 8; round 39's H100: level) and "-socket-nobranch" for the
# socket asking for no branches (round 42), "-pipe" for a remote drafter in pipelined drafting
# steps (--pipeline-drafts: drafts on the hypothesis that the step in flight follows the
# proposal; "-pipe-p0": never waiting for a reply; "-pipe-always": every drafting step pipelined,
# where "-pipe" alone lets each load run the faster of pipelined and synchronous drafting steps,
# --pipeline-choice measured, the remote drafter's auto since round 57), to measure them side by
# side.
CONFIGS = {
    "none": "none",
    "none-sync": "none",
    "ngram": "ngram",
    "ngram-sync": "ngram",
    # On CUDA "ngram" is "ngram-pipe" since round 53 (the defaults' auto): "ngram-host" is the
    # host's lookup (--no-draft-on-device), the default before.
    "ngram-host": "ngram",
    "ngram-device": "ngram",  # --draft-on-device --no-pipeline-drafts: the lookup inside the step
    "ngram-pipe": "ngram",  # --draft-on-device --pipeline-drafts: drafting steps overlap too
    "ngram-2b": "ngram",
    "remote-ngram": "remote",
    "remote-ngram-unary": "remote",
    "remote-ngram-2b": "remote",
    "remote-ngram-p0": "remote",
    "remote-ngram-unary-p0": "remote",
    "remote-ngram-pwait": "remote",
    "remote-ngram-nobranch": "remote",
    "remote-ngram-la1": "remote",
    "remote-ngram-atcommit": "remote",
    "remote-ngram-timed": "remote",
    "remote-ngram-atlaunch": "remote",
    "remote-ngram-inflight2": "remote",
    "remote-ngram-inflight1": "remote",
    "remote-ngram-relay": "remote",
    "remote-ngram-relay-nobranch": "remote",
    "remote-ngram-gain": "remote",
    "remote-ngram-relay-gain": "remote",
    "remote-ngram-relay-gain-spin": "remote",
    "remote-ngram-socket": "remote",
    "remote-ngram-socket-gain": "remote",
    "remote-ngram-socket-dspin": "remote",
    "remote-ngram-socket-spin": "remote",
    "remote-ngram-socket-nospin": "remote",
    "remote-ngram-socket-brreply": "remote",
    "remote-ngram-socket-atlaunch": "remote",
    "remote-ngram-socket-nobranch": "remote",
    "remote-ngram-socket-pipe": "remote",
    "remote-ngram-socket-pipe-p0": "remote",
    "remote-ngram-socket-pipe-always": "remote",
    "remote-ngram-pipe": "remote",
    "none-proc": "none",
    "ngram-proc": "ngram",
    "remote-ngram-proc": "remote",
    "none-inproc": "none",
    "ngram-inproc": "ngram",
    "remote-ngram-inproc": "remote",
    "none-exact": "none",
    "ngram-exact": "ngram",
    "remote-ngram-exact": "remote",
    "none-noexact": "none",
    "ngram-noexact": "ngram",
}
REMOTE_DRAFTERS = {  # service --drafter
    "remote-ngram": "ngram",
    "remote-ngram-unary": "ngram",
    "remote-ngram-2b": "ngram",
    "remote-ngram-p0": "ngram",
    "remote-ngram-unary-p0": "ngram",
    "remote-ngram-pwait": "ngram",
    "remote-ngram-nobranch": "ngram",
    "remote-ngram-la1": "ngram",
    "remote-ngram-atcommit": "ngram",
    "remote-ngram-timed": "ngram",
    "remote-ngram-atlaunch": "ngram",
    "remote-ngram-inflight2": "ngram",
    "remote-ngram-inflight1": "ngram",
    "remote-ngram-relay": "ngram",
    "remote-ngram-relay-nobranch": "ngram",
    "remote-ngram-gain": "ngram",
    "remote-ngram-relay-gain": "ngram",
    "remote-ngram-relay-gain-spin": "ngram",
    "remote-ngram-socket": "ngram",
    "remote-ngram-socket-gain": "ngram",
    "remote-ngram-socket-dspin": "ngram",
    "remote-ngram-socket-spin": "ngram",
    "remote-ngram-socket-nospin": "ngram",
    "remote-ngram-socket-brreply": "ngram",
    "remote-ngram-socket-atlaunch": "ngram",
    "remote-ngram-socket-nobranch": "ngram",
    "remote-ngram-socket-pipe": "ngram",
    "remote-ngram-socket-pipe-p0": "ngram",
    "remote-ngram-socket-pipe-always": "ngram",
    "remote-ngram-pipe": "ngram",
    "remote-ngram-proc": "ngram",
    "remote-ngram-inproc": "ngram",
    "remote-ngram-exact": "ngram",
}
TWO_BATCH_ROWS = 32  # where the simulated device broke even (bench/RESULTS.md, round 8)
TARGET_READY = r"specwire target listening on (\S+):(\d+)"
DRAFTER_READY = r"specwire drafter listening on (\S+):(\d+)"


@dataclass
class Server:
    """A running target (and its drafter service, if any)."""

    config: str
    address: str  # host:port of specwire.v1.GenerationService
    pid: int  # the target process (its RSS is the target's)
    metrics_url: str | None  # http://127.0.0.1:P/metrics when --metrics
    commands: list[list[str]] = field(default_factory=list)
    startup_s: float = 0.0


def add_target_flags(ap: argparse.ArgumentParser) -> None:
    """Flags passed through to every `specwire target` the benchmark starts."""
    g = ap.add_argument_group("target service (passed through to `specwire target`)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, help="default: the target's (fp32 CPU, bf16 GPU)")
    g.add_argument("--max-batch-size", type=int, default=None)
    g.add_argument("--max-num-tokens", type=int, default=None)
    g.add_argument(
        "--max-draft-len",
        type=int,
        default=-1,
        help="K (-1: the target's auto, 8 on a GPU, 4 on the CPU); the drafter service gets room"
        " for it and its look-ahead",
    )
    g.add_argument(
        "--target-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the target, repeatable: --target-arg=--no-cuda-graphs",
    )
    g.add_argument(
        "--metrics", action="store_true", help="start the target with --metrics-port and scrape it"
    )
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to load + warm up")
    g.add_argument(
        "--drafter-delay-ms",
        type=float,
        default=0.0,
        help="remote configs: the drafter service's --delay-ms (an injected round trip)",
    )


def _env() -> dict[str, str | None]:
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def target_command(args: argparse.Namespace, drafter: str, metrics_port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "specwire.common.cli",
        "target",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    cmd += ["--model", args.model, "--device", args.device, "--drafter", drafter]
    cmd += ["--max-draft-len", str(args.max_draft_len), "--no-progress"]
    for flag, value in (
        ("--dtype", args.dtype),
        ("--max-batch-size", args.max_batch_size),
        ("--max-num-tokens", args.max_num_tokens),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    return cmd + list(args.target_arg)


def wait_serving(address: str, timeout: float) -> None:
    """Block until the target's health check says SERVING (the engine is loaded and warm)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(
                    health_pb2.HealthCheckRequest(service="specwire.v1.GenerationService"),
                    timeout=5,
                ).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
            time.sleep(0.2)


@contextlib.contextmanager
def running_config(config: str, args: argparse.Namespace) -> Iterator[Server]:
    """Start a fresh target for `config` (see CONFIGS); stop it (and its drafter) afterwards."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")
    t0 = time.perf_counter()
    procs = []
    commands: list[list[str]] = []
    try:
        drafter = CONFIGS[config]
        if drafter == "remote":
            dcmd = [sys.executable, "-m", "specwire.common.cli", "drafter", "--host", "127.0.0.1"]
            dcmd += ["--port", "0", "--drafter", REMOTE_DRAFTERS[config]]
            # Room for the target's auto look-ahead: K drafts + LOOKAHEAD_STEPS (K+1) more.
            k = draft_len(args)
            room = k + LOOKAHEAD_STEPS * (k + 1)
            dcmd += ["--max-draft-len", str(max(DrafterServiceConfig().max_draft_len, room))]
            if args.drafter_delay_ms:  # a round trip longer than a step, on any machine
                dcmd += ["--delay-ms", str(args.drafter_delay_ms)]
            if "-socket" in config:
                sock = f"{tempfile.mkdtemp(prefix='specwire-')}/drafter.sock"
                dcmd += ["--socket", sock]
            if config.endswith("spin") and "-socket" in config:  # the drafter's loop polls
                dcmd += ["--spin-ms", "20"]
            dproc, m = start_service(dcmd, _env(), DRAFTER_READY, timeout=120, cwd=ROOT)
            procs.append(dproc)
            commands.append(dcmd)
            drafter = f"grpc://127.0.0.1:{m.group(2)}"
        metrics_port = free_port() if args.metrics else 0
        cmd = target_command(args, drafter, metrics_port)
        if config.endswith("-sync"):
            cmd.append("--no-overlap")
        if config in ("ngram-device", "ngram-pipe"):
            cmd.append("--draft-on-device")
        if config == "ngram-device":
            cmd.append("--no-pipeline-drafts")
        if config == "ngram-host":
            cmd.append("--no-draft-on-device")
        if config == "ngram-pipe" or "-pipe" in config and config.startswith("remote"):
            cmd.append("--pipeline-drafts")
        if "-unary" in config:
            cmd += ["--drafter-mode", "unary"]
        if "-relay" in config:
            cmd += ["--drafter-mode", "relay"]
        if "-socket" in config:
            cmd += ["--drafter-mode", "socket", "--drafter-socket", sock]
        if config.endswith("-socket-spin"):  # the waiting step polls the socket too
            cmd += ["--drafter-spin-ms", "20"]
        if config.endswith(("-socket-dspin", "-socket-nospin")):  # (auto polls on a GPU)
            cmd += ["--drafter-spin-ms", "0"]
        if "-gain" in config:
            cmd += ["--drafter-wait-rule", "gain"]
        if config.endswith("-pipe-always"):
            cmd += ["--pipeline-choice", "always"]
        if config.endswith("-p0"):
            cmd += ["--drafter-patience-ms", "0"]
        if config.endswith("-pwait"):
            cmd += ["--drafter-patience-ms", "50", "--drafter-deadline-ms", "50"]
        if config.endswith("-2b"):
            cmd += ["--two-batch-rows", str(TWO_BATCH_ROWS)]
        if config.endswith("-nobranch"):
            cmd += ["--drafter-branches", "0"]
        if config.endswith("-brreply"):
            cmd += ["--drafter-branches-at", "reply"]
        if config.endswith("-atcommit"):  # questions at the commit, never held for the launch
            cmd += ["--drafter-ask-at", "commit"]
        if config.endswith("-timed"):  # held for the launch on the timing rule only
            cmd += ["--drafter-ask-at", "timed"]
        if config.endswith("-atlaunch"):  # every question held for the launch
            cmd += ["--drafter-ask-at", "launch"]
        if config.endswith("-inflight2"):  # a second question while the first is unanswered
            cmd += ["--drafter-max-inflight", "2"]
        if config.endswith("-inflight1"):  # one question at a time (before round 27)
            cmd += ["--drafter-max-inflight", "1"]
        if config.endswith("-la1"):  # round 23's auto look-ahead: one step's worth (K+1)
            cmd += ["--drafter-lookahead", str(draft_len(args) + 1)]
        if config.endswith("-proc"):
            cmd += ["--engine-process", "on"]
        if config.endswith("-inproc"):
            cmd += ["--engine-process", "off"]
        if config.endswith("-exact"):
            cmd += ["--exact", "on"]  # batch-invariant kernels (GPU): what they cost served
        if config.endswith("-noexact"):
            cmd += ["--exact", "off"]  # (the default, auto, is on for SmolLM2 in bf16)
        env = _env()
        if "-relay" in config and "-spin" in config:  # the relay and a waiting step poll
            env[SPIN_ENV] = "20"
        proc, m = start_service(cmd, env, TARGET_READY, timeout=args.ready_timeout, cwd=ROOT)
        procs.append(proc)
        commands.append(cmd)
        address = f"127.0.0.1:{m.group(2)}"
        wait_serving(address, timeout=60)
        yield Server(
            config=config,
            address=address,
            pid=proc.pid,
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None,
            commands=commands,
            startup_s=time.perf_counter() - t0,
        )
    except Exception as exc:
        tails = "\n".join(f"--- {p.args[3]} output ---\n{output_tail(p)}" for p in procs)
        raise RuntimeError(f"{config}: {exc}\n{tails}") from exc
    finally:
        for p in reversed(procs):  # target first: it holds the drafter connection
            stop_service(p)


def scrape_metrics(url: str | None) -> dict[str, float]:
    """{sample name: value} at `url`, labelled samples summed (meant for counters), and the
    draft-length policy's also under their labels (`policy_stats`); {} if off."""
    if not url:
        return {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            labelled_samples(sample.name, sample.labels, sample.value, out)
    return out


def draft_len(args) -> int:
    """The K the target runs with: `--max-draft-len`, or the target's auto for the device (a
    `--target-arg` that turns graphs or the adaptive policy off is not seen here)."""
    if args.max_draft_len >= 0:
        return args.max_draft_len
    gpu = args.device.startswith("cuda")
    return AUTO_DRAFT_LEN_GPU if gpu else AUTO_DRAFT_LEN
