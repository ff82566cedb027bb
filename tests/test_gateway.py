"""The OpenAI-compatible gateway, through the official `openai` SDK, against real processes:

    openai SDK -> specwire gateway -> specwire target (tiny-random) -> specwire drafter (n-gram)

Greedy text must equal what `specwire generate` returns for the same input; logprobs must equal
the target's gRPC logprobs; errors arrive as the SDK's typed exceptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from procs import free_port, start_service, stop_service, wait_until

from specwire.common.client import GenerationClient, build_request

ROOT = Path(__file__).resolve().parents[1]
SPECWIRE = [sys.executable, "-m", "specwire.common.cli"]
ENV = {
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
    **{k: None for k in os.environ if k.startswith("SPECWIRE_")},
}
PERIODIC = "a b c a b c a b c a b"  # the n-gram drafter's drafts get accepted
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def stack():
    """Drafter, target and gateway processes; yields (gateway URL, target address)."""
    procs = []
    try:
        drafter, m = start_service(
            SPECWIRE + ["drafter", "--host", "127.0.0.1", "--port", "0", "--max-draft-len", "4"],
            ENV,
            r"listening on \S+:(\d+)",
            timeout=60,
        )
        procs.append(drafter)
        target, m = start_service(
            SPECWIRE
            + [
                "target",
                "--model",
                "tiny-random",
                "--port",
                "0",
                "--no-progress",
                "--max-context-len",
                "512",
                "--drafter",
                f"grpc://127.0.0.1:{m.group(1)}",
                "--drafter-deadline-ms",
                "2000",
                # Every reply waited for: the speculation figures below must not depend on
                # whether a reply beat a millisecond step (auto patience would defer it).
                "--drafter-patience-ms",
                "2000",
            ],
            ENV,
            r"specwire target listening on \S+:(\d+)",
            timeout=120,
        )
        procs.append(target)
        target_addr = f"127.0.0.1:{m.group(1)}"
        gateway, m = start_service(
            SPECWIRE + ["gateway", "--target", target_addr, "--port", "0"],
            ENV,
            r"specwire gateway listening on \S+:(\d+)",
            timeout=60,
        )
        procs.append(gateway)
        yield f"http://127.0.0.1:{m.group(1)}", target_addr
    finally:
        for p in reversed(procs):
            stop_service(p)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def specwire_generate(target: str, prompt: str, max_new_tokens: int, chat: bool = False) -> dict:
    cmd = SPECWIRE + [
        "generate",
        "--target",
        target,
        "--prompt",
        prompt,
        "--json",
        "--max-new-tokens",
        str(max_new_tokens),
        "--temperature",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        cmd + (["--chat"] if chat else []),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# -- text equals `specwire generate` ---------------------------------------------------------------


def test_completion_equals_specwire_generate(stack, client):
    want = specwire_generate(stack[1], PROMPT, 12)
    got = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 == len(want["token_ids"])
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    streamed = client.completions.create(
        model="x", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want["text"]


def test_chat_equals_specwire_generate(stack, client):
    want = specwire_generate(stack[1], PROMPT, 10, chat=True)
    messages = [{"role": "user", "content": PROMPT}]
    got = client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    chunks = list(
        client.chat.completions.create(
            model="x", messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


# -- n, logprobs, stop, usage, speculation ---------------------------------------------------------


def test_n2_greedy_gives_two_identical_choices(client):
    got = client.completions.create(model="x", prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].text == got.choices[1].text
    assert got.usage.completion_tokens == 16
    chunks = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        n=2,
        stream=True,
    )
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    assert text[0] == text[1] != ""


def test_n2_sampled_choices_follow_the_seed(client):
    kw = dict(model="x", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    both = client.completions.create(n=2, **kw)
    again = client.completions.create(n=2, **kw)
    assert [c.text for c in both.choices] == [c.text for c in again.choices]


def test_chat_logprobs_equal_the_targets(stack, client):
    messages = [{"role": "user", "content": PERIODIC}]
    got = client.chat.completions.create(
        model="x", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 8
    with GenerationClient(stack[1], timeout=60) as grpc_client:
        req = build_request(chat=messages, max_new_tokens=8, logprobs=True, top_logprobs=2)
        want = [
            lp
            for m in grpc_client.stream(req)
            if m.WhichOneof("response") == "chunk"
            for lp in m.chunk.logprobs
        ]
    assert [c.token for c in content] == [w.token for w in want]
    for c, w in zip(content, want, strict=True):
        assert c.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.token for t in c.top_logprobs] == [t.token for t in w.top_logprobs]
        assert c.bytes == list(c.token.encode())


def test_completion_logprobs_int_and_streaming(client):
    got = client.completions.create(
        model="x", prompt=PERIODIC, max_tokens=6, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # 3 alternatives (equal strings merge)
    streamed = client.completions.create(
        model="x", prompt=PERIODIC, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    tokens = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == lp.tokens


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop and stop in text
    got = client.completions.create(
        model="x", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == text[: text.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_stream_usage_and_speculation_extension(client):
    chunks = list(
        client.completions.create(
            model="x",
            prompt=PERIODIC,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    spec = finish[0].choices[0].model_extra["speculation"]
    assert spec["steps"] > 0 and spec["accepted_tokens"] > 0, spec
    full = client.completions.create(model="x", prompt=PERIODIC, max_tokens=20, temperature=0)
    assert full.model_extra["speculation"] == spec


# -- errors, models, health, metrics ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1.0),
        dict(n=17),
        dict(max_tokens=0),
        dict(presence_penalty=0.5),
        dict(prompt=["one", "two"]),
    ],
)
def test_bad_requests_are_400(client, kw):
    args = dict(model="x", prompt=PROMPT, max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["message"]


def test_bad_streaming_request_is_400_before_any_event(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], temperature=-2, stream=True
        )


def test_models_health_metrics(stack, client):
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    client.completions.create(model="x", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt=PROMPT, max_tokens=2, temperature=-1)
    list(
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
    )
    assert get(stack[0] + "/health") == (200, '{"status":"ok"}')
    status, text = get(stack[0] + "/metrics")
    assert status == 200
    assert 'specwire_gateway_requests_total{route="/v1/completions",status="200"}' in text
    assert 'specwire_gateway_requests_total{route="/v1/completions",status="400"}' in text
    assert 'specwire_gateway_request_seconds_count{route="/v1/chat/completions"}' in text


def test_api_key_and_unreachable_target(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    dead = f"127.0.0.1:{free_port()}"
    proc, m = start_service(
        SPECWIRE
        + [
            "gateway",
            "--target",
            dead,
            "--port",
            "0",
            "--api-key-file",
            str(key),
            "--model-name",
            "served-name",
        ],
        ENV,
        r"specwire gateway listening on \S+:(\d+)",
        timeout=60,
    )
    try:
        url = f"http://127.0.0.1:{m.group(1)}"
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="x", prompt="hi", max_tokens=2)
        right = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list()] == ["served-name"]
        with pytest.raises(openai.APIStatusError) as err:
            right.completions.create(model="x", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert get(url + "/health")[0] == 503
    finally:
        stop_service(proc)


def test_client_going_away_mid_stream_frees_the_targets_blocks(stack, client):
    with GenerationClient(stack[1], timeout=10) as grpc_client:
        idle = grpc_client.model_info()
        assert idle.kv_blocks_free == idle.kv_blocks_total - 1  # block 0 is the dummy block
        stream = client.completions.create(
            model="x",
            prompt=PROMPT,
            max_tokens=480,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # generation is running
        busy = grpc_client.model_info().kv_blocks_free
        stream.close()
        wait_until(
            lambda: grpc_client.model_info().kv_blocks_free == idle.kv_blocks_free,
            timeout=30,
            what="the target to free the abandoned request's blocks",
        )
    assert busy < idle.kv_blocks_free
