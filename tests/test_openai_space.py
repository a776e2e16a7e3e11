"""The /v1 routes on the Space's own server (the offline demo, app.py in a subprocess), driven by the real `openai`
SDK and raw httpx: chat and completions, streamed and not, equal at temperature 0 to the engine's own answer for the
same messages; usage the engine's counts; a closed stream stops its answer; OpenAI-shaped errors; one client over
its limit is refused (429) while another is served."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from openai_clients import openai_error
from space_client import chat_args, expected_answer, info_when, raw_body, raw_call, reference_engine

from dflash_runtime.openai_api.thinking import split

N_CTX = 4096
MAX_NEW_TOKENS = 3000
PRESET = "tiny-random"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "hello world, the model"}]
MAX_TOKENS = 24
GRADIO = chat_args("hello world, the model", max_tokens=4)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
           "DFLASH_CLIENT_JOBS": "1"}  # fmt: skip
    with running_app(env, REPO_ROOT / "test-artifacts" / "openai_space_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def base_url(server: RunningApp) -> str:
    return server.url.rstrip("/") + "/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def monitor(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    with reference_engine(N_CTX) as engine:
        yield engine


def test_models_is_the_preset(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [PRESET]


def test_chat_at_temperature_0_is_the_engines_answer_streamed_or_not(client: openai.OpenAI, reference: Any) -> None:
    expected = reference.chat(MESSAGES, enable_thinking=False, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = client.chat.completions.create(model=PRESET, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.stats.n_prompt,
                                                                           expected.stats.n_generated)
    figures = whole.model_extra["dflash_stats"]
    assert figures["method"] == "dflash" and figures["drafted"] >= figures["accepted"]
    assert figures["gpu_seconds_used"] > 0 and figures["preset"] == PRESET

    chunks = list(client.chat.completions.create(model=PRESET, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == expected.stats.n_generated
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_a_stop_string_reaches_the_engine(client: openai.OpenAI, reference: Any) -> None:
    text = expected_answer(reference, MESSAGES, MAX_TOKENS)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    answer = client.chat.completions.create(model=PRESET, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop)  # fmt: skip
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (text[: text.index(stop)], "stop")


def test_history_and_thinking_reach_the_template(client: openai.OpenAI, reference: Any) -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "the world"}]  # fmt: skip
    expected = split(expected_answer(reference, messages, MAX_TOKENS, thinking=True))
    assert expected != split(expected_answer(reference, messages, MAX_TOKENS)), "the switch changes the prompt"
    answer = client.chat.completions.create(model=PRESET, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = answer.choices[0].message
    assert ((message.model_extra or {}).get("reasoning_content", ""), message.content) == expected


def test_completions_at_temperature_0_are_the_engines_answer(client: openai.OpenAI, reference: Any) -> None:
    prompt = "the quick brown fox"
    tokens = reference.tokenize(prompt, parse_special=False)
    expected = reference.generate(tokens, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = client.completions.create(model=PRESET, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == expected.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(tokens), expected.stats.n_generated)
    streamed = client.completions.create(model=PRESET, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_closing_the_stream_stops_the_answer(client: openai.OpenAI, monitor: Client) -> None:
    stream = client.chat.completions.create(model=PRESET, messages=MESSAGES, max_tokens=MAX_NEW_TOKENS, stream=True)
    for index, _chunk in enumerate(stream):
        if index == 3:
            break
    closed = time.monotonic()
    stream.close()
    info = info_when(monitor, "idle", timeout_s=30)
    seconds = time.monotonic() - closed
    print(f"closed /v1 stream: the engine was idle {seconds:.2f} s later ({MAX_NEW_TOKENS} tokens asked)")
    assert seconds < 5.0 and info["running"] == 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
    ({"model": PRESET, "messages": MESSAGES, "n": 2}, 400, "n"),
    ({"model": PRESET, "messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ({"model": PRESET, "messages": MESSAGES, "max_tokens": MAX_NEW_TOKENS + 1}, 400, "max_tokens"),
    ({"model": PRESET, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": PRESET, "messages": MESSAGES, "stream": True, "presence_penalty": 1}, 400, "presence_penalty"),
])  # fmt: skip
def test_errors_have_openais_shape_and_status(base_url: str, body: dict, status: int, param: str) -> None:
    response = httpx.post(base_url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == status
    assert openai_error(response)["param"] == param


def test_a_client_over_its_limit_is_refused_while_another_is_served(base_url: str, monitor: Client) -> None:
    """DFLASH_CLIENT_JOBS=1 here: one answer at a time per client (by address: 127.0.0.1 and 127.0.0.2)."""
    body = {"model": PRESET, "messages": MESSAGES, "max_tokens": MAX_NEW_TOKENS, "stream": True}
    other_address = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(timeout=60) as first, httpx.Client(timeout=60, transport=other_address) as other, \
            first.stream("POST", base_url + "/chat/completions", json=body) as running:  # fmt: skip
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)  # its answer has started
        again = first.post(base_url + "/chat/completions", json={**body, "stream": False})
        assert again.status_code == 429 and openai_error(again)["type"] == "rate_limit_error"
        # Off Spaces no proxy header names the client: not to the gate, nor to the server under it (uvicorn's would
        # rewrite the peer of a request from 127.0.0.1), on /v1 or on the Gradio API.
        for n, forwarded in enumerate(("203.0.113.9", "198.51.100.7, 203.0.113.10", "[2001:db8::1]:443")):
            spoofed = first.post(base_url + "/chat/completions", json={**body, "stream": False},
                                 headers={"X-Forwarded-For": forwarded, "X-Real-IP": f"192.0.2.{n}"})  # fmt: skip
            assert spoofed.status_code == 429, (forwarded, spoofed.text)
            gradio = first.post(base_url.removesuffix("/v1") + "/gradio_api/call/generate", content=raw_body(GRADIO),
                                headers={"X-Forwarded-For": forwarded, "Content-Type": "application/json"})
            assert gradio.status_code == 429 and "you have 1 answers" in gradio.text, (forwarded, gradio.text)
        served = other.post(base_url + "/chat/completions", json={**body, "max_tokens": 4, "stream": False})
        assert served.status_code == 200, served.text
        next(lines)  # the first client's answer still runs
    info_when(monitor, "idle", timeout_s=30)


def test_refusals_before_the_api_have_openais_shape(base_url: str) -> None:
    """What the Space's gate refuses before the /v1 routes see it: a body too long (413) or nested too deeply (400)."""
    long = httpx.post(base_url + "/chat/completions", content=b'{"model": "' + b"x" * (1 << 20) + b'"}',
                      headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    assert long.status_code == 413 and openai_error(long)["code"] == "body_too_long"
    deep = httpx.post(base_url + "/chat/completions", content=b"[" * 5000 + b"]" * 5000,
                      headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    assert deep.status_code == 400 and openai_error(deep)["code"] == "invalid_json"


def v1_request(base_url: str, body: dict[str, Any]) -> bytes:
    """A /v1 POST as raw bytes (HTTP/1.1), for a socket of our own."""
    payload = json.dumps(body).encode()
    host = base_url.split("//", 1)[1].split("/", 1)[0]
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload  # fmt: skip


@pytest.mark.parametrize("reads", ["never", "two chunks"])
def test_a_v1_stream_nobody_reads_is_noticed(base_url: str, monitor: Client, reads: str) -> None:
    """The client keeps its connection but reads nothing (or stops after two chunks): its answer stops within 10 s,
    not at its end (what the client reads afterwards never finishes it)."""
    body = {"model": PRESET, "messages": MESSAGES, "max_tokens": MAX_NEW_TOKENS, "stream": True}
    host, port = base_url.split("//", 1)[1].split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.sendall(v1_request(base_url, body))
        received = b""
        if reads == "never":
            info_when(monitor, "busy", timeout_s=60)
        else:
            while received.count(b"data: {") < 2:
                received += sock.recv(256)
        stopped_reading = time.monotonic()
        info_when(monitor, "idle", timeout_s=60)
        seconds = time.monotonic() - stopped_reading
        while chunk := sock.recv(1 << 16):
            received += chunk
            if received.endswith(b"data: [DONE]\n\n") or b"\r\n0\r\n\r\n" in received[-16:]:
                break
    print(f"/v1 stream read {reads}: stopped {seconds:.2f} s later")
    assert seconds < 10.0, f"the answer ran {seconds:.1f} s for a client that read nothing"
    assert b'"finish_reason": "length"' not in received, "the answer ran to its end"


FLOOD_S = 20.0  # seconds of flooding: a per-client cap must hold however long it lasts
FLOOD_CONNECTIONS = 16


def test_one_address_flooding_every_queued_function_takes_no_queue(server: RunningApp, monitor: Client) -> None:
    """127.0.0.3 joins every queued function (the answers', the A/B's, the page's load and timer, ...) with fresh
    sessions on 16 connections, reading nothing; meanwhile 127.0.0.2's short /chat calls, one after another, nearly
    all complete (Gradio's queue, 64 places, would otherwise be full: 503)."""
    config = httpx.get(server.url.rstrip("/") + "/config", timeout=30).json()
    kinds = {component["id"]: component.get("type") for component in config["components"]}
    values = {"textbox": "hello", "slider": 0, "number": 0, "checkbox": False}
    api = json.loads(raw_body(chat_args("hello", max_tokens=4)))["data"]
    functions = [(dep["id"], api if dep.get("api_name") in ("chat", "generate") else
                  [values.get(kinds.get(i)) for i in dep["inputs"]])
                 for dep in config["dependencies"] if dep.get("queue") is not False and dep.get("backend_fn")]
    assert len(functions) >= 6, config["dependencies"]
    join_url = server.url.rstrip("/") + "/gradio_api/queue/join"
    stop = threading.Event()
    statuses: list[int] = []

    def flood(worker: int) -> None:
        with httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.3")) as http:
            for n in itertools.count():
                if stop.is_set():
                    return
                fn_index, data = functions[n % len(functions)]
                body = {"data": data, "fn_index": fn_index, "session_hash": f"flood-{worker}-{n}",
                        "event_data": None, "trigger_id": None}  # fmt: skip
                with contextlib.suppress(httpx.HTTPError):
                    statuses.append(http.post(join_url, json=body).status_code)

    outcomes: list[str] = []
    with ThreadPoolExecutor(FLOOD_CONNECTIONS) as pool:
        floods = [pool.submit(flood, worker) for worker in range(FLOOD_CONNECTIONS)]
        began = time.monotonic()
        try:
            while time.monotonic() - began < FLOOD_S:
                try:
                    result = raw_call(server.url, "chat", raw_body(chat_args("hello", max_tokens=4)), timeout_s=60,
                                      local_address="127.0.0.2")  # fmt: skip
                    outcomes.append(result.event)
                except httpx.HTTPError as error:
                    outcomes.append(str(error)[:80])
        finally:
            stop.set()
        for future in floods:
            future.result(timeout=60)
    completed = outcomes.count("complete") / len(outcomes)
    print(f"flood: {len(statuses)} joins ({statuses.count(200)} admitted, {statuses.count(429)} refused); "
          f"{outcomes.count('complete')} of {len(outcomes)} /chat calls completed")
    assert statuses.count(429) > 0 and len(outcomes) >= 3, (statuses[:20], outcomes)
    assert completed >= 0.9, outcomes
    info_when(monitor, "idle", timeout_s=60)
