"""The host-only benchmark tools run end to end (figures are not checked: timings live in
bench/RESULTS.md, never in tests). Real subprocesses, the real engine on tiny-random."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
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
    # Every pass times the device's idle gaps before its decode steps, the drafted ones apart.
    idle = re.findall(r"device idle before a decode step: drafted (\d+) us \(x(\d+)\)", out)
    assert len(idle) == 3 and all(int(n) > 0 for _us, n in idle), out


def test_drafter_cost_times_the_ngram_pool_and_a_service_message():
    out = _run("bench/drafter_cost.py", "--messages", "10", "--sequences", "4")
    assert len(re.findall(r"ngram propose\(9\), .*: this \d+\.\d+ us", out)) == 3, out
    assert re.search(r"drafter service, 4-sequence message: .* us per sequence", out), out


def test_policy_cost_times_the_decision_with_and_without_presum():
    out = _run("bench/policy_cost.py", "--rows", "1,8", "--steps", "50")
    rows = re.findall(
        r"^\| (\d+) \| (\d+\.\d) \| (\d+\.\d) \| \[([\d, ]+)\] \| \[([\d, ]+)\] \|$", out, re.M
    )
    assert [r[0] for r in rows] == ["1", "8"], out
    for _rows, _cold, _warm, hist, hist_pre in rows:  # every step decided, k = 0..8
        assert sum(map(int, hist.split(","))) == sum(map(int, hist_pre.split(","))) == 50


def test_pipeline_choice_sim_runs_the_engines_choice_and_mostly_picks_the_better_variant():
    """With little noise the choice runs the better variant on most windows at each of the
    three loads (pipelined at 1 and 8 streams, synchronous at 32, as round 56's rates say)."""
    out = _run(
        "bench/pipeline_choice_sim.py", "--windows", "60", "--seeds", "20", "--noise", "0.05"
    )
    rows = re.findall(
        r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| 0\.05 \| ([\d.]+) .*\| (\d+)% \|", out, re.M
    )
    assert [r[0] for r in rows] == ["1", "8", "32"], out
    for _streams, ratio, share in rows:
        assert float(ratio) > 0.95 and int(share) > 75, out


def test_branch_replay_cost_and_index_comparison_run_on_tiny_random(tmp_path):
    outputs = tmp_path / "greedy.json"
    out = _run(
        "bench/branch_replay.py", "--model", "tiny-random", "--per-kind", "1",
        "--max-new-tokens", "24", "--save-outputs", str(outputs),
    )  # fmt: skip
    rows = re.findall(r"^\| (\w+) \| (inproc|wait|remote|branch) \| (\d+) \| (\d+) \|", out, re.M)
    assert len(rows) == 5 * 4, out  # all + 4 kinds, 4 drafters each
    steps = {(kind, drafter): (int(n), int(d)) for kind, drafter, n, d in rows}
    for (kind, drafter), (n, drafted) in steps.items():
        assert drafted <= n, (kind, drafter)
        # Waiting for the drafter drafts exactly what drafting in process does.
        assert (n, drafted) == steps[(kind, "inproc")] or drafter in ("remote", "branch")
    out = _run("bench/branch_cost.py", "--outputs", str(outputs), "--rows", "1,2", "--iters", "3")
    assert len(re.findall(r"^\| \d+ \| \d+\.\d× \|", out, re.M)) == 2, out
    out = _run(
        "bench/ngram_index_cost.py", "--outputs", str(outputs),
        "--other", "specwire/common/ngram.py", "--iters", "2",
    )  # fmt: skip
    assert out.count("| real") == 1 and out.count("| straddling") == 1, out


def test_branch_replay_records_every_kind_and_reads_its_outputs_gzipped(tmp_path):
    """`--kinds all` records the serving benchmark's eight prompt kinds (the replay that judges
    policy changes, bench/README.md), and `--outputs` reads them back gzipped."""
    outputs = tmp_path / "all.json"
    _run(
        "bench/branch_replay.py", "--model", "tiny-random", "--per-kind", "1", "--kinds", "all",
        "--max-new-tokens", "8", "--save-outputs", str(outputs),
    )  # fmt: skip
    sys.path.insert(0, str(ROOT / "bench"))
    from prompt_pool import ALL_KINDS

    records = json.loads(outputs.read_text())
    assert sorted(r["kind"] for r in records) == sorted(ALL_KINDS)
    packed = tmp_path / "all.json.gz"
    packed.write_bytes(gzip.compress(outputs.read_bytes()))
    out = _run("bench/branch_replay.py", "--outputs", str(packed), "--k", "4")
    rows = re.findall(r"^\| (\w+) \| (inproc|wait|remote|branch) \|", out, re.M)
    assert len(rows) == (1 + len(ALL_KINDS)) * 4, out  # all + each kind, 4 drafters each


def test_host_only_drafts_through_a_remote_drafter_service(tmp_path):
    """...with SPECWIRE_HOP_TRACE set: both sides write their hops, and bench/hop_trace.py
    joins them into round trips with all five hops."""
    trace = tmp_path / "hops"
    out = _run(
        "bench/host_only.py", "--concurrency", "2", "--pass-factor", "1", "--min-prompts", "2",
        "--max-new-tokens", "16", "--drafter", "remote-ngram", "--device-ms", "0.2",
        env={"SPECWIRE_HOP_TRACE": str(trace)},
    )  # fmt: skip
    assert re.search(r"host-only remote-ngram .* c=2: \d+ tokens .* errors 0", out), out
    assert re.search(r"drafter counters \{.*'failed': 0", out), out
    sides = sorted(p.name.split("-")[0] for p in trace.iterdir())
    assert sides == ["drafter", "target"], sides
    out = _run("bench/hop_trace.py", str(trace))
    n = int(re.match(r"(\d+) round trips", out).group(1))
    assert n > 0, out
    hops = re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$", out, re.M)
    assert len(hops) == 5, out  # every hop of the round trip, in order


def test_host_only_replays_recorded_outputs_through_the_drafters(tmp_path):
    """--replay: the stub model gives recorded greedy outputs (here tiny-random's own), and
    every completion must equal its recording (the script exits non-zero otherwise), with
    drafting in process, through a drafter service and in pipelined steps drafted by the
    stub's "device" (`--draft-on-device --pipeline-drafts`)."""
    outputs = tmp_path / "greedy.json"
    _run(
        "bench/branch_replay.py", "--model", "tiny-random", "--per-kind", "5",
        "--max-new-tokens", "24", "--save-outputs", str(outputs),
    )  # fmt: skip
    pipelined = ["--draft-on-device", "--pipeline-drafts"]
    for drafter, extra in (("ngram", []), ("remote-ngram", []), ("ngram", pipelined)):
        out = _run(
            "bench/host_only.py", "--replay", str(outputs), "--concurrency", "2",
            "--pass-factor", "1", "--min-prompts", "2", "--max-new-tokens", "24",
            "--drafter", drafter, "--device-ms", "0.2", *extra,
        )  # fmt: skip
        if extra:
            assert "device-drafts pipelined c=2" in out and "device lookups" in out, out
        passes = re.findall(
            rf"host-only {drafter} replay.* (\S+): (\d+) tokens .* errors 0; .*; "
            r"(\d+) completions equal their recordings",
            out,
        )
        assert [p[0] for p in passes] == ["warm-up", "c=2", "replay"], out
        # Every request of each pass was compared with its recording.
        assert [int(p[2]) for p in passes] == [16, 2, 2], out
        assert all(int(tokens) > 0 for _, tokens, _ in passes), out


def test_serving_paired_mode_disables_speculation_per_request(tmp_path):
    """--paired on one server: the "off" halves (`speculation.disable` on every request)
    draft nothing, by the requests' own stats and the target's drafting-step counter, while
    the "on" halves of the same server draft."""
    out = tmp_path / "paired.json"
    text = _run(
        "bench/serving.py", "--model", "tiny-random", "--configs", "ngram", "--paired",
        "--pairs", "2", "--concurrency", "2", "--prompts-per-pass", "4", "--warmup-prompts", "4",
        "--max-new-tokens", "16", "--metrics", "--json", str(out),
    )  # fmt: skip
    (server,) = json.loads(out.read_text())["results"]
    paired = [p for p in server["passes"] if p.get("pair") is not None]
    assert sorted((p["pair"], p["speculate"]) for p in paired) == [
        (0, False), (0, True), (1, False), (1, True)
    ]  # fmt: skip
    for p in paired:
        assert p["summary"]["errors"] == 0 and p["summary"]["completed"] == 4
        if not p["speculate"]:
            assert p["summary"]["drafted"] == 0 and p["draft_steps"] == 0, p["name"]
    assert "The draft-length policy per pass" in text
    assert sum(p["summary"]["drafted"] for p in paired if p["speculate"]) > 0
    assert sum(p["draft_steps"] for p in paired if p["speculate"]) > 0
    # The draft-length policy's record: the "off" halves ran no step with drafts.
    for p in paired:
        drafting = sum(v for k, v in p["policy"]["k_steps"].items() if int(k) > 0)
        assert drafting > 0 if p["speculate"] else drafting == 0, (p["name"], p["policy"])


def test_serving_reports_the_remote_drafters_ask_after_the_commit(tmp_path):
    """With --metrics, a remote drafter's passes carry what its synchronous steps spent asking
    after their commit (`specwire_drafter_ask_seconds`), and the drafting table shows it."""
    out = tmp_path / "remote.json"
    text = _run(
        "bench/serving.py", "--model", "tiny-random", "--configs", "remote-ngram",
        "--concurrency", "1", "--prompts-per-pass", "4", "--warmup-prompts", "4",
        "--max-new-tokens", "16", "--metrics", "--json", str(out),
    )  # fmt: skip
    (server,) = json.loads(out.read_text())["results"]
    timed = [p for p in server["passes"] if p["timed"]]
    assert sum(p["ask_steps"] for p in timed) > 0
    assert all(p["ask_s"] >= 0 for p in timed)
    assert "ask after the commit ms/sync step" in text


def test_serving_interleave_runs_each_pass_on_every_server_in_turn(tmp_path):
    """--interleave: both configurations' servers are up at once and each pass runs on one,
    then the other (the order reversed every other pass), so the two servers' passes
    alternate in the run's sequence; every pass completes on both."""
    out = tmp_path / "interleaved.json"
    text = _run(
        "bench/serving.py", "--model", "tiny-random", "--configs", "none,ngram", "--interleave",
        "--paired", "--pairs", "1", "--concurrency", "2", "--prompts-per-pass", "4",
        "--warmup-prompts", "4", "--max-new-tokens", "8", "--json", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["failures"] == []
    none, ngram = report["results"]
    assert (none["config"], ngram["config"]) == ("none", "ngram")
    names = [p["name"] for p in none["passes"]]
    assert names == [p["name"] for p in ngram["passes"]] and len(names) >= 3, names
    seqs = {p["seq"]: ("none", p["name"]) for p in none["passes"]}
    seqs.update({p["seq"]: ("ngram", p["name"]) for p in ngram["passes"]})
    ran = [seqs[i] for i in range(2 * len(names))]  # every place in the sequence taken once
    for i, name in enumerate(names):  # pass i on both servers, then pass i + 1
        first, second = ran[2 * i], ran[2 * i + 1]
        assert first[1] == second[1] == name, ran
        assert [first[0], second[0]] == (["none", "ngram"] if i % 2 == 0 else ["ngram", "none"])
    for server in (none, ngram):
        assert all(p["summary"]["errors"] == 0 for p in server["passes"]), server["config"]
        assert all(p["summary"]["completed"] > 0 for p in server["passes"]), server["config"]
    assert "## Side by side" in text


def test_phase_timer_writes_the_engines_phase_table(tmp_path):
    """bench/phase_timer first on PYTHONPATH with PHASES_DIR set: the process that runs the
    executor writes its table of timed phases (calls and time per executor method)."""
    _run(
        "bench/host_only.py", "--concurrency", "2", "--pass-factor", "1", "--min-prompts", "2",
        "--max-new-tokens", "8", "--drafter", "ngram",
        env={
            "PHASES_DIR": str(tmp_path),
            "PYTHONPATH": f"{ROOT / 'bench' / 'phase_timer'}:{ROOT}",
            # one more method to time, nested under the phase that calls it
            "PHASES_EXTRA": "specwire.target_service.scheduler:Scheduler.schedule",
        },
    )  # fmt: skip
    (table,) = tmp_path.glob("phases-*.txt")
    rows = {
        line.split()[0]: int(re.search(r"n=\s*(\d+)", line).group(1))
        for line in table.read_text().splitlines()
        if " n=" in line and line.startswith("specwire")
    }
    step = [n for label, n in rows.items() if label.endswith("Executor._schedule")]
    assert step and step[0] > 0, rows
    assert any("DraftIntake.prepare" in label for label in rows), rows
    # PHASES_EXTRA timed Scheduler.schedule, keyed by the executor phase that called it
    assert any(label.endswith("Scheduler.schedule@_schedule") for label in rows), rows


def test_pump_cost_times_the_remote_drafters_question_and_reply():
    out = _run(
        "bench/pump_cost.py", "--rows", "1,4", "--evict-mb", "0,1", "--iters", "20", "--prewarm"
    )
    pattern = r"^\| (\d+) \| (\d+) \| (True|False) \| (\d+\.\d) \| (\d+\.\d) \|$"
    rows = re.findall(pattern, out, re.M)
    assert [r[:3] for r in rows] == [
        (n, mb, warm) for n in ("1", "4") for mb in ("0", "1") for warm in ("False", "True")
    ], out
    assert all(float(q) > 0 and float(r) > 0 for *_, q, r in rows), out


def test_kernel_resources_counts_programs_per_sm_and_reads_the_pipeline():
    sys.path.insert(0, str(ROOT / "bench"))
    import kernel_resources as kr

    # Round 20's attention on the H200: 248 registers, 80 KB of shared memory, 4 warps: two
    # programs an SM, registers first (a third would need 3 x 248 x 128 > 65,536).
    assert kr.Resources(248, 0, 81920, 4).programs_per_sm() == (2, "regs")
    assert kr.Resources(128, 32, 45056, 4).programs_per_sm() == (4, "regs")
    assert kr.Resources(128, 0, 147456, 4).programs_per_sm() == (1, "smem")
    assert kr.Resources(16, 0, 0, 8).programs_per_sm() == (8, "warps")
    ttgir = (
        "#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4]}>\n"
        "%k = ttg.local_alloc : () -> !ttg.memdesc<1x128x128xbf16, #shared1, #smem, mutable>\n"
        "%v = ttg.local_alloc : () -> !ttg.memdesc<2x128x128xbf16, #shared, #smem, mutable>\n"
        "%c = ttg.async_copy_global_to_local %p, %k mask %m\n"
    )
    assert kr.pipeline_facts(ttgir) == {"mma": 2, "async": True, "buffers": 2}
    assert kr.pipeline_facts("") == {"mma": 0, "async": False, "buffers": 0}


def test_kernel_resources_says_what_it_needs_without_triton():
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed here: the tool compiles instead")
    proc = subprocess.run(
        [sys.executable, "bench/kernel_resources.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "needs Triton" in proc.stdout, proc.stdout + proc.stderr


def test_pipeline_replay_counts_the_steps_of_drafting_one_step_behind(tmp_path):
    """`bench/pipeline_replay.py` on two outputs: one periodic (every hypothesis of a step's
    outcome comes true once the period is in the index, so drafting one step behind takes
    almost the synchronous steps) and one that never repeats (no drafts at all: every mode
    takes a step a token)."""
    periodic = {"prompt": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5], "output": [1, 2, 3, 4, 5] * 12}
    unique = {"prompt": [100, 101], "output": list(range(200, 260))}
    path = tmp_path / "outs.json"
    path.write_text(json.dumps([periodic]))
    out = _run("bench/pipeline_replay.py", "--outputs", str(path), "--k", "4", "--branches", "0,1")
    row = r"^\| 4 \| (\S+) \| (\d+) \| [\d.]+ \| \d+% \| (\S+) \|"
    steps = {m: (int(s), t) for m, s, t in re.findall(row, out, re.M)}
    assert set(steps) == {"sync", "plain", "pipe", "pipe+b1", "device"}, out
    assert steps["plain"][0] == 60, out
    assert steps["device"][0] == steps["sync"][0], out
    assert steps["sync"][0] <= 13, out  # 5 tokens a step once drafting starts
    assert steps["pipe"][0] == steps["sync"][0], out  # its hypotheses all come true
    assert steps["pipe"][1] != "–" and steps["pipe"][1] == "100%", out
    path.write_text(json.dumps([unique]))
    out = _run("bench/pipeline_replay.py", "--outputs", str(path), "--k", "4", "--branches", "0")
    counts = re.findall(r"^\| 4 \| (\S+) \| (\d+) \|", out, re.M)
    assert dict(counts) == {"sync": "60", "plain": "60", "pipe": "60", "device": "60"}, out


def test_device_ngram_proposes_what_the_index_does_and_times_itself():
    """`bench/device_ngram.py --check` compares the batched tensor lookup with `NGramIndex` on
    random sequences and recorded outputs (exit 1 on any mismatch); `--rows` times it."""
    out = _run(
        "bench/device_ngram.py", "--check", "80", "--outputs",
        "bench/results/round38/serving80.json.gz", "--rows", "1,4", "--ctx", "64", "--iters", "2",
    )  # fmt: skip
    assert re.search(r"^\d+ sequences x 3 budgets: 0 mismatches$", out, re.M), out
    assert len(re.findall(r"^\| [14] \| 64 \| [\d.]+ \|$", out, re.M)) == 2, out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_device_ngram_kernel_proposes_what_the_index_does_through_block_tables():
    """The one-launch kernel, reading each row through a shuffled block table, proposes what
    `NGramIndex` does (on a GPU, else in Triton's interpreter)."""
    env = {} if _cuda() else {"TRITON_INTERPRET": "1"}
    args = ["--device", "cuda"] if _cuda() else []
    out = _run("bench/device_ngram.py", "--impl", "kernel", "--check", "40", *args, env=env)
    assert re.search(r"^\d+ sequences x 3 budgets: 0 mismatches$", out, re.M), out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _thread_profile():
    spec = importlib.util.spec_from_file_location(
        "thread_profile", ROOT / "bench/thread_profile.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stack_sampler_samples_only_the_threads_that_enable_it():
    """cProfile sees every thread's calls from Python 3.12 on; the sampler must not."""
    sampler = _thread_profile().StackSampler(0.001)
    stop = threading.Event()

    def sampled_work():
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            sum(range(200))

    def other_work():
        while not stop.is_set():
            sum(range(200))

    def profiled():
        sampler.enable()
        try:
            sampled_work()
        finally:
            sampler.disable()

    other = threading.Thread(target=other_work)
    other.start()
    try:
        worker = threading.Thread(target=profiled)
        worker.start()
        worker.join()
    finally:
        stop.set()
        other.join()
    sampler.stop()
    names = {name for _file, _line, name in sampler.inclusive}
    assert sampler.samples >= 5, sampler.samples  # the sampler waits its turn for the GIL
    assert "other_work" not in names, names
    work = next(k for k in sampler.inclusive if k[2] == "sampled_work")
    # On every sampled stack (but one landing in `profiled` or `enable` itself).
    assert sampler.inclusive[work] >= sampler.samples - 2
    assert sampler.own[work] > sampler.samples // 2  # mostly its own time (sum is a C call)


def test_host_only_profile_in_sample_mode_shows_the_executor_thread_alone():
    out = _run(
        "bench/host_only.py", "--concurrency", "4", "--pass-factor", "1", "--min-prompts", "4",
        "--max-new-tokens", "16", "--drafter", "ngram", "--device-ms", "0.2",
        "--profile", "executor", "--profile-mode", "sample", "--profile-rows", "1000",
        "--profile-sort", "cumulative",
    )  # fmt: skip
    assert "profile of the executor thread (StackSampler)" in out, out
    samples = int(re.search(r"sampled (\d+) stacks", out).group(1))
    assert samples > 0, out
    rows = re.findall(r"^ *([\d.]+) +([\d.]+)  (\S+)$", out, re.M)
    loop = [float(incl) for _own, incl, fn in rows if re.search(r"executor\.py:\d+\(_loop\)$", fn)]
    assert loop and loop[0] > 90, out  # the executor's loop is on (nearly) every stack
    assert not any("output.py" in fn and fn.endswith("(_run)") for _o, _i, fn in rows), out


def test_startup_times_a_target_to_listening_with_the_engines_phases():
    out = _run("bench/startup.py", "--model", "tiny-random", "--runs", "1")
    run = re.search(r"run 0 \S+: listening after ([\d.]+) s; engine: (.*)$", out, re.M)
    assert run and float(run.group(1)) > 0, out
    phases = dict(p.rsplit(" ", 1) for p in run.group(2).split(", "))
    assert {"model", "KV cache and drafter", "executor"} <= phases.keys(), phases
    assert re.search(r"^\| \S+ \| 1 \| [\d.]+ \| [\d.]+ \| 1\.000 \|$", out, re.M), out
