"""`python -m dflash_runtime serve` on the offline demo's generated pair, driven by the real `openai` SDK and raw
httpx: chat and completions, streamed and not, each at temperature 0 equal to the engine's own answer for the same
messages (prompt), with the engine's counts as `usage`; a closed stream stops its answer; errors in OpenAI's shape;
the API key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from app_fixtures import REPO_ROOT
from openai_clients import RunningServer, openai_error, running_serve, sse_events
from space_client import demo_pair

from dflash_runtime import load_pair
from dflash_runtime.openai_api.serve import server_config

N_CTX = 4096
KEY = "sk-test-0123456789"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "hello world, the model"}]
PROMPT = "the quick brown fox"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    pair = demo_pair()
    with running_serve(pair.target, pair.draft, REPO_ROOT / "test-artifacts" / "openai_serve.log",
                       "--n-ctx", str(N_CTX), "--model", "demo", env={"DFLASH_API_KEY": KEY}) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    pair = demo_pair()
    with load_pair(pair.target, pair.draft, n_ctx=N_CTX) as engine:
        yield engine


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"


def test_chat_at_temperature_0_is_the_engines_answer_streamed_or_not(client: openai.OpenAI, reference: Any) -> None:
    expected = reference.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.stats.n_prompt,
                                                                           expected.stats.n_generated)
    figures = whole.model_extra["dflash_stats"]
    assert figures["method"] == "dflash" and figures["drafted"] >= figures["accepted"] > 0
    assert whole.model_extra["timings"]["predicted_n"] == expected.stats.n_generated

    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == "length"
    assert finished[0].model_extra["dflash_stats"]["drafted"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.stats.n_generated
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_at_temperature_0_are_the_engines_answer(client: openai.OpenAI, reference: Any) -> None:
    expected = reference.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == expected.stats.n_generated
    assert whole.usage.prompt_tokens == expected.stats.n_prompt
    streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_a_stop_string_ends_the_answer_there(client: openai.OpenAI, reference: Any) -> None:
    text = reference.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    answer = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=[stop])  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == text[: text.index(stop)]


def running(server: RunningServer) -> int:
    return httpx.get(server.url + "/health", timeout=10).json()["running"]


def until_idle(server: RunningServer, timeout_s: float) -> float:
    """Seconds until no answer's stream is open (the server waits for it), the engine then running none."""
    started = time.monotonic()
    health = httpx.get(server.url + "/health", params={"idle_within": timeout_s}, timeout=timeout_s + 10).json()
    assert health["idle"], f"an answer still ran after {timeout_s} s"
    assert health["running"] == 0
    return time.monotonic() - started


def test_closing_the_stream_stops_the_answer(server: RunningServer, client: openai.OpenAI) -> None:
    longest = N_CTX - 64
    stream = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=longest, stream=True)
    for index, _chunk in enumerate(stream):
        if index == 3:
            break
    assert running(server) == 1
    stream.close()
    seconds = until_idle(server, timeout_s=10.0)
    print(f"closed stream: the engine was idle {seconds:.2f} s later ({longest} tokens asked)")
    assert seconds < 5.0


def test_a_client_that_hangs_up_before_a_whole_answer_stops_it(server: RunningServer) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": N_CTX - 64}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    seconds = until_idle(server, timeout_s=10.0)
    assert seconds < 5.0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
    ({"model": "demo", "messages": MESSAGES, "n": 2}, 400, "n"),
    ({"model": "demo", "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"model": "demo", "messages": MESSAGES, "logit_bias": {"5": 3}}, 400, "logit_bias"),
    ({"model": "demo", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
])  # fmt: skip
def test_errors_have_openais_shape_and_status(server: RunningServer, body: dict, status: int, param: str) -> None:
    response = httpx.post(server.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30)  # fmt: skip
    assert response.status_code == status
    assert openai_error(response)["param"] == param


def test_the_sdk_raises_its_own_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, n=2)
    assert caught.value.body["param"] == "n"


def test_the_api_key_is_asked(server: RunningServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(server.base_url + "/models", headers=headers, timeout=10)
        assert response.status_code == 401 and openai_error(response)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


def test_raw_sse_ends_with_done_and_a_long_body_is_refused(server: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    huge = httpx.post(server.base_url + "/chat/completions", content=b"x" * (2 << 20), headers=headers, timeout=30)
    assert huge.status_code == 413 and openai_error(huge)["code"] == "body_too_long"
    unknown = httpx.get(server.base_url + "/nowhere", headers=headers, timeout=10)
    assert unknown.status_code == 404 and openai_error(unknown)


def test_the_server_takes_no_proxy_header_from_a_local_client() -> None:
    """The server's own configuration, as uvicorn builds its application: a request from 127.0.0.1 naming another
    address (and scheme) in proxy headers reaches the routes with its own peer (uvicorn's default would rewrite it)."""
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((scope["client"], scope["scheme"]))

    config = server_config(app)
    config.load()
    scope = {"type": "http", "client": ("127.0.0.1", 50000), "scheme": "http", "path": "/v1/models",
             "headers": [(b"x-forwarded-for", b"203.0.113.9"), (b"x-forwarded-proto", b"https")]}  # fmt: skip
    asyncio.run(config.loaded_app(scope, None, None))
    assert seen == [(("127.0.0.1", 50000), "http")]
