"""A local fake of ZeroGPU's device API: the endpoints `spaces/zero/api.py` calls, answered the way `spaces` 0.51.3
parses them. With it, `SPACES_ZERO_GPU=true` runs the real `spaces` package's fork-a-worker path on a CPU machine.

POST /startup-report; POST /schedule (JSON ScheduleResponse: idle, nvidiaIndex, nvidiaUUID, allowToken); POST /allow
(the worker's pid); POST /release (fail=true when `spaces` threw the worker away); GET /queue-size.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from local_http import origin, serve, shut


@dataclass(frozen=True)
class DeviceCall:
    path: str
    params: dict[str, str]


@dataclass
class FakeDeviceApi:
    calls: list[DeviceCall] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tokens: int = 0
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        assert self.server is not None
        return origin(self.server)

    def env(self, cgroup_file: Path) -> dict[str, str]:
        """The environment that points `spaces` at this fake (and at a cgroup file of its own)."""
        cgroup_file.write_text("0::/fake-zerogpu-space\n")
        return {
            "SPACES_ZERO_GPU": "true",
            "SPACES_ZERO_DEVICE_API_URL": self.url,
            "ZEROGPU_PROC_SELF_CGROUP_PATH": str(cgroup_file),
        }

    def of(self, path: str) -> list[DeviceCall]:
        with self._lock:
            return [call for call in self.calls if call.path == path]

    def wait_for(self, path: str, count: int, timeout_s: float = 60.0) -> list[DeviceCall]:
        """The calls to `path` once there are at least `count` of them (TimeoutError otherwise)."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.of(path)) >= count, timeout_s):
                raise TimeoutError(f"{path}: {len(self.of(path))} calls after {timeout_s} s, expected {count}")
        return self.of(path)

    def start(self) -> FakeDeviceApi:
        self.server = serve(self._answer)
        return self

    def stop(self) -> None:
        shut(self.server)

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        params = {key: values[-1] for key, values in parse_qs(url.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        if length:
            handler.rfile.read(length)
        body: object = None
        with self._lock:
            self.calls.append(DeviceCall(url.path, params))
            if url.path == "/schedule":
                self._tokens += 1
                body = {"idle": True, "nvidiaIndex": 0, "nvidiaUUID": "GPU-fake", "allowToken": f"token-{self._tokens}"}
            elif url.path == "/queue-size":
                body = 0
        with self._changed:
            self._changed.notify_all()
        known = ("/startup-report", "/schedule", "/allow", "/release", "/queue-size")
        status = 200 if url.path in known else 404
        data = json.dumps(body).encode() if body is not None else b""
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
