"""How long `specwire target` takes to listen: a fresh process per start, from spawn to its
"listening" line, with the engine's own phases (its `engine ready in ...` log line).

    python bench/startup.py --model smollm2-135m --device cpu --runs 3
    python bench/startup.py --trees .,/tmp/old --runs 3     # two checkouts, alternated

With several `--trees` (checkouts of this repository), the starts alternate between them run by
run, so that the machine's drift falls on each alike, and the table gives each tree's median
against the first's. Extra target flags go after `--`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from procs import output_tail, start_service, stop_service  # noqa: E402

READY = r"specwire target listening on (\S+):(\d+)"
PHASES = re.compile(r"engine ready in ([\d.]+) s \(([^)]*)\)")


def start_once(tree: Path, args: argparse.Namespace) -> tuple[float, str]:
    """Seconds from spawn to listening, and the engine's phase list."""
    cmd = [sys.executable, "-m", "specwire.common.cli", "--log-level", "INFO", "target"]
    cmd += ["--model", args.model, "--device", args.device, "--port", "0", *args.extra]
    env = {"PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc, _ = start_service(cmd, env, READY, timeout=args.timeout, cwd=tree)
    seconds = time.perf_counter() - t0
    try:
        found = PHASES.search(output_tail(proc))
        return seconds, found.group(2) if found else "n/a"
    finally:
        stop_service(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to start from")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("extra", nargs="*", help="target flags (after --)")
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    times: dict[Path, list[float]] = {t: [] for t in trees}
    for run in range(args.runs):
        for tree in trees if run % 2 == 0 else trees[::-1]:
            seconds, phases = start_once(tree, args)
            times[tree].append(seconds)
            print(
                f"run {run} {tree}: listening after {seconds:.2f} s; engine: {phases}", flush=True
            )
    first = statistics.median(times[trees[0]])
    print("\n| tree | starts | median s | min s | median ÷ first tree's |\n|---|---|---|---|---|")
    for tree, values in times.items():
        median = statistics.median(values)
        print(
            f"| {tree} | {len(values)} | {median:.2f} | {min(values):.2f} | {median / first:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
