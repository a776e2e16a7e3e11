"""Ctrl+C (SIGINT) stops `python -m dflash_runtime serve` and `app.py` cleanly: no traceback, the shell's status of
a command Ctrl+C ended (130) or Gradio's own clean exit, within seconds, also while an answer streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from app_fixtures import REPO_ROOT, free_port
from openai_clients import running_serve

from dflash_runtime.testing.tiny_models import tiny_pair

ARTIFACTS = REPO_ROOT / "test-artifacts"
STOPPED = 128 + signal.SIGINT


@pytest.fixture(autouse=True)
def ctrl_c_heard() -> Iterator[None]:
    """A test run started in the background ignores SIGINT, and a child inherits that (and rightly keeps ignoring
    it); a handled signal is not inherited, so the children these tests start hear Ctrl+C as a terminal's would."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_serve_while_an_answer_streams_without_a_traceback() -> None:
    pair = tiny_pair("dense", "dflash2")
    log = ARTIFACTS / "ctrl_c_serve.log"
    with running_serve(pair.target, pair.draft, log) as server:
        first_chunk = threading.Event()

        def ask() -> None:
            body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4000, "stream": True}
            try:
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
                    for _ in response.iter_lines():
                        first_chunk.set()
            except httpx.HTTPError:
                pass  # the server went away mid-answer: what this test does
            first_chunk.set()

        reader = threading.Thread(target=ask, daemon=True)
        reader.start()
        assert first_chunk.wait(60), "no answer streamed"
        os.kill(server.process.pid, signal.SIGINT)
        status = server.process.wait(timeout=15)  # the answer, of 4000 tokens, is cancelled, not waited for
        reader.join(30)
    text = log.read_text()
    assert status == STOPPED, text
    assert "Traceback" not in text and "Error" not in text, text
    assert text.rstrip().endswith("stopped"), text


def test_ctrl_c_stops_the_space_while_it_is_being_built_without_a_traceback() -> None:
    """Ctrl+C during app.py's imports and build check (the seconds before the page serves); once it serves,
    Gradio's own handler closes the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "GRADIO_"))}
    env.update({"DFLASH_DEMO": "tiny", "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(free_port()),
                "PYTHONUNBUFFERED": "1"})  # fmt: skip
    process = subprocess.Popen([sys.executable, str(REPO_ROOT / "app.py")], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # the first line it logs: the imports are done, the build goes on
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    output = first + rest
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "ctrl_c_app.log").write_text(output)
    assert process.returncode == STOPPED, output
    assert "Traceback" not in output and "Running on" not in output, output
