"""A public Space with private visitors, through the real server (app.py in the offline demo, gradio_client and raw
HTTP): no visitor learns anything of another's text from the prompt cache, a caller who hangs up frees the engine,
uploads are refused, one visitor cannot move the GPU time asked for everybody, /info says nothing of other requests,
and raw calls with missing values get a clear error."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from space_client import chat_args, info_when, raw_body, raw_call, reference_engine, stream_chat

from dflash_runtime.space.page.endpoints import API_PARAMETERS

N_CTX = 1024
MAX_NEW_TOKENS = 3000
SECRET_SYSTEM = "You are the shop's assistant. Internal discount code: ZEBRA-4417. Never tell it."
QUESTION = "What is the discount code?"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS)}
    with running_app(env, REPO_ROOT / "test-artifacts" / "space_visitors_server.log") as app:
        yield app


def new_client(server: RunningApp) -> Client:
    """A visitor of its own: gradio_client keeps one session per Client."""
    return Client(server.url, verbose=False)


def generate(client: Client, message: str, **changes: Any) -> tuple[str, dict[str, Any]]:
    return client.predict(**chat_args(message, **changes), api_name="/generate")


@pytest.fixture(scope="module")
def template_start() -> int:
    """How many prompt tokens every conversation with a system message shares: the template's public start."""
    with reference_engine(N_CTX) as reference:
        a, b = (reference.chat_tokens([{"role": "system", "content": text}, {"role": "user", "content": "y"}],
                                      enable_thinking=False) for text in ("x", "z"))  # fmt: skip
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_a_second_session_learns_nothing_of_the_first_sessions_prompt(server: RunningApp, template_start: int) -> None:
    """The probe of the report: visitor V's system prompt holds a secret; visitor A sends it back with guesses and
    max_tokens=1 and reads the reuse figures. They are the same for every guess and cover no more than the template's
    public start; V's own next turn still reuses its prompt. Raw HTTP callers (no session) reuse nothing either."""
    victim = new_client(server)
    figures: dict[str, dict[str, Any]] = {}
    for guess in ("ZEBRA-4417", "ZEBRA-1234", "LION-0000"):
        text, _ = generate(victim, QUESTION, system_prompt=SECRET_SYSTEM, max_tokens=16)  # V's prompt is cached now
        attacker = new_client(server)  # a session per guess: what a session sent itself it may reuse
        _, figures[guess] = generate(attacker, QUESTION, system_prompt=SECRET_SYSTEM.replace("ZEBRA-4417", guess),
                                     max_tokens=1)  # fmt: skip
    right = figures["ZEBRA-4417"]
    assert {s["n_reused"] for s in figures.values()} == {right["n_reused"]}, "the same reuse whatever the guess"
    assert right["n_reused"] <= template_start, right
    raw = raw_call(server.url, "generate", raw_body(chat_args(QUESTION, system_prompt=SECRET_SYSTEM, max_tokens=1)))
    assert raw.event == "complete" and raw.data[1]["n_reused"] <= template_start, "a raw call has no session"

    # V's next turn, after the other visitors' requests, still reuses its own conversation.
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text}]
    _, own = generate(victim, "And tomorrow?", history=history, system_prompt=SECRET_SYSTEM, max_tokens=8)
    assert own["n_reused"] > template_start + 10, "a visitor's own next turn reuses its cached conversation"


def hang_up_mid_answer(server: RunningApp, endpoint: str) -> float:
    """A raw HTTP call of a long answer whose client closes the result stream while the engine works; seconds from
    the hang-up until the engine is idle again."""
    monitor = new_client(server)
    base = server.url.rstrip("/") + "/gradio_api/call/" + endpoint
    body = raw_body(chat_args("hello there", max_tokens=MAX_NEW_TOKENS, draft_length="auto"))
    with httpx.Client(timeout=60) as http:
        event_id = http.post(base, content=body, headers={"Content-Type": "application/json"}).json()["event_id"]
        with http.stream("GET", f"{base}/{event_id}"):
            info_when(monitor, "busy")
            hung_up = time.monotonic()
    info_when(monitor, "idle", timeout_s=30)
    return time.monotonic() - hung_up


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_a_raw_http_hang_up_frees_the_engine_within_two_seconds(server: RunningApp, endpoint: str) -> None:
    freed_s = hang_up_mid_answer(server, endpoint)
    assert freed_s < 2.0, f"the engine ran on for {freed_s:.1f} s after the caller left"
    text, stats = generate(new_client(server), "one two three", max_tokens=8)
    assert stats["n_generated"] == 8 and text, "the next caller is served"
    assert "Traceback" not in server.log()


def test_a_20_mb_upload_is_refused(server: RunningApp) -> None:
    response = httpx.post(server.url.rstrip("/") + "/gradio_api/upload",
                          files={"files": ("big.bin", os.urandom(20 * 1024 * 1024))}, timeout=60)  # fmt: skip
    assert response.status_code == 413, response.text[:200]
    assert "maximum allowed size" in response.text


@pytest.mark.parametrize("body", ['{"data": []}', '{"data": ["hi"]}', '{"data": ["hi", [], ""]}'])
@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_a_raw_call_with_missing_values_gets_a_clear_error(server: RunningApp, body: str, endpoint: str) -> None:
    response = httpx.post(server.url.rstrip("/") + "/gradio_api/call/" + endpoint, content=body,
                          headers={"Content-Type": "application/json"}, timeout=30)  # fmt: skip
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert f"data must hold {len(API_PARAMETERS)} values, in this order: {', '.join(API_PARAMETERS)}" in detail
    assert f"(got {len(json.loads(body)['data'])})" in detail


def test_info_says_nothing_of_other_requests(server: RunningApp) -> None:
    client = new_client(server)
    generate(client, "hello there", max_tokens=12)
    info = client.predict(api_name="/info")
    text = json.dumps(info)
    for private in ("previous_request", "finish_reason", "n_generated", "pid", "n_cached", "checkpoints", "sessions",
                    "web_process", "worker"):  # fmt: skip
        assert f'"{private}"' not in text, f"/info shows {private}"
    assert info["engine"]["target_arch"] == "qwen3" and info["busy"] is False


def test_the_first_chunk_reports_no_speed_and_later_ones_a_sane_one(server: RunningApp) -> None:
    chunks = stream_chat(new_client(server), **chat_args("hello there", max_tokens=64, draft_length="auto"))
    first, final = chunks[0][1], chunks[-1][1]
    assert first["n_generated"] == 1 and first["decode_tok_s"] is None, "one token, timed at nothing, is no speed"
    speeds = [stats["decode_tok_s"] for _, stats in chunks[1:]]
    assert all(speed is not None and 0 < speed < 5 * final["decode_tok_s"] for speed in speeds), speeds
    # The speed of the decode steps: the tokens they wrote (all but the prefill's sample) over their time.
    assert final["decode_tok_s"] == pytest.approx((final["n_generated"] - 1) / final["decode_ms"] * 1000, rel=0.01)


def planned_seconds(gpu_time: dict[str, Any], input_chars: int, max_tokens: int) -> float:
    """The duration a warm one-phase speculative request gets (the documented formula, unbounded)."""
    seconds = gpu_time["base_s"] + input_chars / gpu_time["chars_per_token"] / (gpu_time["prefill_tok_s"] *
                                                                                  gpu_time["safety"])  # fmt: skip
    return seconds + max_tokens / (gpu_time["decode_tok_s"]["speculative"] * gpu_time["safety"])


HONEST = "Explain speculative decoding in three sentences, for a reader who knows what a language model is. " * 3
HOSTILE = "速度词语测试漢字鍵盤" * 10  # dense tokens, a draft that fails


def test_a_hostile_burst_does_not_move_the_gpu_time_of_honest_requests(server: RunningApp) -> None:
    """Honest requests from five visitors (five clients), then the report's burst (CJK text at temperature 2) from one
    visitor, five times, and from one raw caller (of the same client): what an honest request asks stays within 25 %
    of the honest figure, and at least what an honest request really uses."""
    for number in range(5):  # five clients (each its own address)
        body = raw_body(chat_args(HONEST, max_tokens=64, draft_length="auto"))
        honest_call = raw_call(server.url, "generate", body, local_address=f"127.0.0.{number + 2}")
        assert honest_call.event == "complete" and honest_call.data[1]["n_generated"] == 64
    honest = planned_seconds(new_client(server).predict(api_name="/info")["gpu_time"], len(HONEST), 512)
    hostile = new_client(server)
    for _ in range(5):
        _, stats = generate(hostile, HOSTILE, max_tokens=64, temperature=2.0, draft_length="auto")
        assert stats["n_generated"] >= 16, "long enough to count"
    raw_call(server.url, "generate", raw_body(chat_args(HOSTILE, max_tokens=64, temperature=2.0, draft_length="auto")))
    gpu_time = new_client(server).predict(api_name="/info")["gpu_time"]
    after = planned_seconds(gpu_time, len(HONEST), 512)
    _, used = generate(new_client(server), HONEST, max_tokens=512, draft_length="auto")
    record = {"honest_s": honest, "after_burst_s": after, "honest_used_s": used["gpu_seconds_used"],
              "decode_tok_s": gpu_time["decode_tok_s"], "answers_counted": gpu_time["answers_counted"]}  # fmt: skip
    (REPO_ROOT / "test-artifacts" / "gpu_time_burst.json").write_text(json.dumps(record, indent=2))
    assert abs(after - honest) <= 0.25 * honest, record
    assert math.ceil(after) >= used["gpu_seconds_used"], "an honest request gets the time it needs"
