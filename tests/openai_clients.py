"""Shared helpers of the /v1 tests: `python -m dflash_runtime serve` in a subprocess, raw SSE reads, and the checks
every /v1 server must pass (standalone and on the Space)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from app_fixtures import REPO_ROOT, free_port


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def serve_command(target: Path, draft: Path | None, port: int, *extra: str) -> list[str]:
    files = [str(target), *([str(draft)] if draft is not None else [])]
    return [sys.executable, "-m", "dflash_runtime", "serve", *files, "--port", str(port), *extra]


@contextmanager
def running_serve(target: Path, draft: Path | None, log_path: Path, *extra: str, env: dict[str, str] | None = None,
                  timeout_s: float = 120.0) -> Iterator[RunningServer]:  # fmt: skip
    """`python -m dflash_runtime serve` on a free port, until it prints where it serves; stopped when the block
    ends."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")} | (env or {})
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), environment.get("PYTHONPATH")) if p)
    process = subprocess.Popen(serve_command(target, draft, port, *extra), cwd=REPO_ROOT, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    ready = threading.Event()

    def copy() -> None:
        with log_path.open("w") as log:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                log.flush()
                if line.startswith("serving "):
                    ready.set()
        ready.set()

    threading.Thread(target=copy, daemon=True).start()
    try:
        assert ready.wait(timeout_s) and process.poll() is None, f"serve did not start:\n{log_path.read_text()}"
        yield RunningServer(process, f"http://127.0.0.1:{port}", log_path)  # listening once it says so
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The `data:` payloads of a server-sent event stream, JSON-decoded ("[DONE]" as is)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The error object of an OpenAI-shaped error answer (its four keys checked)."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]
