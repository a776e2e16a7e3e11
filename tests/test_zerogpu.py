"""ZeroGPU as it really runs, on a CPU: app.py with SPACES_ZERO_GPU=true and the real `spaces` package, which forks a
GPU worker from the web process and schedules it through a local fake of the ZeroGPU device API; the offline demo's
tiny models stand in for the pair. Plus the fail-fast path: a CPU-only build on ZeroGPU does not download the pair;
and what `spaces` does with two GPU calls at once (two worker processes: why ZeroGPU serves one answer at a time)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, FakeHub, RunningApp, launch_app, running_app, stop_app
from gradio_client import Client
from gradio_client.exceptions import AppError
from space_client import (
    chat_args,
    expected_answer,
    info_when,
    raw_body,
    raw_call,
    reference_engine,
    stream_chat,
    take_outputs,
)
from zerogpu_fake import FakeDeviceApi

from dflash_runtime.space.setup.runmode import FIX_COMMAND

ARTIFACTS = REPO_ROOT / "test-artifacts"
N_CTX = 1024
MAX_NEW_TOKENS = 400
# Slow starting estimates, so that what the measurements change shows in the durations asked for.
GPU_TIME_ENV = {"DFLASH_GPU_LOAD_SECONDS": "20", "DFLASH_GPU_DECODE_TOK_S": "4", "DFLASH_GPU_SECONDS_BASE": "1"}


@pytest.fixture(scope="module")
def device_api() -> Iterator[FakeDeviceApi]:
    fake = FakeDeviceApi().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def server(device_api: FakeDeviceApi, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    env = {
        "DFLASH_DEMO": "tiny",
        "DFLASH_N_CTX": str(N_CTX),
        "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
        **GPU_TIME_ENV,
        "DFLASH_DIAGNOSTICS": "1",  # /info shows the worker and the web process
        **device_api.env(tmp_path_factory.mktemp("zerogpu") / "cgroup"),
    }
    with running_app(env, ARTIFACTS / "app_zerogpu_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def client(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    with reference_engine(N_CTX) as engine:
        yield engine


def info(client: Client) -> dict[str, Any]:
    return client.predict(api_name="/info")


def answer(reference: Any, message: str, max_tokens: int) -> str:
    return expected_answer(reference, [{"role": "user", "content": message}], max_tokens)


def planned_seconds(gpu_time: dict[str, Any], input_chars: int, max_tokens: int) -> int:
    """The duration a one-phase speculative request gets, from /info's estimates (the documented formula)."""
    seconds = gpu_time["base_s"] + (gpu_time["load_s"] if gpu_time["worker_may_be_new"] else 0.0)
    seconds += input_chars / gpu_time["chars_per_token"] / (gpu_time["prefill_tok_s"] * gpu_time["safety"])
    seconds += max_tokens / (gpu_time["decode_tok_s"]["speculative"] * gpu_time["safety"])
    return max(gpu_time["seconds_min"], min(gpu_time["seconds_max"], math.ceil(seconds)))


def test_three_chats_in_a_row_build_the_engine_once_and_ask_for_the_estimated_time(
    client: Client, device_api: FakeDeviceApi, reference: Any
) -> None:
    start = info(client)
    assert start["worker"] == {} and start["gpu_time"]["zero_gpu"] is True
    assert start["gpu_time"]["worker_may_be_new"] is True
    assert start["parallel"] == 1, "DFLASH_PARALLEL=auto on ZeroGPU: one answer at a time (see the test below)"
    workers, asked, new_worker = [], [], []
    for number, message in enumerate(["hello world", "the quick brown fox", "one two three four"], start=1):
        before = info(client)["gpu_time"]
        new_worker.append(before["worker_may_be_new"])
        text, stats = stream_chat(client, **chat_args(message, max_tokens=64))[-1]
        assert text == answer(reference, message, 64)
        schedule = device_api.of("/schedule")[-1]
        asked.append(int(schedule.params["durationSeconds"]))
        assert asked[-1] == stats["gpu_seconds_requested"] == planned_seconds(before, len(message), 64)
        assert 0 < stats["gpu_seconds_used"] < asked[-1]
        worker = info(client)["worker"]
        assert worker["requests"] == number and worker["loaded_now"] is (number == 1)
        workers.append((worker["pid"], worker["loads"]))
    web_pid = info(client)["web_process"]["pid"]
    assert len(set(workers)) == 1 and workers[0][1] == 1 and workers[0][0] != web_pid, workers
    assert len(device_api.of("/allow")) == 1, "one worker, allowed once"
    assert [call.params["fail"] for call in device_api.of("/release")] == ["false"] * 3
    # The first request planned a model load at the slow starting speed; once the worker holds the model, no load is
    # planned (the speeds move only on several clients' votes: one client's calls leave them where they were).
    assert new_worker == [True, False, False]
    assert asked[0] >= 1 + 20 + 64 / (4 * 0.8) and asked[1] <= asked[0] - 20 and asked[2] == asked[1]


def test_an_error_raised_in_the_worker_comes_back_as_a_message_and_leaves_the_worker(
    server: RunningApp, client: Client, device_api: FakeDeviceApi, reference: Any
) -> None:
    worker = info(client)["worker"]
    too_long = "0123456789 " * 200  # within the character limit; in tokens it overflows the context
    with pytest.raises(AppError, match="context cannot hold it"):
        client.predict(**chat_args(too_long), api_name="/generate")
    raw = raw_call(server.url, "chat", raw_body(chat_args(too_long)))
    assert raw.event == "error" and "context cannot hold it" in raw.message
    assert [call.params["fail"] for call in device_api.of("/release")[-2:]] == ["false", "false"]
    text, _ = client.predict(**chat_args("hello world", max_tokens=32), api_name="/generate")
    assert text == answer(reference, "hello world", 32)
    after = info(client)["worker"]
    assert (after["pid"], after["loads"]) == (worker["pid"], 1), "the worker and its engine stayed"


def test_a_client_that_disconnects_mid_stream_stops_the_worker(
    server: RunningApp, client: Client, device_api: FakeDeviceApi, reference: Any
) -> None:
    worker = info(client)["worker"]
    base = server.url.rstrip("/") + "/gradio_api/call/chat"
    body = raw_body(chat_args("hello there", max_tokens=MAX_NEW_TOKENS))
    with httpx.Client(timeout=60) as http:
        event_id = http.post(base, content=body, headers={"Content-Type": "application/json"}).json()["event_id"]
        with http.stream("GET", f"{base}/{event_id}") as stream:
            chunks = 0
            for line in stream.iter_lines():
                chunks += line.startswith("event: generating")
                if chunks == 3:
                    break  # leaving the block closes the connection mid-answer
    info_when(client, "idle")  # the dropped connection has stopped the engine
    text, _ = client.predict(**chat_args("one two three", max_tokens=24), api_name="/generate")
    assert text == answer(reference, "one two three", 24), "the next answer is a fresh engine's"
    after = info(client)["worker"]
    stopped = after["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and stopped["n_generated"] < MAX_NEW_TOKENS
    assert (after["pid"], after["loads"]) == (worker["pid"], 1)
    assert device_api.of("/release")[-2].params["fail"] == "false", "the disconnected call kept its worker"


def test_the_web_process_never_loads_llama_cpp(client: Client) -> None:
    state = info(client)
    web = state["web_process"]
    assert web["backends_loaded"] is False and web["native_libraries"] == [] and web["live_handles"] == 0
    # The same from outside: the web process maps no llama.cpp library, while its GPU worker does.
    web_maps = Path(f"/proc/{web['pid']}/maps").read_text()
    worker_maps = Path(f"/proc/{state['worker']['pid']}/maps").read_text()
    assert "libllama" not in web_maps and "libggml" not in web_maps
    assert "libllama" in worker_maps, "the check would see a loaded library"


def test_a_lost_worker_is_replaced_and_the_next_request_plans_its_load(
    client: Client, device_api: FakeDeviceApi, reference: Any
) -> None:
    old = info(client)["worker"]
    job = client.submit(**chat_args("fox dog fox dog", max_tokens=MAX_NEW_TOKENS), api_name="/chat")
    take_outputs(job, 2)  # the worker is answering
    os.kill(old["pid"], signal.SIGKILL)  # the platform takes the worker away mid-answer
    with pytest.raises(AppError, match="GPU task aborted"):
        job.result()
    assert device_api.of("/release")[-1].params["fail"] == "true"
    before = info(client)["gpu_time"]
    assert before["worker_may_be_new"] is True
    text, stats = client.predict(**chat_args("hello world", max_tokens=32), api_name="/generate")
    assert text == answer(reference, "hello world", 32)
    assert stats["gpu_seconds_requested"] == planned_seconds(before, len("hello world"), 32)
    new = info(client)["worker"]
    assert new["pid"] != old["pid"] and new["loads"] == 1 and new["loaded_now"] is True
    assert len(device_api.of("/allow")) == 2


# -- fail fast ---------------------------------------------------------------------------------------------------


def test_a_cpu_build_on_zero_gpu_does_not_download_the_pair_and_says_how_to_fix_it(tmp_path: Path) -> None:
    hub = FakeHub().start()
    hub.add_file("test-org/big-target-GGUF", "big-target-Q4_K_M.gguf", b"GGUF" + bytes(64))
    hub.add_file("test-org/big-draft-GGUF", "big-draft-Q4_K_M.gguf", b"GGUF" + bytes(64))
    device_api = FakeDeviceApi().start()
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "DFLASH_CACHE_DIR": str(tmp_path / "hub-cache"),
        "DFLASH_TARGET_REPO": "test-org/big-target-GGUF",
        "DFLASH_TARGET_FILE": "big-target-Q4_K_M.gguf",
        "DFLASH_DRAFT_REPO": "test-org/big-draft-GGUF",
        "DFLASH_DRAFT_FILE": "big-draft-Q4_K_M.gguf",
        **device_api.env(tmp_path / "cgroup"),
    }
    app = launch_app(env, tmp_path / "server.log")
    try:
        client = Client(app.url, verbose=False)
        state = info(client)
        with urllib.request.urlopen(app.url.rstrip("/") + "/config", timeout=30) as response:
            config = json.load(response)
        text, stats = client.predict(**chat_args("hello world", max_tokens=16), api_name="/generate")
        with pytest.raises(AppError, match=re.escape("unknown preset 'qwen3.8-27b-dflash2'")):
            client.predict(**chat_args("hello", preset="qwen3.8-27b-dflash2"), api_name="/generate")
    finally:
        stop_app(app.process)
        hub.stop()
        device_api.stop()
    assert state["offline_demo"] is True and "cannot use the GPU on ZeroGPU" in state["mode_reason"]
    assert len(state["problems"]) == 1 and "CPU-only build" in state["problems"][0]
    assert FIX_COMMAND in state["fix"] and "requirements.txt" in state["fix"]
    banner = next(c["props"]["value"] for c in config["components"] if c["props"].get("elem_id") == "mode-banner")
    assert "CPU-only build" in banner and FIX_COMMAND in banner and "offline demo" in banner
    assert text and stats["n_generated"] == 16 and stats["preset"] == "tiny-random", "the offline demo still answers"
    assert [r.path for r in hub.requests if "/resolve/" in r.path] == [], "the pair must not be downloaded"
    assert state["download"]["state"] in ("idle", "done") and "big-target" not in state["download"]["summary"]


# -- several calls at once ---------------------------------------------------------------------------------------

CONCURRENT_CALLS = """
import json, os, sys, threading
import spaces  # the real package, on ZeroGPU (SPACES_ZERO_GPU=true) against the fake device API


@spaces.GPU(duration=10)
def worker_pid(release: str | None):
    yield os.getpid()  # where the call runs
    if release is not None:
        with open(release) as fifo:  # blocks, in the worker, until this process opens the FIFO for writing
            fifo.read()


pids, started = [0, 0], [threading.Event(), threading.Event()]


def call(index: int) -> None:
    calls = worker_pid(sys.argv[1 + index])
    pids[index] = next(calls)
    started[index].set()
    list(calls)


threads = [threading.Thread(target=call, args=(index,), daemon=True) for index in range(2)]
for thread, running in zip(threads, started):
    thread.start()
    assert running.wait(60), "a call did not start"  # the second starts while the first still runs in its worker
for release in sys.argv[1:3]:
    with open(release, "w") as fifo:
        fifo.write("end")
for thread in threads:
    thread.join(60)
assert not any(thread.is_alive() for thread in threads), "a call did not end"
print(json.dumps({"web": os.getpid(), "concurrent": pids, "after": next(worker_pid(None))}))
"""


def test_two_gpu_calls_at_once_run_in_two_worker_processes(tmp_path: Path) -> None:
    """What the real `spaces` does with a second call of a GPU generator while the first still runs: it forks a
    second worker (its `workers` cache holds one idle worker per GPU, taken out for the call), so the calls never
    share a process, let alone an engine; a later call reuses one of them. Hence DFLASH_PARALLEL=1 on ZeroGPU."""
    device_api = FakeDeviceApi().start()
    script, releases = tmp_path / "concurrent_calls.py", [tmp_path / "release-a", tmp_path / "release-b"]
    script.write_text(CONCURRENT_CALLS)
    for release in releases:
        os.mkfifo(release)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPACES_", "ZEROGPU_"))}
    env.update(device_api.env(tmp_path / "cgroup"))
    process = subprocess.Popen([sys.executable, str(script), *map(str, releases)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        stop_app(process)  # its process group: the workers `spaces` forked
        device_api.stop()
    assert process.returncode == 0, output
    seen = json.loads(output.strip().splitlines()[-1])
    first, second = seen["concurrent"]
    assert first != second and seen["web"] not in (first, second), f"the calls ran in one process: {seen}"
    assert seen["after"] in (first, second), "a later call reuses a worker"
    assert len(device_api.of("/allow")) == 2, "two workers, each allowed once"
    assert [call.params["fail"] for call in device_api.of("/release")] == ["false"] * 3


def test_more_than_one_answer_at_once_on_zero_gpu_stops_the_app_at_start(tmp_path: Path) -> None:
    device_api = FakeDeviceApi().start()
    env = {"DFLASH_DEMO": "tiny", "DFLASH_PARALLEL": "2", **device_api.env(tmp_path / "cgroup")}
    try:
        with pytest.raises(RuntimeError, match=re.escape("app.py exited")) as stopped:
            launch_app(env, tmp_path / "server.log")
    finally:
        device_api.stop()
    assert "DFLASH_PARALLEL=2 cannot take effect on ZeroGPU" in str(stopped.value)
    assert "set DFLASH_PARALLEL=1 or auto" in str(stopped.value)


def test_the_v1_routes_say_zero_gpu_cannot_charge_their_caller(server: RunningApp, device_api: FakeDeviceApi) -> None:
    """Outside a Gradio event `spaces` finds no request, so no visitor's X-IP-Token, and schedules the GPU on the Space
    itself: the /v1 routes refuse to answer here (503, saying where they are served) and ask for no GPU."""
    scheduled = len(device_api.of("/schedule"))
    base = server.url.rstrip("/") + "/v1"
    assert httpx.get(base + "/models", timeout=30).json()["data"][0]["id"] == "tiny-random"
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    refused = httpx.post(base + "/chat/completions", json=body, timeout=60)
    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "not_served_here", refused.text
    assert "ZeroGPU" in error["message"] and "python -m dflash_runtime serve" in error["message"]
    assert len(device_api.of("/schedule")) == scheduled, "no GPU was asked for"
