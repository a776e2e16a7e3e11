"""A public Space no script can take, through the real server (app.py in the offline demo, four sequences, raw HTTP
and gradio_client): admission keyed to the client (its address as the platform gives it: here `X-Forwarded-For`, as
Hugging Face's proxy sets it, trusted with DFLASH_TRUSTED_PROXY_HOPS=1), never to the session hash a client mints;
every spelling of a join Gradio runs is admitted alike; malformed bodies get 4xx; one client holds no more than its
share of sequences while another waits; the GPU-time estimate and the parked states do not follow one client; /chat
bytes grow linearly; a client that stops reading is noticed. And the parts on their own: client identity, the
engine slot's turns and shares, the parked store's shares by client.

Each case records its figures in test-artifacts/fairness.json."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from space_client import chat_args, info_when, raw_body, reference_engine

from dflash_runtime import SessionPolicy, load_pair
from dflash_runtime.space.gpu_job import client_of_owner, owner_of
from dflash_runtime.space.page.endpoints import API_PARAMETERS
from dflash_runtime.space.web.clients import client_identity
from dflash_runtime.space.web.gate import MAX_DEPTH, Endpoints, Refused, json_body
from dflash_runtime.testing.tiny_models import tiny_pair

N_CTX = 5120
MAX_NEW_TOKENS = 4096
PARALLEL = 4
CLIENT_JOBS = 8  # the server's default (DFLASH_CLIENT_JOBS)
RECORD = REPO_ROOT / "test-artifacts" / "fairness.json"
TIMEOUT_S = 120.0
LONG = chat_args("Tell me a long story about the sea.", max_tokens=MAX_NEW_TOKENS, draft_length="auto")
HONEST = "Explain speculative decoding in three sentences, for a reader who knows what a language model is. " * 3
HOSTILE = "速度词语测试漢字鍵盤" * 12  # dense characters
SYSTEM = "<|im_start|>system\nyou are a helpful assistant.<|im_end|>\n"


def record(name: str, value: Any) -> None:
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    figures[name] = value
    RECORD.write_text(json.dumps(figures, indent=2, sort_keys=True))


# -- the parts on their own ------------------------------------------------------------------------------------------


def test_a_client_is_its_address_as_the_platform_gives_it() -> None:
    socket_only, behind_proxy = 0, 1
    forwarded = [(b"x-forwarded-for", b"203.0.113.9, 198.51.100.7")]  # the client wrote the first, the proxy the last
    assert client_identity(forwarded, "10.16.0.1", socket_only) == client_identity([], "10.16.0.1", socket_only)
    assert client_identity(forwarded, "10.16.0.1", behind_proxy).source == "forwarded"
    spoofed = [(b"x-forwarded-for", b"192.0.2.1, 198.51.100.7")]
    assert client_identity(spoofed, "10.16.0.2", behind_proxy) == client_identity(forwarded, "10.16.0.1", behind_proxy)
    assert client_identity(forwarded, "10.16.0.1", 2) != client_identity(forwarded, "x", behind_proxy)
    assert client_identity([], "10.16.0.1", behind_proxy).source == "socket", "no header: the socket's peer"
    one_host = [client_identity([], f"2001:db8:1:2::{n}", socket_only) for n in (1, 2)]
    assert one_host[0] == one_host[1] and one_host[0] != client_identity([], "2001:db8:1:3::1", socket_only)
    assert client_identity([], None, socket_only).source == "none"
    assert "198.51.100.7" not in client_identity(forwarded, "10.16.0.1", behind_proxy).key


def test_the_proxys_hop_is_one_client_whatever_shape_the_header_takes() -> None:
    """Behind the proxy: several headers count as one list in order, spaces and empty hops are nothing, a port or an
    IPv6 address's brackets name the same client, and only the proxy's own (last) hop counts."""
    behind_proxy = 1

    def key(*values: str) -> str:
        return client_identity([(b"x-forwarded-for", v.encode()) for v in values], "10.16.0.1", behind_proxy).key

    ipv4 = key("198.51.100.7")
    assert ipv4 == key("203.0.113.9,198.51.100.7") == key(" 203.0.113.9 ,  198.51.100.7 ") == key("198.51.100.7:4711")
    assert ipv4 == key("203.0.113.9", "198.51.100.7") == key("1.2.3.4, 5.6.7.8", " 198.51.100.7:80 ")
    assert ipv4 == key("x, ,198.51.100.7")
    assert ipv4 != key("198.51.100.7", "203.0.113.9") and ipv4 != key("198.51.100.8")
    ipv6 = key("2001:db8:5:6::1")
    assert ipv6 == key("[2001:db8:5:6::1]") == key("[2001:db8:5:6::1]:443") == key("192.0.2.1, [2001:db8:5:6::2]:8443")
    assert ipv6 == key('"[2001:db8:5:6::3]:1"') and ipv6 != key("2001:db8:5:7::1")
    assert key("::ffff:198.51.100.7") == ipv4, "an IPv4-mapped address is its IPv4 client"
    headers = [(b"X-Forwarded-For", b"192.0.2.1"), (b"x-forwarded-for", b"198.51.100.7")]
    assert client_identity(headers, "10.16.0.1", behind_proxy).key == ipv4, "header names in any case"
    assert client_identity(headers, "10.16.0.1", 0).source == "socket"


def test_bodies_are_read_as_gradio_reads_them() -> None:
    endpoints = Endpoints({}, inputs={12: ()})
    assert [endpoints.function({"fn_index": value}) for value in ("12", 12.0, 12)] == [12, 12, 12]
    for value in ("twelve", 12.5, [12], None, 13):
        with pytest.raises(Refused, match="fn_index must name one of the app's functions"):
            endpoints.function({"fn_index": value})
    for nested in (b"[" * 50_000 + b"]" * 50_000, b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)):
        with pytest.raises(Refused, match="nested too deeply"):
            json_body(nested)
    assert json_body(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert json_body(b"not json") is None


def test_one_client_opening_many_sessions_evicts_only_its_own_parked_states() -> None:
    pair = tiny_pair("dense", "dflash2")
    policy = SessionPolicy(max_parked=4, park_on_switch=False, group_of=client_of_owner, per_group=2)
    with load_pair(pair.target, pair.draft, n_ctx=1024, sessions=policy) as engine:
        victim = owner_of("v", "1")
        owners = [victim, *(owner_of("a", str(n)) for n in range(8))]
        prompts = {owner: engine.tokenize(f"{SYSTEM}{owner} one two three four") for owner in owners}
        for owner in owners:
            engine.generate(prompts[owner], max_tokens=4, cache_owner=owner)
            engine.park(owner)
        assert engine.info()["sessions"]["parked"] == 3, "the victim's and the attacker's two newest"
        engine.generate(prompts[victim], max_tokens=1, cache_owner=owner_of("x", "1"))  # the live sequence moves on
        kept = {owner: engine.generate(prompts[owner], max_tokens=4, cache_owner=owner).stats.n_reused > 0
                for owner in owners}  # fmt: skip
    assert kept[victim] and [kept[o] for o in owners[1:]] == [False] * 6 + [True, True], kept


# -- through the running app -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
           "DFLASH_PARALLEL": str(PARALLEL), "DFLASH_TRUSTED_PROXY_HOPS": "1"}  # fmt: skip
    with running_app(env, REPO_ROOT / "test-artifacts" / "space_fairness_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def monitor(server: RunningApp) -> Client:
    return Client(server.url, verbose=False, headers={"X-Forwarded-For": "10.0.0.254"})


class Visitor:
    """One client (its address, as the proxy would forward it) over raw HTTP."""

    def __init__(self, server: RunningApp, address: str) -> None:
        self.http = httpx.Client(base_url=server.url.rstrip("/") + "/gradio_api/", timeout=TIMEOUT_S,
                                 headers={"X-Forwarded-For": address})  # fmt: skip

    def post(self, endpoint: str, args: dict[str, Any], session: str | None = None) -> httpx.Response:
        body = json.loads(raw_body(args))
        if session is not None:
            body["session_hash"] = session
        return self.http.post("call/" + endpoint, json=body)

    def join(self, fn_index: Any, args: dict[str, Any], session: str) -> httpx.Response:
        body = {"data": [args[name] for name in API_PARAMETERS], "fn_index": fn_index, "session_hash": session,
                "event_data": None, "trigger_id": None}  # fmt: skip
        return self.http.post("queue/join", json=body)

    def result(self, endpoint: str, event_id: str) -> tuple[str, Any, int]:
        """Read a call's result stream to its end: (event, data, bytes read)."""
        event, size = "", 0
        with self.http.stream("GET", f"call/{endpoint}/{event_id}") as stream:
            for line in stream.iter_lines():
                size += len(line) + 1
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    return event, json.loads(line[5:]), size
        raise AssertionError("the result stream ended without a result")

    def call(self, endpoint: str, args: dict[str, Any], session: str | None = None) -> tuple[str, Any, int]:
        posted = self.post(endpoint, args, session)
        posted.raise_for_status()
        return self.result(endpoint, posted.json()["event_id"])


def dependency_ids(server: RunningApp) -> dict[str, int]:
    config = httpx.get(server.url.rstrip("/") + "/config", timeout=30).json()
    return {dep["api_name"]: dep["id"] for dep in config["dependencies"] if dep.get("api_name")}


def idle(monitor: Client) -> None:
    info_when(monitor, "idle", timeout_s=TIMEOUT_S)


def test_one_clients_calls_move_none_of_the_shared_figures(server: RunningApp, monitor: Client) -> None:
    """A fresh Space: one visitor's dense CJK message moves none of /info's figures (characters per token, speeds,
    answers counted), and neither do session-less calls from three more addresses (they teach nothing)."""
    before = gpu_figures(monitor)
    assert not any(before["answers_counted"].values()), "a fresh Space: this test is the module's first on it"
    cjk = chat_args(HOSTILE * 4, max_tokens=32)
    assert Visitor(server, "10.8.0.1").call("generate", cjk, session="one-visitor")[0] == "complete"
    for n in range(3):
        assert Visitor(server, f"10.8.0.{n + 2}").call("generate", cjk)[0] == "complete"
    after = gpu_figures(monitor)
    record("one_client_moves_no_figure", {"before": before, "after": after})
    assert after == before


def test_every_join_gradio_would_run_is_admitted_and_limited_alike(server: RunningApp, monitor: Client) -> None:
    """`fn_index` as "12", 12.0 and 12: each is counted against the client's limit (fresh sessions change nothing),
    and none of them, never read, outlives its reader timeout by much."""
    chat = dependency_ids(server)["chat"]
    visitor = Visitor(server, "10.1.0.1")
    spellings = [str(chat), float(chat), chat]
    posted = [visitor.join(spellings[n % 3], LONG, f"join-{n}") for n in range(CLIENT_JOBS + 3)]
    last_posted = time.monotonic()
    codes = [response.status_code for response in posted]
    record("join_spellings_status", codes)
    assert codes == [200] * CLIENT_JOBS + [429] * 3, [r.text[:200] for r in posted]
    assert f"you have {CLIENT_JOBS} answers queued or running" in posted[-1].json()["detail"]
    idle(monitor)
    stopped_s = time.monotonic() - last_posted
    record("unread_joins_stopped_s", round(stopped_s, 2))
    assert stopped_s < 5.0
    assert Visitor(server, "10.1.0.1").join(str(chat), LONG, "join-after").status_code == 200, "their places are free"
    idle(monitor)


def test_malformed_bodies_get_4xx_and_errors_quote_only_an_excerpt(server: RunningApp, monitor: Client) -> None:
    visitor = Visitor(server, "10.1.0.2")
    nested = b"[" * 50_000 + b"]" * 50_000
    statuses = {}
    for route in ("queue/join", "call/chat", "call/generate", "run/wait", "run/info", "call/wait"):
        response = visitor.http.post(route, content=b'{"data": ' + nested + b"}",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        statuses[route] = response.status_code
        assert response.status_code == 400 and len(response.content) < 300, (route, response.text[:300])
    for fn_index in (-1, 999, None, "twelve"):
        response = visitor.join(fn_index, LONG, "bad-fn-index")
        statuses[f"fn_index={fn_index!r}"] = response.status_code
        assert 400 <= response.status_code < 500 and "Traceback" not in response.text, (fn_index, response.text)
    for values in ([], ["idle"], ["soon", 5], ["idle", "x" * 500_000], ["idle", True]):
        response = visitor.http.post("run/wait", json={"data": values})
        statuses[f"/run/wait {str(values)[:20]}"] = response.status_code
        assert response.status_code == 422 and len(response.content) < 400, (values, response.text[:400])
    event, data, _ = visitor.call("generate", chat_args("hi", method="x." * 250_000, max_tokens=4))
    record("malformed_status", {**statuses, "huge_method_error_chars": len(str(data))})
    assert event == "error" and len(str(data)) < 1000, str(data)[:300]
    assert "Traceback" not in server.log()
    idle(monitor)


def malformed_requests(server: RunningApp) -> list[tuple[str, str, Any]]:
    """About 150 malformed requests over every route: (method, path below the server, JSON value or raw bytes). Each
    of the page's functions is called with one value too many and, where it has a slider, with "hot" for a number."""
    config = httpx.get(server.url.rstrip("/") + "/config", timeout=30).json()
    kinds = {component["id"]: component.get("type") for component in config["components"]}
    api = [LONG[name] for name in API_PARAMETERS]
    cases: list[tuple[str, str, Any]] = []
    for name in ("nosuch", "..%2f", "respond", "submit", "compare", "wait", "chat", "generate"):
        cases += [("POST", f"/gradio_api/call/{name}", body) for body in ({"data": []}, b"not json", {"data": "x"},
                                                                           {"data": [], "session_hash": "s" * 200})]
    cases += [("POST", "/gradio_api/call/chat", {"data": api, "session_hash": bad}) for bad in (5, [], "s" * 129)]
    cases += [("POST", "/gradio_api/call/info", {"data": [1]}), ("POST", "/gradio_api/call/v2/nosuch", {}),
              ("POST", "/gradio_api/call/v2/chat", b"nope"), ("GET", "/gradio_api/call/v2/chat/zz", None)]
    for name in ("chat", "nosuch", "info"):
        cases += [("GET", f"/gradio_api/call/{name}/{event}", None) for event in ("0123456789abcdef", "zz", "a" * 300)]
    cases += [("GET", f"/gradio_api/queue/data?session_hash={session}", None)
              for session in ("abc", "", "x" * 3000, "../../etc", "é", "%00", "a%20b", "%3Cscript%3E", "1" * 40)]
    for dep in config["dependencies"]:
        inputs = [kinds.get(i) for i in dep["inputs"]]
        route = "/gradio_api/queue/join" if dep.get("queue") is not False else "/gradio_api/run/predict"
        datas = [[None] * (len(inputs) + 1)] + ([api[:-1]] if "api" in inputs else [])
        if "slider" in inputs:
            datas.append(["hot" if kind == "slider" else None for kind in inputs])
        cases += [("POST", route, {"data": data, "fn_index": dep["id"], "session_hash": "fz", "event_data": None,
                                   "trigger_id": None}) for data in datas]  # fmt: skip
    chat = next(dep["id"] for dep in config["dependencies"] if dep.get("api_name") == "chat")
    for route in ("/gradio_api/queue/join", "/gradio_api/run/predict"):
        cases += [("POST", route, {"data": [], "fn_index": fn, "session_hash": "fz"}) for fn in (999, -1, "x", None)]
    cases += [("POST", "/gradio_api/queue/join", {"data": api, "fn_index": chat, "session_hash": bad,
                                                   "event_data": None, "trigger_id": None})
              for bad in ("s" * 5000, "s" * 129, "", 5, [])]  # fmt: skip
    cases.append(("POST", "/gradio_api/run/predict", {"data": [True], "fn_index": next(
        dep["id"] for dep in config["dependencies"] if [kinds.get(i) for i in dep["inputs"]] == ["checkbox"]),
        "session_hash": "s" * 5000}))  # fmt: skip
    runs = {"nosuch": ([], ["x"]), "chat": ([], ["x"]), "wait": ([], ["idle", "x"]), "info": (["x"],)}
    cases += [("POST", f"/gradio_api/{way}/{name}", {"data": data}) for name, datas in runs.items() for data in datas
              for way in ("run", "api")]  # `api/` is `run/`'s twin in Gradio's routes
    cases += [("POST", "/gradio_api/cancel", b"[]"), ("POST", "/gradio_api/upload", b"x")]
    for body in ({}, {"messages": "x"}, {"messages": [{"role": "user"}]}, b"{", {"messages": [], "max_tokens": "x"},
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, {"prompt": 5}, [],
                 {"messages": [{"role": "system", "content": "s"}]}, {"messages": [{"role": "user", "content": 5}]}):
        cases += [("POST", "/v1/chat/completions", body), ("POST", "/v1/completions", body)]
    return [*cases, ("GET", "/v1/nosuch", None), ("POST", "/v1/nosuch", {})]


def test_every_malformed_request_gets_a_short_4xx_in_its_routes_shape(server: RunningApp, monitor: Client) -> None:
    """~150 malformed requests over every route (unknown endpoints and events, a random session's queue stream,
    wrong numbers or kinds of values, page functions called with temperature "hot", 5,000-character session hashes,
    bad /v1 bodies): each answered 4xx in its route's own shape (Gradio's `detail`, OpenAI's `error`), with at most
    one log line of at most 300 bytes each: no traceback, no 5xx, no `error: null`."""
    quiet(monitor)  # no other answer writes to the log meanwhile
    cases, answers = malformed_requests(server), []
    before = server.log_path.stat().st_size
    with httpx.Client(base_url=server.url.rstrip("/"), timeout=30, headers={"X-Forwarded-For": "10.9.0.1"}) as http:
        for method, path, body in cases:
            content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
            response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
            answers.append((path, response.status_code, response.text))
    quiet(monitor)
    with server.log_path.open("rb") as log:  # (the server's output reaches the file a line at a time, a little later)
        log.seek(before)
        lines = log.read().decode(errors="replace").splitlines()
    record("malformed_requests", {"requests": len(cases), "statuses": sorted({s for _, s, _ in answers}),
                                  "log_lines": len(lines), "longest_log_line": max(map(len, lines), default=0)})
    assert len(cases) >= 140

    def shaped(path: str, status: int, text: str) -> bool:
        said = json.loads(text).get("error" if path.startswith("/v1") else "detail")
        return 400 <= status < 500 and bool(said) and '"error": null' not in text

    wrong = [answer for answer in answers if not shaped(*answer)]
    assert not wrong, wrong[:5]
    assert len(lines) <= len(cases) and max(map(len, lines), default=0) <= 300, lines[:3]
    assert "Traceback" not in server.log()
    idle(monitor)


def quiet(monitor: Client, timeout_s: float = 30.0) -> float:
    """Seconds until no answer is counted or runs (counted = running + queued: 0), polled to a deadline."""
    began = time.monotonic()
    while (info := monitor.predict(api_name="/info"))["places"] or info["running"]:
        assert time.monotonic() - began < timeout_s, f"answers still counted: {info['places']}"
    return time.monotonic() - began


def gpu_figures(monitor: Client) -> dict[str, Any]:
    gpu_time = monitor.predict(api_name="/info")["gpu_time"]
    return {key: gpu_time[key] for key in ("decode_tok_s", "prefill_tok_s", "chars_per_token", "answers_counted")}


class Reading:
    """A /chat result stream read in a thread, to the end or until closed: its items' finish reasons."""

    def __init__(self, visitor: Visitor, event_id: str) -> None:
        self.finish: list[Any] = []
        self.items = 0
        self.first_item = threading.Event()
        self._stop = threading.Event()
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, args=(visitor, event_id), daemon=True)
        self._thread.start()

    def _read(self, visitor: Visitor, event_id: str) -> None:
        try:
            with visitor.http.stream("GET", f"call/chat/{event_id}") as stream:
                self._response = stream
                for line in stream.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("data:") and '"n_generated"' in line:
                        self.items += 1
                        self.first_item.set()
                        # an item sends its finish reason where it changed: null on the first, the reason on the last
                        self.finish.append(json.loads(line[5:])[1].get("finish_reason"))
        except httpx.HTTPError:
            if not self._stop.is_set():
                raise

    def join(self) -> None:
        """Until the stream has ended."""
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive(), "the answer did not end"

    def close(self) -> None:
        self._stop.set()
        if self._response is not None:
            self._response.close()
        self._thread.join(TIMEOUT_S)


def test_one_client_with_twenty_sessions_cannot_hold_the_engine(server: RunningApp, monitor: Client) -> None:
    """20 fresh session hashes from one client, 4096 tokens each, read: beyond its share they are refused, its four
    answers fill the engine, and an honest client's 64-token answer starts within 5 s (one of the attacker's answers
    yields its turn) and completes; the attacker's answers are not cut."""
    attacker, honest = Visitor(server, "10.2.0.1"), Visitor(server, "10.2.0.2")
    posted = [attacker.post("chat", LONG, session=f"attacker-{n}") for n in range(20)]
    codes = [response.status_code for response in posted]
    assert codes.count(200) == CLIENT_JOBS and codes.count(429) == 20 - CLIENT_JOBS, codes
    readings = [Reading(attacker, response.json()["event_id"]) for response in posted if response.status_code == 200]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while monitor.predict(api_name="/info")["running"] < PARALLEL:  # polled to a deadline
            assert time.monotonic() < deadline, "the attacker's answers did not fill the engine"
        yielded_before = monitor.predict(api_name="/info")["turns_yielded"]
        asked = time.monotonic()
        answer = Reading(honest, honest.post("chat", chat_args("one two three", max_tokens=64)).json()["event_id"])
        assert answer.first_item.wait(TIMEOUT_S)
        started_s = time.monotonic() - asked
        answer.join()
        yielded = monitor.predict(api_name="/info")["turns_yielded"] - yielded_before
        ended = [reason for reading in readings for reason in reading.finish if reason is not None]
        record("twenty_sessions_one_client", {"accepted": codes.count(200), "refused": codes.count(429),
                                              "honest_first_item_s": round(started_s, 2),
                                              "attacker_turns_yielded": yielded})  # fmt: skip
        assert started_s < 5.0, f"the honest client waited {started_s:.1f} s"
        assert answer.finish[-1] == "length" and answer.items >= 1
        assert yielded >= 1 and ended == [], ("one of the attacker's answers yielded its turn, none was cut", ended)
    finally:
        for reading in readings:
            reading.close()
    idle(monitor)


class TextReading(Reading):
    """A /chat result stream read in a thread: the text its items added so far, and how it ended."""

    def __init__(self, visitor: Visitor, event_id: str) -> None:
        self.text = ""
        self.ended: str | None = None
        super().__init__(visitor, event_id)

    def _read(self, visitor: Visitor, event_id: str) -> None:
        event = ""
        try:
            with visitor.http.stream("GET", f"call/chat/{event_id}") as stream:
                self._response = stream
                for line in stream.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event in ("generating", "complete"):
                        delta, stats = json.loads(line[5:])
                        self.text += delta
                        self.finish.append(stats.get("finish_reason"))
                    elif line.startswith("data:") and event == "error":
                        self.ended = "error"
        except httpx.HTTPError:
            if not self._stop.is_set():
                raise


@pytest.mark.parametrize("crowd_size", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_a_crowd_takes_turns_and_a_newcomer_is_served_within_seconds(server: RunningApp, monitor: Client,
                                                                     crowd_size: int) -> None:  # fmt: skip
    """8 (or 16) clients each post eight 1,024-token answers and read them (the whole queue, every sequence): another
    client's three 64-token answers, sent one after another, are let in (each takes the place of a crowd answer that
    had not started) and all complete, the median within 15 s (30 s) from the first try to the end, while the crowd's
    answers yield their turns and go on: each streams, as far as it got (its first 600 characters: several turns),
    exactly the text it gives alone at temperature 0. Once the crowd has gone, every place is free again."""
    message = "Tell me a long story about the sea."
    crowd = [Visitor(server, f"10.7.{crowd_size}.{n + 1}") for n in range(crowd_size)]
    readings: list[TextReading] = []
    started = time.monotonic()
    try:
        for n, visitor in enumerate(crowd):
            for k in range(CLIENT_JOBS):
                posted = visitor.post("chat", chat_args(message, max_tokens=1024), session=f"crowd-{n}-{k}")
                assert posted.status_code in (200, 429), posted.text
                if posted.status_code == 200:
                    readings.append(TextReading(visitor, posted.json()["event_id"]))
        deadline = time.monotonic() + TIMEOUT_S
        while monitor.predict(api_name="/info")["running"] < PARALLEL:  # polled to a deadline
            assert time.monotonic() < deadline, "the crowd's answers did not fill the engine"
        newcomer = Visitor(server, f"10.7.{crowd_size}.99")

        def served(n: int) -> tuple[str, float, int]:
            tried = time.monotonic()
            event, (_, stats), _ = newcomer.call("chat", chat_args(f"one two three {n}", max_tokens=64),
                                                 session=f"newcomer-{n}")  # fmt: skip
            return event, time.monotonic() - tried, stats.get("n_generated", 0)

        answers = [served(n) for n in range(3)]  # one message after another, as a visitor sends them
        seconds = sorted(s for _, s, _ in answers)
        yielded = monitor.predict(api_name="/info")["turns_yielded"]
    finally:
        for reading in readings:
            reading.close()
    freed_s = every_place_free(server, monitor)
    lengths = sorted(len(reading.text) for reading in readings)
    record(f"crowd_of_{crowd_size}_and_a_newcomer", {
        "newcomer_seconds": [round(s, 2) for s in seconds], "turns_yielded": yielded, "crowd_posted": len(readings),
        "crowd_chars_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "crowd_places_taken": sum(reading.ended == "error" for reading in readings), "all_places_free_after_s":
        round(freed_s, 2), "test_s": round(time.monotonic() - started, 1)})  # fmt: skip
    assert [(event, tokens) for event, _, tokens in answers] == [("complete", 64)] * 3, answers
    assert seconds[1] <= (15.0 if crowd_size == 8 else 30.0), f"the newcomer's answers took {seconds} s"
    assert yielded >= 3 and sum(reading.ended == "error" for reading in readings) >= 1, "turns yielded, a place taken"
    assert_as_alone(message, readings)


def assert_as_alone(message: str, readings: list[TextReading]) -> None:
    """Each reading's text, as far as it got, is the answer the engine gives alone at temperature 0."""
    with reference_engine(N_CTX) as reference:
        expected = ""
        longest = min(600, max(len(reading.text) for reading in readings))
        for event in reference.stream_chat([{"role": "user", "content": message}], enable_thinking=False,
                                           max_tokens=1024, temperature=0.0):  # fmt: skip
            expected += event.delta
            if len(expected) >= longest:
                break
    wrong = [reading.text[:80] for reading in readings
             if not (expected.startswith(reading.text) or reading.text.startswith(expected))]  # fmt: skip
    assert not wrong and max(len(reading.text) for reading in readings) > 0, wrong


def every_place_free(server: RunningApp, monitor: Client) -> float:
    """Once every reader has gone: the seconds until no answer is counted any more (counted = running + queued: 0),
    after which fresh clients take all the places there are (DFLASH_TOTAL_JOBS, 64)."""
    freed_s = quiet(monitor)
    fresh = [Visitor(server, f"10.11.0.{n + 1}") for n in range(8)]
    posted = [visitor.post("chat", chat_args("hello", max_tokens=4), session=f"fresh-{n}-{k}")
              for n, visitor in enumerate(fresh) for k in range(CLIENT_JOBS)]  # fmt: skip
    assert [response.status_code for response in posted] == [200] * 64, [r.text[:120] for r in posted if r.is_error]
    idle(monitor)
    return freed_s


def honest_answer(visitor: Visitor, n: int) -> tuple[float, float]:
    """An honest 64-token /chat answer: seconds from its POST to its first item, and to its end."""
    posted = time.monotonic()
    reading = Reading(visitor, visitor.post("chat", chat_args(f"one two three {n}", max_tokens=64),
                                            session=f"honest-long-{n}").json()["event_id"])  # fmt: skip
    assert reading.first_item.wait(TIMEOUT_S)
    first = time.monotonic() - posted
    reading.join()
    assert reading.finish[-1] == "length"
    return first, time.monotonic() - posted


def test_long_prompts_take_turns_with_a_short_answer(server: RunningApp, monitor: Client) -> None:
    """Four addresses keep sending 4,800-character messages (about 3,000 tokens each, max_tokens 4), each within
    every limit: their prefills run in chunks that yield like steps, so an honest 64-token answer's first item comes
    within 3 s of its POST and the whole answer within 4 times its time alone."""
    honest = Visitor(server, "10.12.0.99")
    alone = [honest_answer(honest, n) for n in range(2)][-1]  # the second: the engine warm
    long_message = " ".join(f"word{n} of the long sea story" for n in range(700))[:4800]
    stop = threading.Event()

    def keep_sending(n: int) -> int:
        visitor, sent = Visitor(server, f"10.12.0.{n + 1}"), 0
        while not stop.is_set():
            event, _, _ = visitor.call("chat", chat_args(long_message, max_tokens=4), session=f"long-{n}-{sent}")
            assert event == "complete", event
            sent += 1
        return sent

    with ThreadPoolExecutor(4) as pool:
        senders = [pool.submit(keep_sending, n) for n in range(4)]
        try:
            info_when(monitor, "busy", timeout_s=TIMEOUT_S)
            crowded = [honest_answer(honest, n) for n in range(2, 5)]
        finally:
            stop.set()
        sent = [sender.result(timeout=TIMEOUT_S) for sender in senders]
    first, whole = sorted(c[0] for c in crowded)[1], sorted(c[1] for c in crowded)[1]  # medians of three
    record("long_prompts_and_an_honest_answer", {"alone_s": [round(t, 2) for t in alone], "long_prompts_sent": sent,
                                                 "crowded_first_item_s": [round(c[0], 2) for c in crowded],
                                                 "crowded_whole_s": [round(c[1], 2) for c in crowded]})  # fmt: skip
    assert first <= 3.0, f"the honest answer's first item came after {first:.1f} s"
    assert whole <= 4 * alone[1], f"the honest answer took {whole:.1f} s, {alone[1]:.1f} s alone"
    idle(monitor)


def planned_seconds(gpu_time: dict[str, Any], input_chars: int, max_tokens: int) -> float:
    seconds = gpu_time["base_s"] + input_chars / gpu_time["chars_per_token"] / (gpu_time["prefill_tok_s"] *
                                                                                  gpu_time["safety"])  # fmt: skip
    return seconds + max_tokens / (gpu_time["decode_tok_s"]["speculative"] * gpu_time["safety"])


def test_many_clients_hostile_calls_do_not_move_the_gpu_time(server: RunningApp, monitor: Client) -> None:
    """Three honest clients, then 20 hostile calls (600 CJK characters, temperature 2, draft length 7), one from each
    of 20 addresses (each a client, outvoting the honest ones): the default request's and a 2,048-token request's
    durations move ≤ 20 % (each figure follows its clients' median at a pace bounded by the work behind it)."""
    for number in range(3):
        event, (_, stats), _ = Visitor(server, f"10.3.0.{number + 1}").call(
            "generate", chat_args(HONEST, max_tokens=64, draft_length="auto"), session=f"honest-{number}")
        assert event == "complete" and stats["n_generated"] == 64
    before = monitor.predict(api_name="/info")["gpu_time"]
    hostile = chat_args(HOSTILE, max_tokens=64, temperature=2.0, draft_length=7)
    with ThreadPoolExecutor(4) as pool:
        events = list(pool.map(lambda n: Visitor(server, f"10.3.1.{n + 1}").call("generate", hostile,
                                                                                 session=f"hostile-{n}")[0],
                               range(20)))  # fmt: skip
    after = monitor.predict(api_name="/info")["gpu_time"]
    moved = {tokens: abs(planned_seconds(after, len(HONEST), tokens) - planned_seconds(before, len(HONEST), tokens))
             / planned_seconds(before, len(HONEST), tokens) for tokens in (512, 2048)}  # fmt: skip
    record("estimate_after_20_clients_hostile_calls", {
        "moved_percent": {k: round(100 * v, 1) for k, v in moved.items()}, "before": before["decode_tok_s"],
        "after": after["decode_tok_s"], "completed": events.count("complete")})  # fmt: skip
    assert events.count("complete") == 20, events
    assert max(moved.values()) <= 0.20, moved


def test_a_crowds_calls_leave_a_conversation_in_use_parked(server: RunningApp, monitor: Client) -> None:
    """A visitor's conversation in use (its second turn reused the first): eight clients' one-token calls of fresh
    sessions, two each, fill the parked store twice over; the visitor's third turn reuses its whole conversation (its
    sequence was taken meanwhile: its state was parked, and kept)."""
    visitor = Visitor(server, "10.4.0.1")
    crowd = [Visitor(server, f"10.4.1.{n + 1}") for n in range(8)]

    def burst(tag: str) -> None:
        for n, client in enumerate(crowd):
            for k in range(2):
                assert client.call("generate", chat_args(f"burst {n} {k}", max_tokens=1),
                                   session=f"{tag}-{n}-{k}")[0] == "complete"  # fmt: skip

    message = "Tell me about the sea, the mountains and the sky, at length. " * 8
    _, (text, first), _ = visitor.call("generate", chat_args(message, max_tokens=24), session="visitor")
    history = [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
    _, (text, second), _ = visitor.call("generate", chat_args("And tomorrow?", history=history, max_tokens=8),
                                        session="visitor")  # fmt: skip
    history += [{"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": text}]
    burst("after")
    _, (_, third), _ = visitor.call("generate", chat_args("And then?", history=history, max_tokens=8),
                                    session="visitor")  # fmt: skip
    record("parking_after_16_one_token_calls_of_8_clients", {"prompts": [first["n_prompt"], second["n_prompt"]],
                                                             "reused": [second["n_reused"], third["n_reused"]]})
    assert second["n_reused"] >= first["n_prompt"] - 16, "the conversation is in use"
    assert third["n_reused"] >= second["n_prompt"] - 16, (second["n_prompt"], third["n_reused"])


def chat_bytes(visitor: Visitor, max_tokens: int) -> tuple[int, int, int]:
    """A /chat answer's result stream over plain HTTP: the bytes of its events but heartbeats (the answer's items),
    all its bytes (with the heartbeats that keep a stream's traffic up while its answer runs: they follow the time
    it takes, see probes.py), and its tokens."""
    args = chat_args("Tell me a long story about the sea.", max_tokens=max_tokens, temperature=2.0, draft_length=7)
    event_id = visitor.post("chat", args).json()["event_id"]
    items = total = 0
    event, data = "", None
    with visitor.http.stream("GET", f"call/chat/{event_id}") as stream:
        for line in stream.iter_lines():
            total += len(line) + 1
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            if event != "heartbeat":
                items += len(line) + 1
            if line.startswith("data:") and event == "complete":
                data = json.loads(line[5:])
                break
    assert data is not None, "the stream ended without the answer"
    return items, total, data[1]["n_generated"]


def test_chat_bytes_grow_linearly_with_the_answer(server: RunningApp) -> None:
    visitor = Visitor(server, "10.5.0.1")
    short_items, short_total, short_tokens = chat_bytes(visitor, 512)
    long_items, long_total, long_tokens = chat_bytes(visitor, 4096)
    record("chat_bytes_512_4096", {"tokens": [short_tokens, long_tokens], "items_bytes": [short_items, long_items],
                                   "all_bytes": [short_total, long_total]})  # fmt: skip
    assert (short_tokens, long_tokens) == (512, 4096)
    assert long_total <= 9 * short_total, (short_total, long_total)  # the padding follows the items' bytes
    # Linear: 8 times the tokens, at most 8 times the bytes (each item carries what its step changed: the running
    # totals' digits stay out; the quadratic stream cost 5.4 times as much per token at 4096 as at 512, and items
    # with the totals 1.01 times, 8.1 times the bytes in all).
    assert long_items <= 8 * short_items, (short_items, long_items)


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_a_connected_client_that_stops_reading_is_noticed(server: RunningApp, monitor: Client, endpoint: str) -> None:
    """The client keeps its connection but reads nothing more (/chat: after two items; /generate: after the
    response's head): its answer stops within 10 s."""
    visitor = Visitor(server, "10.6.0.1")
    event_id = visitor.post(endpoint, LONG).json()["event_id"]
    with visitor.http.stream("GET", f"call/{endpoint}/{event_id}") as stream:
        if endpoint == "chat":
            lines = stream.iter_lines()
            items = 0
            while items < 2:
                items += next(lines).startswith("data:")
        else:
            info_when(monitor, "busy", timeout_s=TIMEOUT_S)
        stopped_reading = time.monotonic()
        idle(monitor)
        seconds = time.monotonic() - stopped_reading
    record(f"stopped_reading_{endpoint}_noticed_s", round(seconds, 2))
    assert seconds < 10.0, f"the answer ran {seconds:.1f} s for a client that read nothing"
