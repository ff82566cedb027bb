"""A profile of one of the engine's threads, from that thread's start (`bench/host_only.py` and
`bench/engine_only.py --profile executor|output`). Wall time: a function's share includes
its waits for the GIL (and, for a C call, the wait inside it: a CUDA sync, a full launch
queue).

Two modes (`--profile-mode`):
- `cprofile` (the default): deterministic, with call counts. Per thread only before Python
  3.12: from 3.12 on cProfile hooks `sys.monitoring`, whose events come from every thread, so
  the table also holds the output thread's, the pipe's and the benchmark clients' functions
  (it says so when printed). Most functions run in one thread only, so they can still be told
  apart by name.
- `sample`: the thread's Python stack read every `--profile-interval-ms` by a thread of its
  own (`sys._current_frames`), one thread only on any Python, and far lighter than cProfile.
  **Biased**: the sampler needs the GIL to take a sample, and a thread running Python hands
  the GIL over only at the switch interval or when it calls something that releases it. So
  samples pile up in calls that release the GIL (waits, syncs, sleeps, I/O) and stretches of
  pure Python are under-counted (a thread alternating 4 ms of Python with 4 ms of sleep read
  0 % busy at the default switch interval, 23-34 % at 0.02-0.2 ms). Read it for where a
  thread blocks, not for its Python hot spots.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading
import time
from collections import Counter

THREADS = {"executor": "specwire-executor", "output": "specwire-output"}
MODES = ("cprofile", "sample")
# cProfile sees every thread's calls from Python 3.12 on (it is built on sys.monitoring).
CPROFILE_PER_THREAD = sys.version_info < (3, 12)


def add_profile_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", choices=tuple(THREADS), default=None)
    ap.add_argument("--profile-rows", type=int, default=30, help="functions --profile prints")
    ap.add_argument(
        "--profile-sort", choices=("tottime", "cumulative"), default="tottime",
        help="--profile's order: own time, or with what the function calls",
    )  # fmt: skip
    ap.add_argument(
        "--profile-mode", choices=MODES, default="cprofile",
        help="cprofile (on Python >= 3.12 it counts every thread's calls) or sample "
        "(one thread, but biased toward calls that release the GIL: thread_profile.py)",
    )  # fmt: skip
    ap.add_argument(
        "--profile-interval-ms", type=float, default=1.0, help="sample mode: ms between samples"
    )


class StackSampler:
    """Samples the Python stacks of the threads that enabled it, every `interval_s`.
    `enable()` and `disable()` are called from the thread to sample, as cProfile's are (a
    thread of the name started again, as a new engine's, is sampled from its own start); the
    sampling runs in a daemon thread of its own. Per function (file, first line, name):
    `own`, samples with it at the top of the stack; `inclusive`, samples with it anywhere on
    the stack (once a sample, recursion or not)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.own: Counter[tuple[str, int, str]] = Counter()
        self.inclusive: Counter[tuple[str, int, str]] = Counter()
        self.samples = 0
        self.seconds = 0.0  # time with a thread to sample
        self._idents: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enable(self) -> None:
        with self._lock:
            self._idents.add(threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="profile-sampler", daemon=True
                )
                self._thread.start()

    def disable(self) -> None:
        with self._lock:
            self._idents.discard(threading.get_ident())

    def stop(self) -> None:
        """End the sampling (for good); the counts stay."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        own, inclusive = self.own, self.inclusive
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            with self._lock:
                idents = tuple(self._idents)
            if idents:
                self.seconds += now - last
            last = now
            frames = sys._current_frames()
            for ident in idents:
                frame = frames.get(ident)
                if frame is None:
                    continue
                self.samples += 1
                code = frame.f_code
                own[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    key = (code.co_filename, code.co_firstlineno, code.co_name)
                    if key not in seen:
                        seen.add(key)
                        inclusive[key] += 1
                    frame = frame.f_back

    def print_stats(self, sort: str, rows: int) -> None:
        self.stop()
        n = max(1, self.samples)
        print(
            f"sampled {self.samples} stacks, one every {self.interval_s * 1e3:g} ms, "
            f"over {self.seconds:.3f} s (shares of the samples, biased toward calls that "
            "release the GIL: see bench/thread_profile.py)"
        )
        primary = self.own if sort == "tottime" else self.inclusive
        print(f"{'own %':>7} {'incl %':>7}  function")
        for key, _count in primary.most_common(rows):
            filename, line, name = key
            where = os.path.relpath(filename) if filename.startswith(os.getcwd()) else filename
            print(
                f"{100 * self.own[key] / n:7.2f} {100 * self.inclusive[key] / n:7.2f}  "
                f"{where}:{line}({name})"
            )


def profile_thread(
    engine, which: str | None, mode: str = "cprofile", interval_ms: float = 1.0
) -> cProfile.Profile | StackSampler | None:
    """Profile `engine`'s thread `which` (None: nothing). Call before `executor.start()`: the
    executor thread is profiled from its start; the output thread, already running, is
    replaced by one started under the profiler. Returns the profiler (a `cProfile.Profile`
    or a `StackSampler`), for `print_profile`."""
    if which is None:
        return None
    if mode == "sample":
        profiler = StackSampler(interval_ms / 1000)
    else:
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


def print_profile(
    profiler: cProfile.Profile | StackSampler | None, args: argparse.Namespace
) -> None:
    if profiler is None:
        return
    print(f"profile of the {args.profile} thread ({type(profiler).__name__})")
    if isinstance(profiler, StackSampler):
        profiler.print_stats(args.profile_sort, args.profile_rows)
    else:
        if not CPROFILE_PER_THREAD:
            print(
                f"note: cProfile on Python {sys.version_info.major}.{sys.version_info.minor} "
                "counts every thread's calls, not only this thread's (--profile-mode sample "
                "for one thread, with its bias)"
            )
        pstats.Stats(profiler).sort_stats(args.profile_sort).print_stats(args.profile_rows)
