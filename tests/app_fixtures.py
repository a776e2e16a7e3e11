"""Shared test helpers for the Space: a local fake of the Hugging Face Hub's file endpoints, free ports, and a
launcher for `app.py` in a subprocess."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from local_http import origin, serve, shut

REPO_ROOT = Path(__file__).resolve().parent.parent
PIECE = 64 * 1024
GATE_TIMEOUT_S = 120.0
FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class FakeHubRequest:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    """Serves `/{repo}/resolve/{revision}/{file}` like the Hub does for `hf_hub_download`: HEAD with the commit,
    ETag and size headers, GET with Range support."""

    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    # One entry per coming GET: "truncate" sends half the body then closes, "error" answers HTTP 500, "ok" serves.
    planned_gets: list[str] = field(default_factory=list)
    # Closed: a GET waits here before sending its body (a download held open, to watch it while it runs).
    gate: threading.Event | None = None
    requests: list[FakeHubRequest] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return origin(self.server)

    def add_file(self, repo: str, filename: str, content: bytes) -> None:
        self.files[(repo, filename)] = content

    def get_count(self, filename: str) -> int:
        return sum(1 for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename))

    def start(self) -> FakeHub:
        self.server = serve(self._answer)
        return self

    def stop(self) -> None:
        shut(self.server)

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        if handler.command not in ("GET", "HEAD"):
            handler.send_error(501)  # file downloads only
            return
        self._serve(handler, send_body=handler.command == "GET")

    def _lookup(self, path: str) -> bytes | str:
        """The file's bytes, or the Hub's error code when there is none."""
        parts = unquote(path.split("?")[0]).strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return "RepoNotFound"
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        if not any(known_repo == repo for known_repo, _ in self.files):
            return "RepoNotFound"
        return self.files.get((repo, filename), "EntryNotFound")

    def _serve(self, handler: BaseHTTPRequestHandler, send_body: bool) -> None:
        range_header = handler.headers.get("Range")
        auth = handler.headers.get("Authorization")
        self.requests.append(FakeHubRequest(handler.command, handler.path, range_header, auth))
        content = self._lookup(handler.path)
        if isinstance(content, str):
            self._reply_error(handler, 404, content)
            return
        fault = self.planned_gets.pop(0) if send_body and self.planned_gets else "ok"
        if fault == "error":
            self._reply_error(handler, 500, None)
            return
        start = int(range_header.split("=")[1].split("-")[0]) if range_header else 0
        body = content[start:]
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", FAKE_COMMIT)
        handler.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
        handler.send_header("Content-Length", str(len(body)))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        handler.end_headers()
        if not send_body:
            return
        if fault == "truncate":
            handler.wfile.write(body[: len(body) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.gate is not None and not self.gate.wait(GATE_TIMEOUT_S):
            handler.close_connection = True
            return
        for offset in range(0, len(body), PIECE):
            handler.wfile.write(body[offset : offset + PIECE])

    @staticmethod
    def _reply_error(handler: BaseHTTPRequestHandler, status: int, error_code: str | None) -> None:
        handler.send_response(status)
        if error_code:
            handler.send_header("X-Error-Code", error_code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()


@dataclass
class RunningApp:
    process: subprocess.Popen[str]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def launch_app(
    env_overrides: dict[str, str],
    log_path: Path,
    timeout_s: float = 180.0,
    python: str = sys.executable,
    app_dir: Path = REPO_ROOT,
    command: list[str] | None = None,
) -> RunningApp:
    """Run `python app.py` (in app_dir, with that interpreter), or `command` there (what ends by starting it), on
    127.0.0.1 at a free port; wait until it answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "GRADIO_", "SPACES_"))}
    env.update(
        {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
         "PYTHONUNBUFFERED": "1"}  # its lines reach the log (and the readiness check) as they are printed
    )
    env.update(env_overrides)
    process = subprocess.Popen(
        command or [python, str(app_dir / "app.py")],
        cwd=app_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own: stop_app ends the GPU worker `spaces` forks with it
    )
    ready, serving = threading.Event(), threading.Event()  # ready: serving, or the process's output ended
    threading.Thread(target=_copy_output, args=(process, log_path, ready, serving), daemon=True).start()
    url = f"http://127.0.0.1:{port}/"
    if ready.wait(timeout_s) and not serving.is_set():
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)  # its output ended without serving: it is exiting
    if serving.is_set() and process.poll() is None:
        with urllib.request.urlopen(url, timeout=30) as response:
            if response.status == 200:
                return RunningApp(process, url, log_path)
    if process.poll() is not None:
        process.wait(timeout=10)
        raise RuntimeError(f"app.py exited with {process.returncode}:\n{log_path.read_text()}")
    stop_app(process)
    raise TimeoutError(f"app.py did not answer on {url} within {timeout_s} s:\n{log_path.read_text()}")


@contextmanager
def running_app(env_overrides: dict[str, str], log_path: Path, **options: Any) -> Iterator[RunningApp]:
    """`launch_app`, stopped when the block ends however it ends; the log's folder is made if need be."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    app = launch_app(env_overrides, log_path, **options)
    try:
        yield app
    finally:
        stop_app(app.process)


def _copy_output(process: subprocess.Popen[str], log_path: Path, ready: threading.Event,
                 serving: threading.Event) -> None:  # fmt: skip
    """The server's output into its log file, line by line; `serving` (and `ready`) once Gradio prints where it
    serves, `ready` alone when the output ends before."""
    with log_path.open("w") as log_file:
        assert process.stdout is not None
        for line in process.stdout:
            log_file.write(line)
            log_file.flush()
            if "Running on local URL" in line:
                serving.set()
                ready.set()
    ready.set()


def stop_app(process: subprocess.Popen[str]) -> None:
    """Stop the app and what it started: on ZeroGPU `spaces` forks a GPU worker that outlives its parent otherwise."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # a worker left in the group
