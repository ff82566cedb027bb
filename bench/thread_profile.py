"""cProfile of one of the engine's threads, from that thread's start (`bench/host_only.py` and
`bench/engine_only.py --profile executor|output`). Wall time: a function's share includes
its waits for the GIL."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import threading

THREADS = {"executor": "specwire-executor", "output": "specwire-output"}


def add_profile_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", choices=tuple(THREADS), default=None)
    ap.add_argument("--profile-rows", type=int, default=30, help="functions --profile prints")
    ap.add_argument(
        "--profile-sort", choices=("tottime", "cumulative"), default="tottime",
        help="--profile's order: own time, or with what the function calls",
    )  # fmt: skip


def profile_thread(engine, which: str | None) -> cProfile.Profile | None:
    """Profile `engine`'s thread `which` (None: nothing). Call before `executor.start()`: the
    executor thread is profiled from its start; the output thread, already running, is
    replaced by one started under the profiler."""
    if which is None:
        return None
    profiler = cProfile.Profile()
    name = THREADS[which]
    real_start = threading.Thread.start

    def start(thread):
        if thread.name == name:
            run = thread.run

            def profiled():
                profiler.enable()
                try:
                    run()
                finally:
                    profiler.disable()

            thread.run = profiled
        real_start(thread)

    threading.Thread.start = start
    if which == "output":
        from specwire.target_service.output import OutputWorker

        engine.executor.output.close()
        engine.executor.output = OutputWorker(engine.executor._stopped)
    return profiler


def print_profile(profiler: cProfile.Profile | None, args: argparse.Namespace) -> None:
    if profiler is not None:
        pstats.Stats(profiler).sort_stats(args.profile_sort).print_stats(args.profile_rows)
