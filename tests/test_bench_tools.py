"""The host-only benchmark tools run end to end (figures are not checked: timings live in
bench/RESULTS.md, never in tests). Real subprocesses, the real engine on tiny-random."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_host_only_runs_speculation_in_two_batches_on_a_simulated_device():
    out = _run(
        "bench/host_only.py",
        "--concurrency",
        "4",
        "--pass-factor",
        "1",
        "--min-prompts",
        "4",
        "--max-new-tokens",
        "16",
        "--drafter",
        "ngram",
        "--two-batch-rows",
        "2",
        "--device-ms",
        "0.2",
    )
    passes = re.findall(
        r"host-only ngram two-batch>=2 (\S+): (\d+) tokens .* errors (\d+); .*"
        r"over (\d+) steps \((\d+) two-batch\)",
        out,
    )
    assert [p[0] for p in passes] == ["warm-up", "c=4", "replay"], out
    for _name, tokens, errors, steps, halves in passes:
        assert int(tokens) > 0 and errors == "0" and int(halves) > 0 and int(steps) > 0


def test_drafter_cost_times_the_ngram_pool_and_a_service_message():
    out = _run("bench/drafter_cost.py", "--messages", "10", "--sequences", "4")
    assert len(re.findall(r"ngram propose\(9\), .*: this \d+\.\d+ us", out)) == 3, out
    assert re.search(r"drafter service, 4-sequence message: .* us per sequence", out), out
