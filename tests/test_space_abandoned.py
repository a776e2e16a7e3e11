"""Nobody can take the Space, through the real server (app.py in the offline demo, raw HTTP, gradio_client and its
process killed): an answer nobody reads stops within seconds on every route, one session or a flood of session-less
calls cannot fill the queue, bodies are bounded before parsing, uploads are off, session-less calls evict no parked
visitor and one client's do not move the GPU time asked for others, and /chat streams grow linearly with the answer.

Each case records its figures in test-artifacts/abandoned_jobs.json."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from space_client import chat_args, info_when, raw_body, raw_call

from dflash_runtime.space.page.endpoints import API_PARAMETERS

N_CTX = 4096
MAX_NEW_TOKENS = 3000
READER_TIMEOUT_S = 3.0  # the server's default (DFLASH_READER_TIMEOUT_S)
STOPPED_WITHIN_S = 5.0  # what "stops within seconds" means here
RECORD = REPO_ROOT / "test-artifacts" / "abandoned_jobs.json"
LONG = chat_args("hello there", max_tokens=MAX_NEW_TOKENS, draft_length="auto")
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS)}
    with running_app(env, REPO_ROOT / "test-artifacts" / "space_abandoned_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def monitor(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


def record(name: str, value: Any) -> None:
    """Keep a figure for the report: test-artifacts/abandoned_jobs.json, one key per case."""
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    figures[name] = value
    RECORD.write_text(json.dumps(figures, indent=2, sort_keys=True))


def api(server: RunningApp, path: str) -> str:
    return server.url.rstrip("/") + "/gradio_api/" + path


def dependency_ids(server: RunningApp) -> dict[str, int]:
    """The page's events by API name, from its public configuration."""
    config = httpx.get(server.url.rstrip("/") + "/config", timeout=30).json()
    return {dep["api_name"]: dep["id"] for dep in config["dependencies"] if dep.get("api_name")}


def post_call(server: RunningApp, endpoint: str, args: dict[str, Any]) -> httpx.Response:
    return httpx.post(api(server, "call/" + endpoint), content=raw_body(args), headers=JSON, timeout=60)


def join(server: RunningApp, fn_index: int, data: list[Any], session: str) -> httpx.Response:
    body = {"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None}
    return httpx.post(api(server, "queue/join"), json=body, timeout=60)


def stopped_after(monitor: Client, since: float) -> float:
    """Seconds from `since` until the engine is idle again (the server waits on its engine slot: no polling)."""
    info_when(monitor, "idle", timeout_s=60)
    return time.monotonic() - since


def drained(server: RunningApp, monitor: Client, timeout_s: float = 60.0) -> None:
    """Until nothing waits in the queue and no answer runs (Gradio's public queue status, polled to a deadline)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(api(server, "queue/status"), timeout=30).json()["queue_size"] > 0 or \
            monitor.predict(until="idle", timeout_s=1.0, api_name="/wait")["busy"]:  # fmt: skip
        assert time.monotonic() < deadline, "the queue did not drain"


def api_values(args: dict[str, Any]) -> list[Any]:
    return [args[name] for name in API_PARAMETERS]


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_a_call_whose_result_is_never_read_stops(server: RunningApp, monitor: Client, endpoint: str) -> None:
    posted = time.monotonic()
    assert post_call(server, endpoint, LONG).status_code == 200
    info_when(monitor, "busy")
    seconds = stopped_after(monitor, posted)
    record(f"never_read_{endpoint}_stopped_s", round(seconds, 2))
    assert seconds < READER_TIMEOUT_S + 2.0, f"an unread {endpoint} held the engine {seconds:.1f} s"


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_closing_the_queue_stream_stops_the_answer(server: RunningApp, monitor: Client, endpoint: str) -> None:
    """The page's and gradio_client's route: /queue/join, then the session's /queue/data stream, closed mid-answer."""
    session = f"closer-{endpoint}"
    fn_index = dependency_ids(server)[endpoint]
    assert join(server, fn_index, api_values(LONG), session).status_code == 200
    with httpx.Client(timeout=60) as http, http.stream("GET", api(server, f"queue/data?session_hash={session}")):
        info_when(monitor, "busy")
        closed = time.monotonic()
    seconds = stopped_after(monitor, closed)
    record(f"queue_stream_closed_{endpoint}_stopped_s", round(seconds, 2))
    assert seconds < STOPPED_WITHIN_S


CLIENT_SCRIPT = """
import sys
from gradio_client import Client
client = Client(sys.argv[1], verbose=False)
args = dict(message="hello there", history=[], system_prompt="", preset="tiny-random", max_tokens={max_tokens},
            temperature=0.0, top_p=1.0, draft_max=None, speculative=True, thinking=False, method="auto",
            draft_length="auto", top_k=40, min_p=0.0)
if sys.argv[2] == "/chat":
    for _ in client.submit(**args, api_name="/chat"):
        print("reading", flush=True)  # the parent kills it once it reads
else:
    client.predict(**args, api_name="/generate")
"""


@pytest.mark.parametrize("endpoint", ["/generate", "/chat"])
def test_a_client_killed_mid_answer_stops_it(server: RunningApp, monitor: Client, endpoint: str) -> None:
    """Killed as soon as its answer runs (/generate: maybe before its stream is open, then the grace applies), or
    (/chat) once it has read an item: its stream's hang-up stops the answer at once."""
    script = CLIENT_SCRIPT.format(max_tokens=MAX_NEW_TOKENS)
    process = subprocess.Popen([sys.executable, "-c", script, server.url, endpoint], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        info_when(monitor, "busy")
        if endpoint == "/chat":
            reading = threading.Event()
            threading.Thread(target=lambda: process.stdout and process.stdout.readline() and reading.set(),
                             daemon=True).start()  # fmt: skip
            assert reading.wait(60), "the client read nothing"
        process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
    seconds = stopped_after(monitor, killed)
    record(f"client_killed_{endpoint.strip('/')}_stopped_s", round(seconds, 2))
    assert seconds < (1.5 if endpoint == "/chat" else STOPPED_WITHIN_S)


def test_unread_chat_streams_do_not_make_an_honest_visitor_wait(server: RunningApp, monitor: Client) -> None:
    """Four /chat calls nobody reads, then an honest visitor: served once the first is found abandoned (the others,
    abandoned by then, never start)."""
    posted = time.monotonic()
    for _ in range(4):
        assert post_call(server, "chat", LONG).status_code == 200
    info_when(monitor, "busy")
    text, stats = Client(server.url, verbose=False).predict(**chat_args("one two three", max_tokens=8),
                                                            api_name="/generate")  # fmt: skip
    waited = time.monotonic() - posted
    record("four_unread_chats_honest_visitor_served_s", round(waited, 2))
    assert stats["n_generated"] == 8 and text
    assert waited < READER_TIMEOUT_S + 5.0, f"the honest visitor waited {waited:.1f} s"


def test_one_session_cannot_queue_more_than_its_share(server: RunningApp, monitor: Client) -> None:
    """Three answers per session (DFLASH_SESSION_JOBS); an A/B run counts as the answers it runs (plain and each of
    the demo's methods), so a session queues one A/B run, not five."""
    ids = dependency_ids(server)
    statuses = [join(server, ids["chat"], api_values(LONG), "greedy-session") for _ in range(4)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429], [r.text for r in statuses]
    assert "this session has 3 answers queued or running" in statuses[-1].json()["detail"]
    drained(server, monitor)  # nobody reads them: they go

    # the A/B's inputs: the session, the message box, its picks (none: the default's), then the page's settings
    settings = ["", 64, 0.0, 1.0, 40, 0.0, "auto", "auto", True, False]
    ab = [join(server, ids["compare"], [None, "hello there", None, *settings], "ab-session") for _ in range(5)]
    record("ab_runs_queued_by_one_session", [r.status_code for r in ab])
    assert [r.status_code for r in ab] == [200, 429, 429, 429, 429], [r.text for r in ab]
    assert "an A/B run counts as the answers it runs" in ab[1].json()["detail"]
    drained(server, monitor)


def test_a_flood_of_session_less_calls_cannot_fill_the_queue(server: RunningApp, monitor: Client) -> None:
    """65 raw posts at once from one client: at most DFLASH_CLIENT_JOBS (8) are queued, the rest refused (429); an
    honest visitor (another client) is served meanwhile, and the unread ones go."""
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: post_call(server, "generate", LONG).status_code, range(65)))
    flood_s = time.monotonic() - started
    honest = raw_call(server.url, "generate", raw_body(chat_args("one two three", max_tokens=8)),
                      local_address="127.0.0.2")  # another client than the flood's
    assert honest.event == "complete", honest
    text, stats = honest.data
    served_s = time.monotonic() - started
    record("flood_65_posts", {"seconds": round(flood_s, 2), "accepted": codes.count(200), "refused_429":
                              codes.count(429), "honest_served_after_s": round(served_s, 2)})  # fmt: skip
    # Eight places, each held until its call is found abandoned (READER_TIMEOUT_S after it was posted).
    assert codes.count(200) <= 8 * (1 + math.ceil(flood_s / READER_TIMEOUT_S)), (flood_s, codes)
    assert codes.count(200) + codes.count(429) == 65 and codes.count(429) >= 65 // 2, codes
    assert stats["n_generated"] == 8 and text
    assert served_s < flood_s + READER_TIMEOUT_S + 5.0
    drained(server, monitor)


def test_a_34_mb_body_is_refused_before_it_is_parsed(server: RunningApp) -> None:
    history = [{"role": "user", "content": "x" * 1000}, {"role": "assistant", "content": "y" * 1000}] * 17_000
    body = raw_body(chat_args("hi", history=history)).encode()
    assert len(body) > 34_000_000
    started = time.monotonic()
    declared = httpx.post(api(server, "call/generate"), content=body, headers=JSON, timeout=60)
    declared_s = time.monotonic() - started

    def pieces() -> Iterator[bytes]:  # no length declared: the gate counts as it reads
        for offset in range(0, len(body), 1 << 20):
            yield body[offset : offset + (1 << 20)]

    started = time.monotonic()
    try:
        streamed = httpx.post(api(server, "queue/join"), content=pieces(), headers=JSON, timeout=60).status_code
    except httpx.HTTPError:  # refused while still sending: the server closed the connection after its answer
        streamed = 413
    streamed_s = time.monotonic() - started
    record("body_34_mb", {"bytes": len(body), "declared_status": declared.status_code,
                          "declared_refused_s": round(declared_s, 3), "streamed_status": streamed,
                          "streamed_refused_s": round(streamed_s, 3)})  # fmt: skip
    assert declared.status_code == 413 and "request body is longer" in declared.text
    assert streamed == 413
    _, stats = raw_call(server.url, "generate", raw_body(chat_args("still here", max_tokens=4))).data
    assert stats["n_generated"] == 4, "the server still answers"


def test_uploads_are_off(server: RunningApp) -> None:
    response = httpx.post(api(server, "upload"), files={"files": ("a.txt", b"x" * 1024)}, timeout=30)
    assert response.status_code == 413 and "uploads are off" in response.text
    assert "/tmp" not in response.text and "gradio" not in response.text.lower()


def generate(client: Client, message: str, **changes: Any) -> tuple[str, dict[str, Any]]:
    return client.predict(**chat_args(message, **changes), api_name="/generate")


def test_session_less_calls_evict_no_parked_visitor(server: RunningApp) -> None:
    """A visitor's second turn reuses its first; after eight session-less calls (the report's eviction burst) its
    third turn still reuses its whole conversation so far."""
    visitor = Client(server.url, verbose=False)
    history: list[dict[str, str]] = []
    reused = []
    for turn, message in enumerate(["Tell me about the sea.", "And the mountains?", "And the sky?"]):
        if turn == 2:
            for i in range(8):
                assert raw_call(server.url, "generate", raw_body(chat_args(f"burst {i}", max_tokens=4))).event \
                    == "complete"  # fmt: skip
        text, stats = generate(visitor, message, history=history, max_tokens=24)
        reused.append((stats["n_reused"], stats["n_prompt"]))
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
    record("visitor_reuse_before_and_after_8_sessionless_calls", reused)
    # A turn reuses the previous prompt but for the template's tail (its answer is rendered anew): as much after the
    # burst as without it. Evicted, it would reuse the public prefix only.
    tail = reused[0][1] - reused[1][0]
    assert 0 <= tail < 16 and reused[2][0] == reused[1][1] - tail, f"the burst cost the visitor its cache: {reused}"


HONEST = "Explain speculative decoding in three sentences, for a reader who knows what a language model is. " * 3
HOSTILE = "速度词语测试漢字鍵盤" * 10


def planned_seconds(gpu_time: dict[str, Any], input_chars: int, max_tokens: int) -> float:
    seconds = gpu_time["base_s"] + input_chars / gpu_time["chars_per_token"] / (gpu_time["prefill_tok_s"] *
                                                                                  gpu_time["safety"])  # fmt: skip
    return seconds + max_tokens / (gpu_time["decode_tok_s"]["speculative"] * gpu_time["safety"])


def test_a_session_less_flood_moves_the_estimate_by_less_than_a_fifth(server: RunningApp) -> None:
    """Five honest clients, then 32 session-less calls of one client."""
    for number in range(5):
        honest_call = raw_call(server.url, "generate", raw_body(chat_args(HONEST, max_tokens=64)),
                               local_address=f"127.0.0.{number + 2}")  # fmt: skip
        assert honest_call.event == "complete" and honest_call.data[1]["n_generated"] == 64
    honest = planned_seconds(Client(server.url, verbose=False).predict(api_name="/info")["gpu_time"], len(HONEST), 512)
    hostile = raw_body(chat_args(HOSTILE, max_tokens=64, temperature=2.0, draft_length="auto"))
    lock = threading.Lock()
    done: list[str] = []

    def one(_: int) -> None:
        result = raw_call(server.url, "generate", hostile)
        with lock:
            done.append(result.event)

    with ThreadPoolExecutor(8) as pool:  # 32 calls, as many at once as one client may queue
        list(pool.map(one, range(32)))
    after = planned_seconds(Client(server.url, verbose=False).predict(api_name="/info")["gpu_time"], len(HONEST), 512)
    moved = abs(after - honest) / honest
    record("estimate_after_32_sessionless_calls", {"honest_s": round(honest, 2), "after_s": round(after, 2),
                                                   "moved_percent": round(100 * moved, 1),
                                                   "completed": done.count("complete")})  # fmt: skip
    assert done.count("complete") == 32, done
    assert moved <= 0.20, (honest, after)


def streamed_bytes(server: RunningApp, max_tokens: int) -> tuple[int, int, int]:
    """Bytes of a /chat answer's result stream over plain HTTP and over the queue's stream (what gradio_client
    reads), and the tokens it wrote. Heartbeats are not counted: they keep a stream's traffic up while its answer
    runs, so they follow its time, not its length (see dflash_runtime.space.web.probes)."""
    args = chat_args("Tell me a long story about the sea.", max_tokens=max_tokens, draft_length="auto")
    with httpx.Client(timeout=300) as http:
        event_id = post_call(server, "chat", args).json()["event_id"]
        raw, n_generated, event = 0, 0, ""
        with http.stream("GET", api(server, f"call/chat/{event_id}")) as stream:
            for line in stream.iter_lines():
                event = line.split(":", 1)[1].strip() if line.startswith("event:") else event
                raw += len(line) + 1 if event != "heartbeat" else 0
                if line.startswith("data:") and '"n_generated"' in line:  # the totals: on the last item
                    n_generated = json.loads(line[5:])[1].get("n_generated", n_generated)
        session = f"bytes-{max_tokens}"
        queued = 0
        assert join(server, dependency_ids(server)["chat"], api_values(args), session).status_code == 200
        with http.stream("GET", api(server, f"queue/data?session_hash={session}")) as stream:
            for line in stream.iter_lines():
                queued += len(line) + 1 if not line.startswith('data: {"msg": "heartbeat"') else 0
                if '"close_stream"' in line:
                    break
    return raw, queued, n_generated


def test_chat_streams_grow_linearly_with_the_answer(server: RunningApp) -> None:
    short_raw, short_queued, short_tokens = streamed_bytes(server, 512)
    long_raw, long_queued, long_tokens = streamed_bytes(server, 2048)
    record("chat_stream_bytes", {"tokens": [short_tokens, long_tokens], "raw_http": [short_raw, long_raw],
                                 "queue_stream": [short_queued, long_queued]})  # fmt: skip
    assert (short_tokens, long_tokens) == (512, 2048), "the demo's answers run to max_tokens"
    assert long_raw <= 5 * short_raw and long_queued <= 5 * short_queued


def test_a_chat_stream_rebuilds_the_answer_of_generate(server: RunningApp) -> None:
    """/chat's items carry what each step added: joined, they are /generate's answer, and their runs cover them."""
    client = Client(server.url, verbose=False)
    items = [tuple(item) for item in client.submit(**chat_args("hello there", max_tokens=64), api_name="/chat")]
    text = "".join(delta for delta, _ in items)
    assert text == generate(client, "hello there", max_tokens=64)[0]
    for delta, stats in items:
        assert sum(n for n, _ in stats["source_runs"]) == len(delta)
    assert items[-1][1]["n_generated"] == 64 and items[-1][1]["finish_reason"] == "length"


def test_a_message_too_long_is_refused_one_way_whichever_check_catches_it(server: RunningApp) -> None:
    """40,000 characters (over the server's 32,000) and 27,000 (under it, but more tokens than the context holds):
    the same title and the same wording, which says what to shorten."""
    refusals = {}
    for chars in (40_000, 27_000):
        message = ("word " * chars)[:chars]
        result = raw_call(server.url, "generate", raw_body(chat_args(message, max_tokens=8)))
        assert result.event == "error", result
        refusals[chars] = result.data
    record("too_long_refusals", refusals)
    for refusal in refusals.values():
        assert refusal["title"] == "MessageTooLong", refusal
        assert refusal["error"].startswith("the message is too long: ")
        assert refusal["error"].endswith(": shorten the message or the system prompt")
    assert "accepts up to 32000" in refusals[40_000]["error"]
    assert "context cannot hold it" in refusals[27_000]["error"]
