"""The `specwire` command line: prompts reach the model exactly as given, flags and their
SPECWIRE_* variables come from the config dataclasses, logs, --version, the default length.

Services run as real processes (`python -m specwire.common.cli`) with the tiny-random model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from procs import free_port, output_tail, running_service, start_service, stop_service, wait_until

from specwire.common.cli import build_parser
from specwire.common.client import GenerationClient
from specwire.common.errors import UserError
from specwire.common.model.tiny_random import tiny_tokenizer
from specwire.drafter_service.cli import FLAGS as DRAFTER_FLAGS
from specwire.target_service.cli import ENGINE_FLAGS
from specwire.target_service.config import TargetConfig
from specwire.target_service.engine import DEFAULT_MAX_NEW_TOKENS

SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def target() -> str:
    cmd = SPECWIRE + ["target", "--model", "tiny-random", "--port", "0", "--no-progress"]
    cmd += ["--max-context-len", "512"]
    with running_service(cmd, None, r"listening on ([\d.]+:\d+)", timeout=120) as (_, m):
        yield m.group(1)


def specwire(*args: str, env: dict | None = None, stdin: str | None = None):
    return subprocess.run(
        SPECWIRE + list(args),
        input=stdin.encode() if stdin is not None else None,
        capture_output=True,
        timeout=120,
        env=env,
    )


def cli_generate(target: str, *args: str, stdin: str | None = None) -> dict:
    proc = specwire("generate", "--target", target, "--max-new-tokens", str(MAX_NEW), "--json",
                    "--no-speculation", *args, stdin=stdin)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def by_ids(target: str, text: str) -> tuple[int, list[int]]:
    """(prompt tokens, generated ids) for `text` tokenized here and sent as token ids."""
    ids = tiny_tokenizer().encode(text)
    with GenerationClient(target) as client:
        res = client.generate(token_ids=ids, max_new_tokens=MAX_NEW, speculate=False)
    return len(ids), res.token_ids


# Each prompt is checked against what the old CLI sent instead (`unicode_escape`, which also
# turns UTF-8 into mojibake); the test first checks that the two really give different
# requests, else it could not tell them apart.
PROMPTS = ["Café\\n", "C:\\new\\table", "tab\\tand é ü 😀 \\\\ end\\n"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_reaches_the_model_byte_for_byte(target: str, prompt: str) -> None:
    mangled = prompt.encode().decode("unicode_escape")
    exact = by_ids(target, prompt)
    assert exact != by_ids(target, mangled), "prompt and its mangled form are indistinguishable"
    out = cli_generate(target, "--prompt", prompt)
    assert (out["usage"]["prompt_tokens"], out["token_ids"]) == exact


def test_prompt_file_and_stdin_keep_real_newlines(target: str, tmp_path) -> None:
    text = "line one\r\nline two\n\tCafé\\n"
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode())
    exact = by_ids(target, text)
    assert exact != by_ids(target, text.replace("\r\n", "\n"))
    from_file = cli_generate(target, "--prompt-file", str(path))
    from_stdin = cli_generate(target, "--prompt-file", "-", stdin=text)
    for out in (from_file, from_stdin):
        assert (out["usage"]["prompt_tokens"], out["token_ids"]) == exact


def test_generate_reads_specwire_target(target: str) -> None:
    env = {**os.environ, "SPECWIRE_TARGET": target}
    proc = specwire("generate", "--prompt", "hi", "--max-new-tokens", "2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["usage"]["completion_tokens"] == 2


def test_unset_max_new_tokens_is_bounded(target: str) -> None:
    with GenerationClient(target) as client:
        res = client.generate("a b c", ignore_eos=True, speculate=False)
    # Not "fill the context" (512 here): the documented default.
    assert res.usage["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS == 256


# --- flags and variables -----------------------------------------------------------------------


def _help(command: str) -> str:
    proc = specwire(command, "--help")
    assert proc.returncode == 0
    return proc.stdout.decode()


@pytest.mark.parametrize(
    ("command", "flags"), [("target", ENGINE_FLAGS), ("drafter", DRAFTER_FLAGS)]
)
def test_help_names_each_flags_variable(command: str, flags: dict) -> None:
    text = re.sub(r"\s+", " ", _help(command)).split("options:")[1]
    options = re.findall(r" (--[a-z][a-z-]*)", text)
    options = [o for o in dict.fromkeys(options) if o != "--help"]
    assert len(options) >= len(flags)
    for option in options:
        after = text.split(f" {option}", 1)[1].split(" --", 1)[0]
        if after == "," and f" {option}, --no-{option[2:]} " in text:
            continue  # an on/off pair (--x, --no-x: auto when neither): its help follows --no-x
        assert "[env SPECWIRE_" in after, f"{command} {option}: {after}"


@pytest.mark.parametrize(
    ("argv", "env", "dest", "expected"),
    [
        (["drafter"], {}, "port", 50152),
        (["drafter"], {"SPECWIRE_DRAFTER_PORT": "6000"}, "port", 6000),
        (["drafter", "--port", "7000"], {"SPECWIRE_DRAFTER_PORT": "6000"}, "port", 7000),
        (["drafter"], {"SPECWIRE_SESSION_TTL": "1.5"}, "session_ttl_s", 1.5),
        (["target"], {"SPECWIRE_MAX_DRAFT_LEN": "6"}, "max_draft_len", 6),
        (["target"], {}, "cuda_graphs", True),
        (["target"], {"SPECWIRE_NO_CUDA_GRAPHS": "1"}, "cuda_graphs", False),
        (["target", "--no-progress"], {}, "progress", False),
        (["target"], {"SPECWIRE_NO_PROGRESS": "true"}, "progress", False),
        (["generate", "--prompt", "x"], {"SPECWIRE_TARGET": "h:1"}, "target", "h:1"),
        (["target"], {"SPECWIRE_LOG_LEVEL": "debug"}, "log_level", "DEBUG"),
        (["target"], {"SPECWIRE_LOG_FORMAT": "json"}, "log_format", "json"),
        (["target"], {}, "exact", "auto"),
        (["target", "--exact", "on"], {"SPECWIRE_EXACT": "off"}, "exact", "on"),
        (["target"], {"SPECWIRE_EXACT": "off"}, "exact", "off"),
        (["target"], {}, "fused", False),
        (["target"], {"SPECWIRE_FUSED": "1"}, "fused", True),
        (["target"], {}, "drafter_lookahead", -1),
        (["target", "--drafter-lookahead", "9"], {}, "drafter_lookahead", 9),
        (["target"], {}, "drafter_ask_at", "auto"),
        (["target"], {"SPECWIRE_DRAFTER_ASK_AT": "commit"}, "drafter_ask_at", "commit"),
        (["target"], {}, "drafter_wait_rule", "share"),
        (["target"], {"SPECWIRE_DRAFTER_WAIT_RULE": "gain"}, "drafter_wait_rule", "gain"),
    ],
)
def test_flag_beats_variable_beats_default(monkeypatch, argv, env, dest, expected) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert getattr(build_parser().parse_args(argv), dest) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPECWIRE_DRAFTER_PORT": "eighty"}, "SPECWIRE_DRAFTER_PORT='eighty' is not a valid int"),
        ({"SPECWIRE_NO_PROGRESS": "maybe"}, "SPECWIRE_NO_PROGRESS='maybe' is not a boolean"),
        ({"SPECWIRE_LOG_FORMAT": "xml"}, "SPECWIRE_LOG_FORMAT='xml': expected text | json"),
    ],
)
def test_bad_variables_are_one_line_errors(monkeypatch, env, message) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=re.escape(message)):
        build_parser()


@pytest.mark.parametrize(("flag", "named"), [("exact", "--exact on"), ("fused", "--fused")])
def test_gpu_kernel_flags_without_the_triton_kernels_are_one_line_errors(flag, named) -> None:
    from specwire.common.model.attention import TorchPagedAttention
    from specwire.common.model.triton_backend import make_ops

    with pytest.raises(UserError, match=f"{named} needs the Triton kernels"):
        make_ops(TorchPagedAttention(2, 1, 8, 16), **{flag: True})


def test_exact_auto_is_on_only_where_it_was_measured_cheap() -> None:
    """`--exact auto` (the default): the exact mode for bf16/fp16 models on the Triton kernels
    whose GEMM shapes are all of a model it was measured cheap on (SmolLM2-135M and -360M,
    Qwen2.5-1.5B: <= 10 % at every verify step measured); not for other shapes (the tiny test
    model, unmeasured; Llama-3.2-1B's, +21 %; Llama-3-8B's, +13 %),
    never on the CPU's SDPA, in fp32 (lossless as it is) or against an explicit --fused; `on`
    and `off` are what they say."""
    from types import SimpleNamespace

    from specwire.common.model.config import (
        LLAMA3_2_1B,
        LLAMA3_8B,
        QWEN2_5_1_5B,
        SMOLLM2_135M,
        SMOLLM2_360M,
        TINY_RANDOM,
    )
    from specwire.common.model.llama import LlamaModel
    from specwire.common.model.triton_backend import resolve_exact

    def shapes(cfg):
        with torch.device("meta"):  # shapes only, no weights
            return LlamaModel(cfg).gemm_shapes()

    smol, tiny, llama = shapes(SMOLLM2_135M), shapes(TINY_RANDOM), shapes(LLAMA3_8B)
    smol_360m, qwen, llama_1b = shapes(SMOLLM2_360M), shapes(QWEN2_5_1_5B), shapes(LLAMA3_2_1B)
    triton, sdpa = SimpleNamespace(name="triton"), SimpleNamespace(name="sdpa")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert resolve_exact("auto", triton, bf16, smol, fused=False)
    assert resolve_exact("auto", triton, fp16, smol, fused=False)
    assert resolve_exact("auto", triton, bf16, qwen, fused=False)  # wider than 1024, measured
    assert not resolve_exact("auto", triton, bf16, tiny, fused=False)  # not measured
    assert resolve_exact("auto", triton, bf16, smol_360m, fused=False)
    assert not resolve_exact("auto", triton, bf16, llama_1b, fused=False)  # +21 %
    assert not resolve_exact("auto", triton, bf16, llama, fused=False)  # +13 %
    assert not resolve_exact("auto", triton, bf16, smol + llama[:1], fused=False)  # one unmeasured
    assert not resolve_exact("auto", triton, fp32, smol, fused=False)
    assert not resolve_exact("auto", sdpa, bf16, smol, fused=False)
    assert not resolve_exact("auto", triton, bf16, smol, fused=True)
    assert resolve_exact("on", triton, bf16, tiny, fused=False)
    assert resolve_exact("on", sdpa, fp32, smol, fused=False)  # make_ops then refuses it
    assert not resolve_exact("off", triton, bf16, smol, fused=False)
    # The flag's help names the models (the CLI does not import the model code for it).
    assert "SmolLM2-135M, SmolLM2-360M, Qwen2.5-1.5B" in ENGINE_FLAGS["exact"].help


def test_exact_must_be_auto_on_or_off() -> None:
    with pytest.raises(UserError, match="--exact must be auto, on or off, got 'yes'"):
        TargetConfig(exact="yes")
    proc = specwire("target", "--exact")  # the old switch now takes a value
    assert proc.returncode == 2
    assert "--exact: expected one argument" in proc.stderr.decode()


def test_a_negative_lookahead_other_than_auto_is_refused() -> None:
    with pytest.raises(UserError, match="--drafter-lookahead must be >= 0"):
        TargetConfig(drafter_lookahead=-2)


@pytest.mark.parametrize("wait", [0, -1, float("nan")])
def test_a_drafter_wait_that_is_not_positive_is_refused(wait) -> None:
    with pytest.raises(UserError, match="--drafter-wait-s must be > 0"):
        TargetConfig(drafter_wait_s=wait)


@pytest.mark.parametrize("value", ["0", "-1e-3", "1e-7", "0.5"])
def test_a_gil_switch_interval_out_of_range_is_a_one_line_error(value) -> None:
    proc = specwire("target", f"--gil-switch-interval={value}")
    assert proc.returncode != 0
    err = proc.stderr.decode().strip()
    assert err.splitlines() == [
        "specwire: error: --gil-switch-interval must be between 1e-06 and 0.1 seconds, "
        f"got {float(value)}"
    ]


def test_a_kv_cache_bigger_than_the_memory_is_a_one_line_error() -> None:
    """Refused before the block pool is built (whose free list alone would exhaust the host
    at two billion blocks) and before any page is promised."""
    proc = specwire(
        "target", "--model", "tiny-random", "--port", "0", "--num-kv-blocks", "2000000000"
    )
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.decode().splitlines() if ln.startswith("specwire: error")]
    assert len(err) == 1 and "lower --num-kv-blocks" in err[0], proc.stderr.decode()
    assert re.search(r"the KV cache needs [\d.]+ GiB and [\d.]+ GiB of memory", err[0]), err


def test_version() -> None:
    proc = specwire("--version")
    assert proc.returncode == 0
    assert re.fullmatch(r"specwire \S+.*\n", proc.stdout.decode())


def test_json_logs_are_one_object_per_line() -> None:
    cmd = SPECWIRE + ["--log-format", "json", "--log-level", "INFO", "drafter", "--port", "0"]
    cmd += ["--host", "127.0.0.1"]
    with running_service(cmd, None, r"listening on", timeout=60) as (proc, _):
        wait_until(lambda: "serving on" in output_tail(proc), 30, what="the serving log line")
    lines = [ln.removeprefix("[stderr] ") for ln in output_tail(proc).splitlines()]
    records = [json.loads(ln) for ln in lines if ln.startswith("{")]
    serving = [r for r in records if "serving on" in r["message"]]
    assert serving and serving[0]["level"] == "INFO"
    assert {"time", "level", "logger", "message"} <= set(serving[0])
    # Nothing else on stderr: every stderr line is a JSON record (gRPC core is quiet too).
    stderr = [ln for ln in output_tail(proc).splitlines() if ln.startswith("[stderr] ")]
    assert all(ln.removeprefix("[stderr] ").startswith("{") for ln in stderr), stderr


def test_a_target_waits_for_a_drafter_started_after_it() -> None:
    """`--drafter-wait-s`: a target started before its drafter (a pod or container that comes
    up first) says in its log that it is waiting, then starts and drafts once the drafter is
    up; with nobody there it gives up after the wait, with one line on stderr that says so."""
    dport = free_port()
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    target = SPECWIRE + ["target", "--model", "tiny-random", "--port", "0", "--no-progress"]
    # Every reply waited for: whether a step drafts must not depend on how loaded the machine
    # is (auto patience skips replies that are slow to come; under a busy CI none came in time).
    target += ["--drafter", f"grpc://127.0.0.1:{dport}", "--drafter-patience-ms", "50"]
    proc, _ = start_service(target + ["--drafter-wait-s", "120"], None, None, timeout=120)
    try:
        wait_until(lambda: "is not reachable yet" in output_tail(proc), 120, what="the wait")
        assert proc.poll() is None and "listening on" not in output_tail(proc)
        drafter = SPECWIRE + ["drafter", "--port", str(dport)]
        with running_service(drafter, None, rf"listening on 127.0.0.1:{dport}", 60):
            wait_until(lambda: "listening on" in output_tail(proc), 60, what="the target")
            port = re.search(r"listening on [\d.]+:(\d+)", output_tail(proc)).group(1)
            with GenerationClient(f"127.0.0.1:{port}", timeout=60) as client:
                out = client.generate(prompt, max_new_tokens=40)
        assert out.speculation["accepted_tokens"] > 0
    finally:
        stop_service(proc)
    bad = specwire(*target[len(SPECWIRE) :], "--drafter-wait-s", "0.5")
    assert bad.returncode != 0
    errors = [ln for ln in bad.stderr.decode().splitlines() if ln.startswith("specwire: error:")]
    assert len(errors) == 1 and "is unreachable" in errors[0], bad.stderr.decode()
    assert errors[0].endswith("waited 0.5 s (--drafter-wait-s)"), errors[0]
