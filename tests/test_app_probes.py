"""What a live probe of the API found, each case through gradio_client and raw HTTP: a specific error for every bad
value, bounded work for a huge history, every generating route behind the queue, no secret and no path or URL opened;
and what held before and must keep holding (many calls at once, clients dropped mid-answer).

After every refused request a known-good request must get the same answer as before."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, FakeHub, RunningApp, running_app
from gradio_client import Client
from gradio_client.exceptions import AppError
from space_client import (
    Raw,
    chat_args,
    expected_answer,
    info_when,
    prompt_length,
    raw_body,
    raw_call,
    raw_run,
    reference_engine,
    stream_chat,
)

N_CTX = 1024
MAX_NEW_TOKENS = 600
SECRET = "hf_probe_secret_0123456789"
GOOD = chat_args("the quick brown fox", max_tokens=24)
# The deprecated draft_max (0 meant "auto") is still checked, and says it is deprecated.
OLD_DRAFT = "draft_max must be an integer in 0..7 (0 = adaptive; deprecated: use draft_length)"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
           "HF_TOKEN": SECRET, "DFLASH_DIAGNOSTICS": "1",
           # Every caller here comes from 127.0.0.1, one client to the gate: up to 24 of its calls at once stand in for
           # 24 visitors (the per-client limits have tests of their own, test_space_fairness.py).
           "DFLASH_CLIENT_JOBS": "24"}  # fmt: skip
    with running_app(env, REPO_ROOT / "test-artifacts" / "app_probes_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def client(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    with reference_engine(N_CTX) as engine:
        yield engine


@pytest.fixture(scope="module")
def good_answer(reference: Any) -> str:
    return expected_answer(reference, [{"role": "user", "content": GOOD["message"]}], GOOD["max_tokens"])


def assert_still_good(client: Client, good_answer: str) -> None:
    text, stats = client.predict(**GOOD, api_name="/generate")
    assert text == good_answer and stats["finish_reason"] == "length"


# Each case: the parameter, the value as gradio_client sends it (None: gradio_client refuses to encode it, NaN and
# lone surrogates are not JSON it will write), the value as raw JSON text, and the message the server must give.
PROBES = [
    ("max_tokens", "abc", '"abc"', "max_tokens must be an integer in 1..600, got 'abc'"),
    ("max_tokens", 1.5, "1.5", "max_tokens must be an integer in 1..600, got 1.5"),
    ("max_tokens", None, "NaN", "max_tokens must be an integer in 1..600, got nan"),
    ("max_tokens", None, "Infinity", "max_tokens must be an integer in 1..600, got inf"),
    ("max_tokens", True, "true", "max_tokens must be an integer in 1..600, got True"),
    ("draft_max", "auto", '"auto"', f"{OLD_DRAFT}, got 'auto'"),
    ("draft_max", "abc", '"abc"', f"{OLD_DRAFT}, got 'abc'"),
    ("draft_max", None, "NaN", f"{OLD_DRAFT}, got nan"),
    ("draft_max", None, "-Infinity", f"{OLD_DRAFT}, got -inf"),
    ("temperature", None, "NaN", "temperature must be a number in [0.0, 2.0], got nan"),
    ("temperature", "hot", '"hot"', "temperature must be a number in [0.0, 2.0], got 'hot'"),
    ("speculative", "false", '"false"', "speculative must be true or false (a boolean), got 'false'"),
    ("thinking", "no", '"no"', "thinking must be true or false (a boolean), got 'no'"),
    ("thinking", 1, "1", "thinking must be true or false (a boolean), got 1"),
    ("message", None, '"hi \\ud800 there"', "message contains an unpaired surrogate (U+D800) at character 3"),
    ("system_prompt", None, '"be \\udfff"', "system_prompt contains an unpaired surrogate (U+DFFF) at character 3"),
    ("history", None, '[{"role": "user", "content": "\\udc00"}]',
     "history[0]['content'] contains an unpaired surrogate (U+DC00) at character 0"),
    ("history", [{"role": "user"}], '[{"role": "user"}]', "history[0]['content'] must be a string, got NoneType"),
    ("preset", "/etc/passwd", '"/etc/passwd"', "unknown preset '/etc/passwd'"),
]  # fmt: skip
PROBE_IDS = [f"{name}={raw}" for name, _, raw, _ in PROBES]


@pytest.mark.parametrize(("name", "value", "raw", "message"), PROBES, ids=PROBE_IDS)
@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_a_bad_value_gets_its_own_message_through_both_clients(
    server: RunningApp, client: Client, good_answer: str, name: str, value: Any, raw: str, message: str, endpoint: str
) -> None:
    result = raw_call(server.url, endpoint, raw_body({**GOOD, name: Raw(raw)}))
    assert result.event == "error" and message in result.message, result
    if value is not None:
        with pytest.raises(AppError) as refused:
            client.predict(**{**GOOD, name: value}, api_name=f"/{endpoint}")
        assert message in str(refused.value)
    assert_still_good(client, good_answer)


def test_a_10000_turn_history_is_fitted_quickly_while_another_visitor_is_served(
    server: RunningApp, client: Client, reference: Any, good_answer: str
) -> None:
    history = []
    for turn in range(10_000):
        history += [{"role": "user", "content": "a"}, {"role": "assistant", "content": str(turn % 10)}]
    assert sum(len(m["content"]) for m in history) < 32000
    results: dict[str, Any] = {}
    start = threading.Barrier(2)

    def huge() -> None:
        start.wait()
        began = time.monotonic()
        results["huge"] = Client(server.url, verbose=False).predict(
            **chat_args("what now?", history=history, max_tokens=24), api_name="/generate"
        )
        results["huge_s"] = time.monotonic() - began

    def visitor() -> None:
        start.wait()
        began = time.monotonic()
        results["visitor"] = Client(server.url, verbose=False).predict(**GOOD, api_name="/generate")
        results["visitor_s"] = time.monotonic() - began

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(huge), pool.submit(visitor)]:
            future.result(timeout=120)
    assert results["visitor"][0] == good_answer and results["visitor_s"] < 60
    text, stats = results["huge"]
    assert results["huge_s"] < 60, f"the huge history took {results['huge_s']:.0f} s"
    dropped = int(re.search(r"no longer sees the (\d+) oldest turns", stats["notice"]).group(1))  # type: ignore[union-attr]
    assert dropped >= 10_000 - 128, "at most 256 messages reach the engine"
    kept = [*history[2 * dropped :], {"role": "user", "content": "what now?"}]
    assert text == expected_answer(reference, kept, 24) and stats["n_prompt"] == prompt_length(reference, kept)
    # The raw path takes the same route.
    raw = raw_call(server.url, "generate", raw_body(chat_args("what now?", history=history, max_tokens=24)))
    assert raw.event == "complete" and raw.data[0] == text


def test_every_generating_route_goes_through_the_queue(server: RunningApp, reference: Any, good_answer: str) -> None:
    for endpoint in ("chat", "generate"):
        refused = raw_run(server.url, endpoint, raw_body(GOOD))
        assert refused.status_code == 404 and "join the queue" in refused.json()["detail"]
    assert raw_run(server.url, "info", '{"data": []}').status_code == 200, "/info answers directly"
    prompts = [f"{word} world" for word in ("hello", "big", "small")]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: raw_call(server.url, "generate", raw_body(chat_args(p, max_tokens=40))),
                                prompts))  # fmt: skip
    for prompt, result in zip(prompts, results, strict=True):
        assert result.event == "complete", result
        assert result.data[0] == expected_answer(reference, [{"role": "user", "content": prompt}], 40)


def test_twelve_streaming_and_twelve_one_shot_calls_at_once_are_all_answered(
    server: RunningApp, reference: Any
) -> None:
    prompts = [f"{word} {number}" for number in range(2) for word in ("one", "two", "fox", "dog", "sea", "sky")]
    start = threading.Barrier(2 * len(prompts))

    def streaming(prompt: str) -> tuple[str, dict[str, Any]]:
        own = Client(server.url, verbose=False)
        start.wait()
        return stream_chat(own, **chat_args(prompt, max_tokens=16))[-1]

    def one_shot(prompt: str) -> tuple[str, dict[str, Any]]:
        own = Client(server.url, verbose=False)
        start.wait()
        return own.predict(**chat_args(prompt, max_tokens=16), api_name="/generate")

    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        streams = [pool.submit(streaming, p) for p in prompts]
        shots = [pool.submit(one_shot, p) for p in prompts]
        answers = [f.result(timeout=300) for f in streams + shots]
    for prompt, (text, stats) in zip(prompts + prompts, answers, strict=True):
        assert text == expected_answer(reference, [{"role": "user", "content": prompt}], 16), prompt
        assert stats["n_generated"] == 16


def test_clients_dropped_mid_answer_twenty_times_leave_the_server_correct(
    server: RunningApp, client: Client, good_answer: str
) -> None:
    base = server.url.rstrip("/") + "/gradio_api/call/chat"
    body = raw_body(chat_args("hello there", max_tokens=MAX_NEW_TOKENS))
    for _ in range(20):
        with httpx.Client(timeout=60) as http:
            event_id = http.post(base, content=body, headers={"Content-Type": "application/json"}).json()["event_id"]
            with http.stream("GET", f"{base}/{event_id}") as stream:
                for line in stream.iter_lines():
                    if line.startswith("event: generating"):
                        break  # the connection closes mid-answer
    assert_still_good(client, good_answer)
    stopped = client.predict(api_name="/info")["worker"]["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and stopped["n_generated"] < MAX_NEW_TOKENS


def test_no_parameter_opens_a_path_or_a_url(server: RunningApp, client: Client, good_answer: str) -> None:
    listener = FakeHub().start()  # records every request it gets
    target = listener.endpoint + "/org/repo/resolve/main/model.gguf"
    try:
        for value in (target, "file:///etc/passwd", "../../../etc/passwd", str(Path.home())):
            with pytest.raises(AppError, match="unknown preset"):
                client.predict(**{**GOOD, "preset": value}, api_name="/generate")
        args = chat_args(target, system_prompt=target, max_tokens=8, history=[{"role": "user", "content": target}])
        text, _ = client.predict(**args, api_name="/generate")
        assert text
    finally:
        listener.stop()
    assert listener.requests == []
    assert_still_good(client, good_answer)


def test_no_secret_in_any_response_log_or_error(server: RunningApp, client: Client) -> None:
    """Runs after the probes above: nothing the server said or logged contains the token."""
    info = client.predict(api_name="/info")
    refused = raw_call(server.url, "generate", raw_body({**GOOD, "max_tokens": Raw('"abc"')}))
    for text in (json.dumps(info), refused.message, server.log()):
        assert SECRET not in text
    assert "Traceback" not in server.log()


def test_a_cancelled_one_shot_call_stops_the_engine(server: RunningApp, client: Client, good_answer: str) -> None:
    """/generate answers in one piece, so its caller sees no chunk; cancelling it still stops the engine."""
    job = client.submit(**chat_args("hello there", max_tokens=MAX_NEW_TOKENS), api_name="/generate")
    info_when(client, "busy")  # the call is generating
    job.cancel()
    assert_still_good(client, good_answer)
    stopped = client.predict(api_name="/info")["worker"]["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and stopped["n_generated"] < MAX_NEW_TOKENS
