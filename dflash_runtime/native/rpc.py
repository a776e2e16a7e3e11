"""Remote devices through llama.cpp's RPC backend: a pair's layers spread over other machines' devices.

On every machine that lends its devices, one command starts ggml's RPC server (the wheel's `ggml-rpc-server`):

    python -m dflash_runtime rpc-server --host 0.0.0.0 --port 50052

and the process that runs the pair names the servers: `load_pair(target, draft, rpc=["gpu-box-2:50052"], ...)`.
Each server's devices are added to the pair's device list through the RPC backend's `ggml_backend_rpc_add_server`,
as llama.cpp's `--rpc` does (common/arg.cpp), ahead of the local GPUs (upstream's order: the last layers and the
output head stay local where there is a local GPU); libllama then places layers over them by `n_gpu_layers` and
`tensor_split` exactly as over local GPUs.

Two things differ from `--rpc`. The devices are not registered process-wide (`ggml_backend_register`): a registered
RPC backend makes libllama report GPU offload and puts the remote devices first in every model's default device
list, which would change every other pair in the process; a pair passes its device list explicitly instead. And
ggml's client never connects to a server itself: it aborts the process when a socket fails, so it talks to a relay
(rpc_relay.py) that turns a lost server into `RemoteDeviceError`, checked after every decode (`raise_if_lost`).

An RPC server trusts whoever connects: it runs any graph and reads or writes any of its memory on request. Never
expose one beyond a network you trust (upstream's words: never on an open network).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RemoteDeviceError
from .rpc_relay import (
    CONN_CAPS_SIZE,
    DEVICE_COUNT,
    GET_DEVICE_MEMORY,
    HELLO,
    PROTO_MAJOR,
    PROTO_MINOR,
    Relay,
    recv_exact,
)

DEFAULT_PORT = 50052
CONNECT_TIMEOUT_S = 5.0
# How long a reply may take. The longest wait is a graph's end (a prefill ubatch on the server), so this is generous;
# a vanished host is noticed sooner through TCP keepalives (rpc_relay.tune_upstream).
REPLY_TIMEOUT_S = 60.0
# An engine just closed lets go of its connection in ggml's own time (its last buffer freed): how long a new load
# waits for that before it says an engine that used a lost server is still open.
SESSION_END_S = 2.0
SERVER_BINARY = "ggml-rpc-server"
MODULE = Path("rpc") / "libggml-rpc.so"  # under llama_cpp/lib: loaded on request only (see build_wheel.py)


def parse_endpoint(text: str) -> tuple[str, int]:
    """"host:port" -> (host, port); a clear error for anything else."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an RPC endpoint is host:port, e.g. 192.168.1.20:{DEFAULT_PORT} (got {text!r})")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class RemoteDevice:
    """A device of an RPC server, as this process's ggml names it ("RPC0", "RPC1", ...)."""

    name: str
    endpoint: str
    index: int  # the device's number on its server
    handle: int  # ggml_backend_dev_t
    free_at_load: int
    total: int


def probe(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> list[tuple[int, int]]:
    """Ask a server, over a connection of its own, for its protocol version and its devices' (free, total) memory.
    Raises RemoteDeviceError naming the endpoint when it is unreachable, silent or speaks another protocol."""
    endpoint = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            hello = ask(sock, HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE)
            if hello[0] != PROTO_MAJOR or hello[1] > PROTO_MINOR:
                raise RemoteDeviceError(f"the RPC server at {endpoint} speaks protocol {hello[0]}.{hello[1]}, this "
                                        f"build {PROTO_MAJOR}.{PROTO_MINOR}: run the same llama.cpp build on both ends")
            (count,) = struct.unpack("<I", ask(sock, DEVICE_COUNT, b"", 4))
            return [struct.unpack("<QQ", ask(sock, GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                    for i in range(count)]  # fmt: skip
    except TimeoutError:
        raise RemoteDeviceError(
            f"the RPC server at {endpoint} did not answer within {timeout_s:g} s (an rpc-server serves one client at a "
            "time: is another process using it?)") from None
    except (OSError, EOFError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise RemoteDeviceError(f"the RPC server at {endpoint} is not reachable: {reason}") from None


def ask(sock: socket.socket, cmd: int, payload: bytes, n_reply: int) -> bytes:
    """One command and its reply over a connection of its own to a server."""
    sock.sendall(bytes((cmd,)) + struct.pack("<Q", len(payload)) + payload)
    (size,) = struct.unpack("<Q", recv_exact(sock, 8))
    if size != n_reply:
        raise EOFError(f"replied {size} bytes, not {n_reply}")
    return recv_exact(sock, n_reply)


_relays: dict[tuple[str, int], Relay] = {}
_relays_lock = threading.Lock()


def relay_for(host: str, port: int, reply_timeout_s: float = REPLY_TIMEOUT_S) -> Relay:
    """The process's relay to that server (made once: ggml keeps the devices registered through it)."""
    with _relays_lock:
        relay = _relays.get((host, port))
        if relay is None:
            relay = _relays[(host, port)] = Relay(host, port, connect_timeout_s=CONNECT_TIMEOUT_S,
                                                  reply_timeout_s=reply_timeout_s)
        relay.reply_timeout_s = reply_timeout_s
        return relay


def _ggml() -> ctypes.CDLL:
    from .backends import ggml_library, load_backends

    load_backends()
    lib = ggml_library()
    for name, args, res in (("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p),
                            ("ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
                            ("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t),
                            ("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p),
                            ("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p)):  # fmt: skip
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    return lib


_add_server: Any = None


def add_server_function() -> Any:
    """`ggml_backend_rpc_add_server`: from a registered RPC backend (a build that links or loads it), else from the
    wheel's RPC module, loaded without registering it (see the module doc)."""
    global _add_server
    if _add_server is None:
        lib = _ggml()
        reg = lib.ggml_backend_reg_by_name(b"RPC")
        address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
        if address:
            fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)
        else:
            from .backends import library_dir

            path = library_dir() / MODULE
            if not path.is_file():
                raise RemoteDeviceError(
                    f"this llama-cpp-python build has no RPC backend ({path} is missing): install the wheel that "
                    "prebuilt_wheels/build_wheel.py builds (GGML_RPC=ON)")
            fn = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL).ggml_backend_rpc_add_server
            fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_void_p
        _add_server = fn
    return _add_server


def device_memory(handle: int) -> tuple[int, int]:
    """(free, total) bytes of a ggml device, as its backend reports them (for a remote one: its server)."""
    lib = _ggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


class RemoteDevices:
    """The remote devices of one pair: each server probed, then its devices registered through its relay."""

    def __init__(self, endpoints: Sequence[str], *, reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError(f"rpc takes a list of host:port endpoints (got {endpoints!r})")
        addresses = list(dict.fromkeys(parse_endpoint(e) for e in endpoints))
        self.relays = [relay_for(host, port, reply_timeout_s) for host, port in addresses]
        self._baseline = {id(r): r.stand_ins for r in self.relays}
        self.devices: list[RemoteDevice] = []
        lib = _ggml()
        for relay in self.relays:
            self.devices += self._register(lib, relay)

    def _register(self, lib: ctypes.CDLL, relay: Relay) -> list[RemoteDevice]:
        session = relay.live_session()
        if session is not None and session.lost is not None and not session.ended.wait(SESSION_END_S):
            raise RemoteDeviceError(
                f"the RPC server at {relay.endpoint} went away ({session.lost}) while an engine that used it is "
                "still open: close that engine before loading again")
        if session is None or session.ended.is_set():
            probe(relay.host, relay.port)  # nothing of ggml's is connected: fail here, before any native call
        reg = add_server_function()(relay.address.encode())
        self.raise_if_lost()
        if not reg:
            raise RemoteDeviceError(f"the RPC server at {relay.endpoint} has no devices")
        devices = []
        for i in range(lib.ggml_backend_reg_dev_count(reg)):
            handle = lib.ggml_backend_reg_dev_get(reg, i)
            free, total = device_memory(handle)
            name = (lib.ggml_backend_dev_name(handle) or b"RPC").decode()
            devices.append(RemoteDevice(name, relay.endpoint, i, handle, free, total))
        self.raise_if_lost()
        return devices

    def lost(self) -> str | None:
        """Why the pair's numbers are void, when a server went away since the pair was opened (None otherwise)."""
        for relay in self.relays:
            if relay.stand_ins > self._baseline[id(relay)]:
                return f"the RPC server at {relay.endpoint} went away: {relay.last_loss or 'connection lost'}"
        return None

    def raise_if_lost(self) -> None:
        why = self.lost()
        if why is not None:
            raise RemoteDeviceError(why)

    def endpoint_of(self, device_name: str) -> str | None:
        return next((d.endpoint for d in self.devices if d.name == device_name), None)

    def traffic(self) -> dict[str, dict[str, object]]:
        """Per server, what went through its relay since the process began (round trips, bytes, commands)."""
        return {relay.endpoint: relay.traffic.to_dict() for relay in self.relays}


# Contexts whose decodes use remote devices, by address: checked after each of their native calls.
_watched: dict[int, RemoteDevices] = {}


def _address(ctx: Any) -> int:
    return ctx if isinstance(ctx, int) else int(ctypes.cast(ctx, ctypes.c_void_p).value or 0)


def watch(ctx: Any, remote: RemoteDevices) -> None:
    _watched[_address(ctx)] = remote


def unwatch(ctx: Any) -> None:
    _watched.pop(_address(ctx), None)


def raise_if_lost(ctx: Any) -> None:
    """After a native call on `ctx`: RemoteDeviceError when a server it computes on went away meanwhile (its results
    are then the relay's stand-ins, never to be used)."""
    if _watched:
        remote = _watched.get(_address(ctx))
        if remote is not None:
            remote.raise_if_lost()


def remote_memory(endpoints: Sequence[str]) -> list[tuple[str, int, int]]:
    """(endpoint, free, total) of every device of these servers, without loading anything (a server ggml is connected
    to answers through its devices). Raises RemoteDeviceError for a server that cannot be reached."""
    out: list[tuple[str, int, int]] = []
    for host, port in dict.fromkeys(parse_endpoint(e) for e in endpoints):
        relay = _relays.get((host, port))
        session = relay.live_session() if relay is not None else None
        if relay is not None and session is not None and session.lost is None:
            out += [(relay.endpoint, *device_memory(d.handle)) for d in RemoteDevices([f"{host}:{port}"]).devices]
        else:
            out += [(f"{host}:{port}", free, total) for free, total in probe(host, port)]
    return out


def server_binary() -> Path:
    """The wheel's ggml-rpc-server (llama_cpp/lib, beside the libraries and backend modules it loads)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RemoteDeviceError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "lib" / SERVER_BINARY


def server_command(host: str, port: int, *, threads: int | None = None, devices: str | None = None,
                   cache: bool = False) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start the wheel's RPC server: its RPC backend module is outside the folder ggml
    loads every module from, so GGML_BACKEND_PATH names it."""
    binary = server_binary()
    module = binary.parent / MODULE
    missing = [str(p) for p in (binary, module) if not p.is_file()]
    if missing:
        raise RemoteDeviceError(f"{' and '.join(missing)} not found: install the wheel that prebuilt_wheels/"
                                "build_wheel.py builds (it builds the RPC backend and its server into every variant)")
    argv = [str(binary), "--host", host, "--port", str(port)]
    if threads:
        argv += ["--threads", str(threads)]
    if devices:
        argv += ["--device", devices]
    if cache:
        argv.append("--cache")
    return argv, {**os.environ, "GGML_BACKEND_PATH": str(module)}
