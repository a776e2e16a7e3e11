"""An RPC server on this machine's loopback, started the way a user starts one (`python -m dflash_runtime rpc-server`),
for tests and the loopback benchmark: ready once it answers a probe, killed and restarted on the same port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import RemoteDeviceError
from ..native.rpc import probe

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LoopbackServer:
    """`python -m dflash_runtime rpc-server --host 127.0.0.1` on a port of its own, with its CPU device."""

    def __init__(self, port: int | None = None, threads: int = 1, log: Path | None = None) -> None:
        self.port = port or free_port()
        self.threads = threads
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> LoopbackServer:
        out = self.log.open("ab") if self.log is not None else subprocess.DEVNULL
        command = [sys.executable, "-m", "dflash_runtime", "rpc-server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--threads", str(self.threads), "--device", "CPU"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parents[2]),
                                                                          os.environ.get("PYTHONPATH"))))}
        self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the server answers a probe (it binds its port a moment after starting), within READY_TIMEOUT_S."""
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                probe("127.0.0.1", self.port, timeout_s=5.0)
                return
            except RemoteDeviceError as error:
                if time.monotonic() > deadline:
                    raise RemoteDeviceError(f"the RPC server on port {self.port} did not start: {error}") from None
            try:  # a short wait that also ends, with the reason, if the server exited
                code = self.process.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            raise RemoteDeviceError(f"the RPC server on port {self.port} exited with status {code}")

    def kill(self) -> None:
        """SIGKILL, as a machine that goes away: no goodbye on its sockets beyond what the kernel sends."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
